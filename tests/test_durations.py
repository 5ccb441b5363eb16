"""Durations as admins write them: parsing, "no limit", clear errors, formatting."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_spawner.core.durations import DurationError, format_duration, parse_duration


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("8h", 28800),
        ("1d", 86400),
        ("1w", 7 * 86400),
        ("1h30m", 5400),
        ("1h 30m", 5400),
        ("1d12h", 129600),
        ("2h30m15s", 9015),
        ("2 hours, 30 minutes", 9000),
        ("45 min", 2700),
        ("1.5h", 5400),
        ("1H30M", 5400),
        ("3600", 3600),
        (" 45 ", 45),
        ("0.5", 0.5),
        (90, 90),
        (2.5, 2.5),
        (timedelta(minutes=5), 300),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", [None, 0, 0.0, "0", "0m", "0h0m", "never", " Never ", timedelta(0)]
)
def test_no_limit_values_parse_to_none(value: object) -> None:
    assert parse_duration(value) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("30x", "'30x': unknown unit 'x'; use seconds (90) or units s, m, h, d, w"),
        ("30m1h", "'30m1h': write each unit once, largest first (e.g. '1h30m'), found 'h'"),
        ("1h1h", "'1h1h': write each unit once, largest first"),
        ("-5", "'-5' is negative; a duration must be zero or more (0 means no limit)"),
        (-5, "-5 is negative; a duration must be zero or more"),
        (timedelta(seconds=-1), "is negative"),
        ("", "'' is not a duration; use seconds (90)"),
        ("h", "'h' is not a duration"),
        ("1..5h", "'1..5h' is not a duration"),
        ("thirty minutes", "'thirty minutes' is not a duration"),
        (math.nan, "nan is not a duration"),
        # No limit is None, 'never' or 0: a budget of inf must not pass for "no budget".
        (math.inf, "inf is not a duration: write 'never' or None for no limit"),
        (-math.inf, "-inf is negative"),
        (True, "a duration must be a string or a number, got bool True"),
        ([30], "a duration must be a string or a number, got list [30]"),
    ],
)
def test_bad_durations_say_what_is_wrong(value: object, message: str) -> None:
    with pytest.raises(DurationError) as err:
        parse_duration(value)
    assert message in str(err.value)


def test_durations_that_must_be_a_real_span_refuse_no_limit() -> None:
    assert parse_duration("30s", unlimited_ok=False) == 30
    with pytest.raises(DurationError, match="'never' means no limit, but a positive duration"):
        parse_duration("never", unlimited_ok=False)
    with pytest.raises(DurationError, match="0 means no limit"):
        parse_duration(0, unlimited_ok=False)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (5400, "1h 30m"),
        (90, "1m 30s"),
        (86400 + 3600 + 61, "1d 1h 1m 1s"),
        (7 * 86400, "7d"),
        (59.6, "1m"),
        (0, "0s"),
        (0.25, "0.25s"),
        (None, "never"),
        (math.inf, "never"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_duration_refuses_negative() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        format_duration(-1)


@given(st.integers(min_value=1, max_value=10**8))
def test_format_then_parse_gives_the_same_seconds(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
