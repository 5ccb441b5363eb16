"""Smoke test of benchmarks/day.py on one day: it runs and its table adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DAY = Path(__file__).resolve().parent.parent / "benchmarks" / "day.py"


def _day_module():
    spec = importlib.util.spec_from_file_location("day_benchmark", DAY)
    assert spec is not None and spec.loader is not None
    day = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = day  # dataclasses look their module up there
    spec.loader.exec_module(day)
    return day


def test_a_day_runs_and_the_table_adds_up(capsys) -> None:
    day = _day_module()
    rows = day.main(["--days", "1", "--seed", "7"])
    sessions = len(day.trace(7))
    assert list(rows) == ["(a) static+culler 1h", "(b) pool", "(c) pool+wait",
                          "(d) dynamic+wait", "(c*) clairvoyant", "(d*) clairvoyant",
                          "(c) 25% answer", "(d) 25% answer"]
    for values in rows.values():
        # Every session is served or given up on (reuse of a running server included).
        assert values["served"] + values["gave up"] == sessions
        assert 0 < values["util %"] <= 100
    out = capsys.readouterr().out
    assert "ratio to (a)" in out and "int/served" in out
    assert "goals, each on seeds 7-7, 8-8, 9-9, nobody answering" in out
    for name in ("(b) pool", "(c) pool+wait", "(d) dynamic+wait"):
        assert f"\n{name:21} served " in out
    # The product warns before its idle stops; the culler of (a) never does.
    assert rows["(a) static+culler 1h"]["warned"] == 0 < rows["(c) pool+wait"]["warned"]


def _run(day, mode: str, sessions):
    """One day of the pool (``mode`` "pool"), the pool with its wait list ("wait") under
    the shipped limits, or that with the clairvoyant reclaim ("bound"), on a
    hand-written trace."""
    setup = {s.name: s for s in day.setups(3, None, day.shipped_limits(), 0.0)}[
        {"pool": "(b) pool", "wait": "(c) pool+wait", "bound": "(c*) clairvoyant"}[mode]]
    return day.Day(setup, sessions).run()


def test_the_clairvoyant_row_releases_when_work_ends_and_never_during_a_break() -> None:
    day = _day_module()
    H, M = day.H, day.M

    def session(user, arrive, work, break_at=None, break_len=0.0, forgets=False):
        return day.Session(user, "research", "3g.71gb", arrive, work, break_at, break_len,
                           forgets, False, 1.0)

    # The one 3g slice: its holder is done at 9:20 and forgets the server.
    forgotten = [session("research-0", 9 * H, 20 * M, forgets=True),
                 session("research-1", 9 * H + 5 * M, 30 * M)]
    bound, product = _run(day, "bound", forgotten), _run(day, "wait", forgotten)
    assert sorted(bound.waits) == [0.0, 15 * M]  # released at 9:20, granted then
    assert bound.idle_slice_s == 0 and bound.warnings == 0
    # The product tells a forgotten server from a break only by its idle limit: the
    # stop comes after the wait's 30 minutes, and research-1 gives up.
    assert (product.served, product.gave_up) == (1, 1) and product.idle_slice_s > 0
    # A break of 40 minutes while someone waits: the product stops the server (the test
    # above), the bound keeps it, holds the break's idle, and the waiter gives up.
    on_break = [session("research-0", 9 * H, 2 * H, 10 * M, 40 * M),
                session("research-1", 9 * H + 15 * M, 30 * M)]
    bound = _run(day, "bound", on_break)
    assert (bound.served, bound.interrupted, bound.gave_up) == (1, 0, 1)
    assert bound.idle_slice_s == 40 * M * 3


def test_an_interruption_is_a_server_stopped_during_its_users_break() -> None:
    day = _day_module()
    H, M = day.H, day.M

    def session(user, profile, arrive, work, break_at=None, break_len=0.0, forgets=False):
        return day.Session(user, user.split("-")[0], profile, arrive, work, break_at,
                           break_len, forgets, False, 1.0)

    # A later session of the same user, started during their break, is them coming back
    # early: nothing was stopped, so nobody was interrupted.
    back_early = [session("staff-0", "1g.18gb", 9 * H, 60 * M, 20 * M, 30 * M),
                  session("staff-0", "1g.18gb", 9 * H + 30 * M, 10 * M)]
    result = _run(day, "pool", back_early)
    assert (result.served, result.interrupted) == (2, 0)

    # The pool has one 3g slice: while someone waits for it, its holder's break of 40
    # minutes outlasts the limit while waited (plus the warning), and that is one.
    stopped = [session("research-0", "3g.71gb", 9 * H, 2 * H, 10 * M, 40 * M),
               session("research-1", "3g.71gb", 9 * H + 15 * M, 30 * M)]
    result = _run(day, "wait", stopped)
    assert (result.served, result.interrupted) == (2, 1)


def test_a_user_waits_once_and_a_later_session_is_served_with_that_wait() -> None:
    day = _day_module()
    H, M = day.H, day.M
    holder = day.Session("research-0", "research", "3g.71gb", 9 * H, 20 * M, None, 0.0,
                         False, False, 1.0)
    first, later = (day.Session("research-1", "research", "3g.71gb", 9 * H + at * M, 30 * M,
                                None, 0.0, False, False, 1.0) for at in (5, 10))
    result = _run(day, "wait", [holder, first, later])
    # The product keeps one wait a user (max_waiting_per_user): the later ask does not
    # queue a second wait that outlives the grant and expires as one given up.
    assert (result.served, result.gave_up, result.refusals) == (3, 0, 0)
    assert sorted(result.waits) == [0.0, 10 * M, 15 * M]  # the holder stops at 9:20
