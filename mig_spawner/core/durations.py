"""Durations as admins write them in config: ``"90s"``, ``"30m"``, ``"8h"``, ``"1h30m"``.

Rules (also in docs/policies.md):

* a plain number (``90``, ``"90"``, ``1.5``) is seconds;
* units ``s``, ``m`` (minutes, never months), ``h``, ``d``, ``w``, or their long forms
  (``sec``, ``min``, ``hours``, ``days``, ``weeks`` ...), combined largest first:
  ``"1d12h"``, ``"1h 30m"``, ``"2h30m15s"``; decimals are allowed (``"1.5h"``);
* ``None``, ``"never"`` and zero in any form (``0``, ``"0"``, ``"0m"``) mean *no limit*,
  returned as ``None``. This follows jupyterhub-idle-culler, where ``--max-age=0`` means
  no limit, so an admin's habit carries over. An infinite number (``float("inf")``) is
  refused, like NaN: no limit is written in one of those three ways, so that a budget of
  ``inf`` is not taken for "no budget" unseen;
* a ``datetime.timedelta`` is taken as is.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Literal, overload

NO_LIMIT_WORDS = ("never",)

# Unit aliases -> (canonical unit, seconds). Canonical units are what format_duration writes.
_UNITS: dict[str, tuple[str, int]] = {}
for _canonical, _seconds, _aliases in (
    ("w", 7 * 86400, ("w", "wk", "wks", "week", "weeks")),
    ("d", 86400, ("d", "day", "days")),
    ("h", 3600, ("h", "hr", "hrs", "hour", "hours")),
    ("m", 60, ("m", "min", "mins", "minute", "minutes")),
    ("s", 1, ("s", "sec", "secs", "second", "seconds")),
):
    for _alias in _aliases:
        _UNITS[_alias] = (_canonical, _seconds)

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_RE = re.compile(rf"^{_NUMBER}$")
_PART_RE = re.compile(rf"({_NUMBER})\s*([a-z]+)[\s,]*")
_WHOLE_RE = re.compile(rf"^(?:{_NUMBER}\s*[a-z]+[\s,]*)+$")

# format_duration writes days, hours, minutes and seconds (weeks read worse: "1w 2d").
_FORMAT_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))

_FORMS = "use seconds (90) or units s, m, h, d, w largest first (e.g. '90s', '30m', '1h30m')"
_HELP = f"{_FORMS}; 'never', None or 0 mean no limit"
_NEGATIVE = "{!r} is negative; a duration must be zero or more (0 means no limit)"


class DurationError(ValueError):
    """A value that is not a duration; the message says what is accepted."""


@overload
def parse_duration(value: object, *, unlimited_ok: Literal[True] = ...) -> float | None: ...


@overload
def parse_duration(value: object, *, unlimited_ok: Literal[False]) -> float: ...


def parse_duration(value: object, *, unlimited_ok: bool = True) -> float | None:
    """Seconds in ``value``, or ``None`` for "no limit" (see the module docstring).

    With ``unlimited_ok=False`` (for things that must be a real span, such as a poll
    interval) "no limit" values are refused instead of returned as ``None``.

    Raises :class:`DurationError` naming the bad value and the accepted forms.
    """
    seconds = _seconds(value)
    if seconds is None or seconds == 0:
        if not unlimited_ok:
            raise DurationError(
                f"{value!r} means no limit, but a positive duration is needed here: {_FORMS}"
            )
        return None
    return seconds


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return _number(value.total_seconds(), value)
    # bool is an int subclass; True is almost surely a mistake, not "1 second".
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise DurationError(
            f"a duration must be a string or a number, got "
            f"{type(value).__name__} {value!r}; {_HELP}"
        )
    if not isinstance(value, str):
        return _number(float(value), value)
    text = value.strip().lower()
    if text in NO_LIMIT_WORDS:
        return None
    if text.startswith("-"):
        raise DurationError(_NEGATIVE.format(value))
    if _PLAIN_RE.match(text):
        return float(text)
    if not _WHOLE_RE.match(text):
        raise DurationError(f"{value!r} is not a duration; {_HELP}")
    total = 0.0
    previous_size = math.inf
    for number, unit in _PART_RE.findall(text):
        if unit not in _UNITS:
            raise DurationError(f"{value!r}: unknown unit {unit!r}; {_HELP}")
        canonical, size = _UNITS[unit]
        if size >= previous_size:
            # "30m1h" or "1h1h" is more likely a typo than a wish to add things up.
            raise DurationError(
                f"{value!r}: write each unit once, largest first (e.g. '1h30m'), "
                f"found {canonical!r} out of order"
            )
        previous_size = size
        total += float(number) * size
    return total


def _number(seconds: float, original: object) -> float:
    if not math.isfinite(seconds) and seconds > 0:
        raise DurationError(f"{original!r} is not a duration: write 'never' or None for no "
                            "limit")
    if math.isnan(seconds):
        raise DurationError(f"{original!r} is not a duration; {_HELP}")
    if seconds < 0:
        raise DurationError(_NEGATIVE.format(original))
    return seconds


def format_duration(seconds: float | None) -> str:
    """``5400`` -> ``"1h 30m"``; ``None`` (no limit) -> ``"never"``.

    Whole seconds are shown (rounded); spans under a second keep their fraction
    (``"0.25s"``). The result parses back with :func:`parse_duration`.
    """
    if seconds is None or math.isinf(seconds):
        return "never"
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"cannot format {seconds!r} as a duration: it must not be negative")
    if 0 < seconds < 1:
        return f"{seconds:.3g}s"
    rest = round(seconds)
    parts = []
    for unit, size in _FORMAT_UNITS:
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts) or "0s"


def rounded_duration(seconds: float) -> str:
    """Time as a person reads it: whole seconds under a minute, else whole minutes
    (``"2h 5m"``, ``"40s"``)."""
    return format_duration(round(seconds) if seconds < 60 else 60 * round(seconds / 60))


#: Units a period is said in, largest first: (seconds, singular, plural).
_PERIOD_WORDS = ((86400, "day", "days"), (3600, "hour", "hours"), (60, "minute", "minutes"),
                 (1, "second", "seconds"))


def period_words(seconds: float) -> str:
    """A period as a person says it: ``604800`` -> ``"7 days"``, ``86400`` -> ``"day"``
    (as in *the last day*), ``5400`` -> ``"90 minutes"``: in the largest unit that
    divides it, else as :func:`format_duration` writes it."""
    whole = round(seconds)
    for size, one, many in _PERIOD_WORDS:
        if whole and whole % size == 0:
            count = whole // size
            return one if count == 1 else f"{count} {many}"
    return format_duration(seconds)
