"""What a server is for: the purpose a user gives at spawn, checked and cleaned.

The groups' policies say what the form asks (:class:`PurposeRule`: admin-defined
choices, short free text, or both; optional or required); :func:`clean_purpose` turns
what a spawn sent into the text the lease records, or refuses it in words. Pure: no
I/O. Admin documentation: docs/policies.md, "Purpose".
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from mig_spawner.core.refusal import Reason, Refused

#: The user option that carries the purpose.
PURPOSE = "purpose"
#: The most characters a purpose keeps (the form's field allows no more; an API spawn
#: that sends more is refused, never cut, so that what is recorded is what was said).
MAX_PURPOSE_LENGTH = 80


@dataclass(frozen=True)
class PurposeRule:
    """What a user's groups ask about a server's purpose.

    ``choices``: the admin's words to pick from; ``free_text``: the user may write their
    own; ``required``: a spawn without a purpose is refused. No choices and no free
    text: nothing is asked, and a purpose sent anyway is refused.
    """

    choices: tuple[str, ...] = ()
    free_text: bool = True
    required: bool = False

    @property
    def asked(self) -> bool:
        """Whether the form asks for a purpose at all."""
        return bool(self.choices) or self.free_text


def sanitise(text: str) -> str:
    """``text`` on one line: runs of white space (newlines, tabs) become one space,
    other control and format characters (escape sequences, zero-width marks,
    bidirectional overrides) are dropped, and the ends are trimmed."""
    kept = []
    for char in text:
        if char.isspace():
            kept.append(" ")
        elif unicodedata.category(char)[0] != "C":
            kept.append(char)
    return " ".join("".join(kept).split())


def clean_purpose(value: object, rule: PurposeRule, *, for_form: bool = False) -> str | None:
    """The purpose to record for ``value`` (what the spawn sent; ``None`` or ``""``:
    none given), or raises :class:`Refused` (``INVALID_OPTIONS``) saying what to send.

    ``for_form``: the refusal is a sentence for the spawn page, not advice on what a
    script should send.
    """
    if value is not None and not isinstance(value, str):
        raise _refused(
            "The purpose must be text." if for_form
            else f"'{PURPOSE}' must be a string, not {type(value).__name__}"
        )
    text = sanitise(value or "")
    if not text:
        if rule.required:
            raise _refused(_missing(rule, for_form))
        return None
    if not rule.asked:
        raise _refused(
            "This hub does not ask what a server is for; leave the purpose empty."
            if for_form else f"this hub records no '{PURPOSE}'; send only 'profile'"
        )
    if len(text) > MAX_PURPOSE_LENGTH:
        raise _refused(
            f"The purpose is {len(text)} characters long; say it in at most "
            f"{MAX_PURPOSE_LENGTH}." if for_form
            else f"'{PURPOSE}' is {len(text)} characters long; at most {MAX_PURPOSE_LENGTH}"
        )
    if text in rule.choices or rule.free_text:
        return text
    raise _refused(
        f"Pick what this server is for from the list: {_listed(rule.choices)}."
        if for_form else f"'{PURPOSE}' must be one of: {_listed(rule.choices)}"
    )


def _missing(rule: PurposeRule, for_form: bool) -> str:
    if for_form:
        how = "pick one from the list" if rule.choices and not rule.free_text else (
            "pick one from the list or describe it" if rule.choices else "describe it")
        return f"Say what this server is for: {how}."
    what = f"one of: {_listed(rule.choices)}" if rule.choices else "a short text"
    if rule.choices and rule.free_text:
        what += ", or a short text"
    return f"your groups ask what the server is for: send {{\"{PURPOSE}\": ...}} with {what}"


def _listed(choices: tuple[str, ...]) -> str:
    return ", ".join(choices)


def _refused(message: str) -> Refused:
    return Refused(Reason.INVALID_OPTIONS, message)
