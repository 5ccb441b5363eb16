"""Smoke test of benchmarks/day_budgets.py on one day: budgets cap the group that has
one, and the hours still add up."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_a_budgeted_group_holds_fewer_hours_and_the_split_adds_up(capsys, monkeypatch) -> None:
    # The benchmark imports day.py beside it, as `python benchmarks/day_budgets.py` does.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("day_budgets")
    tables = bench.main(["--days", "1", "--seed", "3", "--budget", "20h"])
    without, with_ = tables["without budgets"], tables["with budgets"]
    # Stops come at the next one-minute sweep: a few slice-minutes past the budget.
    assert with_["research"]["held sl-h"] <= 20.5 < without["research"]["held sl-h"]
    for table in tables.values():
        shares = sum(v["share %"] for g, v in table.items() if g != "(all)")
        assert abs(shares - 100) < 1e-6
    assert "servers stopped for a spent budget" in capsys.readouterr().out
