"""What comes next, as the admin reads it on the command line: ``layout apply`` names
each holder it warned and when each stops; ``status`` shows, per held server, the next
stop and why (the limit in force: waited or unwaited, a session's end, a budget, a
drain) with its pending warnings, and the wait list in the order it is served.

A simulated H200 and a real SQLite ledger; the hub's policies from a config directory.
"""

from __future__ import annotations

import json
import textwrap

from mig_spawner.cli.main import main
from mig_spawner.gpu import connect
from mig_spawner.ledger import Grant, LeaseRequest, Ledger, WaitRequest
from tests.support.cli import run_cli

SIM = "h200x1:layout=1g.18gb*7"


def test_apply_names_whom_it_warned_and_status_what_comes_next(tmp_path, capsys):
    state = tmp_path / "sim.json"
    with connect(simulate=SIM, state_file=str(state)) as gpus:
        inventory = gpus.inventory()
    first = min(inventory.mig_devices, key=lambda d: d.start)
    config_d = tmp_path / "config.d"
    config_d.mkdir()
    (config_d / "20-groups.py").write_text(textwrap.dedent("""
        c = get_config()  # noqa: F821
        c.MIGPolicyConfig.group_policies = {"analysts": {
            "allowed": ["1g.18gb", "4g.71gb"], "server_idle_timeout": "30m",
            "server_idle_timeout_when_waited": "25m", "drain_notice": "1h"}}
    """))
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger.open(url) as ledger:
        lease = ledger.leases.claim(LeaseRequest("ana"), lambda view: Grant(
            group="analysts", profile="1g.18gb", compute_slices=1, mode="pool",
            host=inventory.host, gpu_uuid=first.gpu_uuid, gpu_index=0, start=first.start,
            size=first.size, mig_uuid=first.uuid))
        ledger.leases.activate(lease.id)
        ledger.waits.join(WaitRequest("bob", "", "analysts", 0, "1g.18gb", 600))
    common = ["--sim-state", str(state), "--ledger-url", url, "-f", str(config_d)]

    assert main(["layout", "apply", *common, "4g.71gb,1g.18gb*3"]) == 0
    applied = capsys.readouterr().out
    assert "warned ana/ (group analysts): stops at " in applied, applied
    assert "at the latest" in applied

    shown = run_cli("status", *common)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    # bob waits for ana's size: the shorter limit is in force, and ana is warned of the
    # re-cut, which Keep cannot put off.
    assert ("ana/ (1g.18gb, GPU 0): server_idle in 25m (idle 25m: someone waits for its "
            "size); warned: drain in 1h (no Keep)") in out, out
    assert "Waiting, in the order they are served:\n  1. bob/ for 1g.18gb (group analysts)" \
        in out, out
    data = json.loads(run_cli("status", "--json", *common).stdout)
    [ana] = data["holders"]
    assert (ana["next_stop"], ana["idle_limit_seconds"], ana["idle_limit_waited"]) == (
        "server_idle", 1500, True)
    assert [(w["rule"], w["keep"]) for w in ana["warnings"]] == [("drain", False)]
    assert [w["user"] for w in data["waiting"]] == ["bob"]
