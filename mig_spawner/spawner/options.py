"""Server-side validation of ``user_options``, whatever path they came by.

``user_options`` reach the spawner from the spawn form, from ``?opt-profile=...``
query arguments, or as the raw JSON body of a REST spawn request, which bypasses
the form entirely. So every spawn goes through :func:`requested_offer`, which
accepts exactly ``{"profile": "<offer key>", "purpose": "<text>"}`` (the purpose
optional unless the groups require it) for an offer the user's groups allow and
refuses anything else with a message that says what to send instead (on the spawn
page, in a sentence for the person there). A start that names no slice at all (an
admin's "Start Server", a script) gets the group's ``default_offer``.
The name is matched exactly as the hub writes it (the form's value): ``" small"``
or ``"MIG 1G.18GB"`` is refused with the name to send, never trimmed or
lower-cased into an offer, so that one name always means one offer.

JupyterHub (5.3+) hands ``user_options`` to ``Spawner.apply_user_options`` before
``start()`` and warns "Received unhandled user_options" when none is set; the mixin
sets it to validate them there (:func:`as_requested`). A REST spawn whose body names
no options would make JupyterHub reuse the last start's: it gets the group's
``default_offer`` instead (:func:`with_default`), or is refused naming the missing
choice (:func:`no_default_refusal`), so the slice a start gets never depends on what
an earlier one asked for.

No JupyterHub import: the mixin turns the :class:`~mig_spawner.core.refusal.Refused`
raised here into a ``SpawnException``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mig_spawner.core.policy import Offer, PolicySet, UserPolicy, is_profile_name, offer_key
from mig_spawner.core.purpose import PURPOSE
from mig_spawner.core.refusal import Reason, Refused

#: The user option naming the slice: the key of an offer (a profile like ``1g.18gb`` or
#: a slice class). The other one is :data:`~mig_spawner.core.purpose.PURPOSE`.
PROFILE = "profile"
#: Longer than any profile or class name; longer values are refused before any lookup.
MAX_VALUE_LENGTH = 64


def _invalid(message: str) -> Refused:
    return Refused(Reason.INVALID_OPTIONS, message)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def options_from_form(form_data: Mapping[str, Any]) -> dict[str, Any]:
    """Turn form or query data (each value a list of strings) into ``user_options``.

    One-element lists become their string; anything else is kept as it came, so
    that :func:`requested_offer` can say what was wrong with it. The hub's own
    ``_xsrf`` field is not a user option, nor a purpose field left empty.
    """
    options = {
        key: value[0] if isinstance(value, list) and len(value) == 1 else value
        for key, value in form_data.items()
        if key != "_xsrf"
    }
    if options.get(PURPOSE) == "":
        del options[PURPOSE]
    return options


def as_requested(handler: Any, user_options: Any) -> Any:
    """The ``user_options`` the request behind ``handler`` really sent: ``{}`` for a REST
    spawn whose body gives none (empty, ``{}``, ``{"user_options": null}``), where
    JupyterHub has put in the last start's options; ``user_options`` otherwise (the form
    and ``?opt-`` queries always send theirs; ``handler`` None: no request)."""
    read_server_body = getattr(handler, "get_server_json_body", None)  # JupyterHub 6
    if read_server_body is not None:
        return user_options if read_server_body().get("user_options") else {}
    read_body = getattr(handler, "get_json_body", None)  # 5.x: the whole body is the options
    if read_body is not None:
        return user_options if read_body() else {}
    return user_options


def _example(policy: UserPolicy) -> str:
    return ", ".join(policy.offer_keys) or "none (your groups allow no GPU slice)"


def _named(policy: UserPolicy) -> str:
    """The user's offers as the spawn form's headings name them, for a sentence."""
    return ", ".join(o.named for o in policy.offers) or "none"


def _first(policy: UserPolicy) -> str:
    return policy.offer_keys[0] if policy.offer_keys else "1g.18gb"


def requested_offer(
    user_options: Any, user_policy: UserPolicy, policies: PolicySet, *, for_form: bool = False,
) -> Offer:
    """The offer that ``user_options`` asks for, if the user may have it; else raises Refused.

    ``for_form``: the options came from the spawn page (a form post or ``?opt-`` query),
    so a refusal is a sentence for the person there; a REST spawn gets advice on what to
    send instead.
    """
    def say(api: str, form: str) -> str:
        return form if for_form else api

    if not isinstance(user_options, Mapping):
        raise _invalid(
            f'user options must be a JSON object like {{"{PROFILE}": "{_first(user_policy)}"}}, '
            f"not {type(user_options).__name__}"
        )
    extra = sorted(str(k) for k in user_options if k not in (PROFILE, PURPOSE))
    if extra:
        names = ", ".join(_short(k) for k in extra[:5]) + (" ..." if len(extra) > 5 else "")
        raise _invalid(say(
            f"unknown option(s) {names}; the options are '{PROFILE}' "
            f"(one of: {_example(user_policy)}) and '{PURPOSE}'",
            f"The spawn page sent something this hub does not know ({names}). Choose a "
            "GPU slice on the form and start again.",
        ))
    if not user_policy.has_gpu_access:
        raise Refused(Reason.NO_GPU_ACCESS, say(
            "your groups are not allowed any GPU slice on this hub; ask a hub admin to add "
            "you to a group with GPU access",
            "Your groups are not allowed any GPU slice on this hub. Ask a hub admin to add "
            "you to a group with GPU access.",
        ))
    value = user_options.get(PROFILE)
    if value is None or value == "":
        raise _invalid(say(
            f"choose a GPU slice: send {{\"{PROFILE}\": ...}} with one of: "
            f"{_example(user_policy)}",
            "Choose a GPU slice for this server: none was selected.",
        ))
    wrong = say("", f"That is not a GPU slice you can choose here. Choose one of: "
                    f"{_named(user_policy)}.")
    if not isinstance(value, str):
        raise _invalid(wrong or (
            f"'{PROFILE}' must be one name, not {type(value).__name__} {_short(value)}; "
            f"one of: {_example(user_policy)}"
        ))
    if len(value) > MAX_VALUE_LENGTH:
        raise _invalid(wrong or (
            f"'{PROFILE}' is {len(value)} characters long; names have at most "
            f"{MAX_VALUE_LENGTH} (one of: {_example(user_policy)})"
        ))
    mine = {offer.key: offer for offer in user_policy.offers}
    if value in mine:
        return mine[value]
    if value in policies.offers:
        raise Refused(Reason.NOT_ALLOWED, say(
            f"{value!r} is not allowed for your groups ({', '.join(user_policy.group_names)}); "
            f"allowed: {_example(user_policy)}",
            f"Your groups ({', '.join(user_policy.group_names)}) are not allowed "
            f"{policies.offers[value].named}. Choose one of: {_named(user_policy)}.",
        ))
    meant = offer_key(value)  # the offer a looser reading would have picked
    if meant in policies.offers:
        raise _invalid(wrong or (
            f"{_short(value)} is not written as this hub names the slice: names are "
            f"matched exactly; send {meant!r} (one of: {_example(user_policy)})"
        ))
    what = "MIG profile" if is_profile_name(value) else "slice"
    raise Refused(Reason.UNKNOWN_PROFILE, wrong or (
        f"{_short(value)} is not a {what} offered on this hub; choose one of: "
        f"{_example(user_policy)}"
    ))


def with_default(user_options: Any, user_policy: UserPolicy) -> Any:
    """``user_options`` of a start that names no slice (an admin's "Start Server" or
    "Start All", a REST spawn without options), with the user's default offer put in;
    unchanged when they name one, are not a dict, or no group names a default."""
    if not isinstance(user_options, Mapping) or user_options.get(PROFILE) not in (None, ""):
        return user_options
    default = user_policy.default_offer
    return user_options if default is None else {**user_options, PROFILE: default}


def no_default_refusal(user_policy: UserPolicy) -> Refused:
    """Why a start without options cannot go on, in the words of the admin page where
    "Start Server" and "Start All" send none: which choice is missing, and how to give it."""
    groups = ", ".join(user_policy.group_names)
    return _invalid(
        f"no GPU slice size was chosen: \"Start Server\" and \"Start All\" on the admin "
        f"page send none, and the user's groups ({groups}) name no default_offer; choose "
        f"one on the user's \"Spawn Page\", or send {{\"{PROFILE}\": ...}} with one of: "
        f"{_example(user_policy)}"
    )


def named_offer(user_options: Any, policies: PolicySet) -> Offer | None:
    """The hub's offer that ``user_options`` names, allowed to the user or not; None when
    they name none (a refusal is then about malformed input, not about demand)."""
    value = user_options.get(PROFILE) if isinstance(user_options, Mapping) else None
    if not isinstance(value, str) or not value or len(value) > MAX_VALUE_LENGTH:
        return None
    return policies.offers.get(value)
