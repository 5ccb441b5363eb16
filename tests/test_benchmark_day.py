"""Smoke test of benchmarks/day.py on one day: it runs and its table adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DAY = Path(__file__).resolve().parent.parent / "benchmarks" / "day.py"


def test_a_day_runs_and_the_table_adds_up(capsys) -> None:
    spec = importlib.util.spec_from_file_location("day_benchmark", DAY)
    assert spec is not None and spec.loader is not None
    day = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = day  # dataclasses look their module up there
    spec.loader.exec_module(day)
    rows = day.main(["--days", "1", "--seed", "7"])
    sessions = len(day.trace(7))
    assert list(rows) == ["(a) static+culler 1h", "(b) pool", "(c) pool+wait",
                          "(d) dynamic+wait", "(d) 25% answer"]
    for values in rows.values():
        # Every session is served or given up on (reuse of a running server included).
        assert values["served"] + values["gave up"] == sessions
        assert 0 < values["util %"] <= 100
    out = capsys.readouterr().out
    assert "ratio to (a)" in out and "int/served" in out
    assert "goals against (a)" in out
    # The product warns before its idle stops; the culler of (a) never does.
    assert rows["(a) static+culler 1h"]["warned"] == 0 < rows["(c) pool+wait"]["warned"]
