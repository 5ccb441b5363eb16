"""A layout change on a real hub: JupyterHub with the MIG spawner on a simulated H200,
a real single-user server holding a slice, and ``mig-spawner-service`` in its own
process carrying the change on. What the user and the admin see: the user is warned
once, cannot Keep past the change, the free part is re-cut at once, and the last step
comes once the server has ended. docs/layout.md.

Limits shortened together: the service sweeps every second (default 60 s) and the
drain notice is 12 s (default 1 h), a little above their ratio so that a loaded test
machine still starts the server and sweeps a few times within it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mig_spawner.cli.main import main
from mig_spawner.core.layout import PlanState
from mig_spawner.core.lifecycle import StopRule, WarningEvent
from mig_spawner.gpu import connect
from mig_spawner.ledger import Ledger, ReleaseCode
from tests.support.hub_harness import HubProcess
from tests.support.polling import until
from tests.support.slice_service import Service, service_config_dir

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7"
#: A 4g.71gb over slices 0-3, where ana's server (the first 1g.18gb granted) runs.
TARGET = "4g.71gb,1g.18gb*3"
NOTICE = 12


def layout(workdir: Path) -> list[tuple[str, int]]:
    with connect(state_file=str(workdir / "sim-gpus.json")) as gpus:
        return sorted((gi.profile, gi.start) for gi in gpus.gpu(0).gpu_instances)


def test_a_held_slice_is_drained_warned_once_and_re_cut_after_its_server_ends(tmp_path):
    config_d = service_config_dir(tmp_path, SIM, f"""
        c.MIGPolicyConfig.group_policies = {{"analysts": {{
            "allowed": ["1g.18gb", "4g.71gb"], "drain_notice": "{NOTICE}s"}}}}
    """)
    hub = HubProcess.start(tmp_path, sorted(config_d.glob("*.py")), timeout=120)
    service = None
    url = f"sqlite:///{tmp_path}/mig_spawner_ledger.sqlite"
    try:
        hub.create_users(["ana", "bob"], groups=["analysts"])
        assert hub.spawn("ana", {"profile": "1g.18gb"}).status_code in (201, 202)
        hub.wait_ready("ana", timeout=120)
        with Ledger(url) as ledger:
            [held] = ledger.leases.active()
        assert held.start == 0

        cli = ["--sim-state", str(tmp_path / "sim-gpus.json"), "--ledger-url", url,
               "-f", str(config_d)]
        started = time.monotonic()
        assert main(["layout", "apply", *cli, TARGET]) == 0
        # The free part is re-cut at once; ana's instance and the 4g's room wait.
        assert layout(tmp_path) == [("1g.18gb", s) for s in (0, 4, 5, 6)]
        # bob is served from what stays, never from the room being re-cut.
        assert hub.spawn("bob", {"profile": "1g.18gb"}).status_code in (201, 202)
        hub.wait_ready("bob", timeout=120)
        with Ledger(url) as ledger:
            assert ledger.leases.active_for_server("bob").start == 4

        service = Service(hub, config_d)
        with Ledger(url) as ledger:
            def warned() -> bool:
                lease = ledger.leases.get(held.id)
                return lease.warning == "drain"
            until(warned, 30, "ana warned of the drain", show=service.log)
            ana = hub.login("ana")
            notices = ana.get(f"{hub.url}/hub/api/mig-spawner/warnings", timeout=10).json()
            [shown] = notices["warnings"]
            assert shown["reason"] == "drain" and "re-cutting" in shown["message"]
            kept = ana.post(f"{hub.url}/hub/api/mig-spawner/keep",
                            headers={"X-XSRFToken": hub.xsrf(ana)}, timeout=10).json()
            assert kept["outcome"] == "refused"

            def done() -> bool:
                return not ledger.holds.changes()
            until(done, NOTICE + 30, "the change done", show=service.log)
            took = time.monotonic() - started
            [change] = ledger.holds.changes(open_only=False)
            assert change.state is PlanState.DONE, change.detail
            assert layout(tmp_path) == [("1g.18gb", 4), ("1g.18gb", 5), ("1g.18gb", 6),
                                        ("4g.71gb", 0)]
            ended = ledger.leases.get(held.id)
            assert ended.release_code is ReleaseCode.DRAIN
            # Warned once (by the apply), over many sweeps; the stop came no earlier
            # than the notice.
            assert [e.kind for e in ledger.warnings.events(held.id)] == ["warned", "refused"]
            assert took >= NOTICE
            assert ledger.leases.active_for_server("bob") is not None  # bob was never touched
        until(lambda: hub.server_model("ana") is None, 30, "ana's server gone",
              show=hub.log_path)
        assert service.counted("mig_spawner_service_slices_reclaimed_total", 1,
                               reason="drain") == 1
    finally:
        if service is not None:
            service.close()
        hub.close()


#: The demo's limits, shortened together (a sweep every 15 s, servers idle 10 min, warned
#: 3 min ahead, a drain notice of 1 h: 1 : 40 : 12 : 240): a sweep every second, 20 s,
#: 6 s, 120 s. The bug report's numbers: both servers idle past the limit, never warned.
IDLE, WARN, LONG_NOTICE = 20, 6, 120


def test_idle_holders_of_a_gpu_being_re_cut_are_warned_and_stopped_at_the_idle_limit(
        tmp_path):
    """ana and bob hold two slices of GPU 0 and leave them idle; an admin re-cuts the GPU
    (``layout apply``), which waits for their drain notice. Both are warned of the idle
    stop (beside the drain's warning) and stopped at the idle limit, as any idle server
    is, long before the drain notice ends; the re-cut then goes on at once."""
    config_d = service_config_dir(tmp_path, SIM, f"""
        c.MIGPolicyConfig.group_policies = {{"analysts": {{
            "allowed": ["1g.18gb", "4g.71gb"], "drain_notice": "{LONG_NOTICE}s",
            "server_idle_timeout": "{IDLE}s", "warn_before": "{WARN}s"}}}}
    """)
    hub = HubProcess.start(tmp_path, sorted(config_d.glob("*.py")), timeout=120)
    service = None
    url = f"sqlite:///{tmp_path}/mig_spawner_ledger.sqlite"
    try:
        hub.create_users(["ana", "bob"], groups=["analysts"])
        for user in ("ana", "bob"):
            assert hub.spawn(user, {"profile": "1g.18gb"}).status_code in (201, 202)
            hub.wait_ready(user, timeout=120)
        with Ledger(url) as ledger:
            held = {x.user: x for x in ledger.leases.active()}
        assert sorted(x.start for x in held.values()) == [0, 1]  # both in the 4g's room

        cli = ["--sim-state", str(tmp_path / "sim-gpus.json"), "--ledger-url", url,
               "-f", str(config_d)]
        assert main(["layout", "apply", *cli, TARGET]) == 0
        with Ledger(url) as ledger:
            drains = {u: ledger.leases.get(x.id).pending_stop(StopRule.DRAIN)
                      for u, x in held.items()}
        assert all(drains.values()), drains  # the apply warned both of the drain

        service = Service(hub, config_d)
        for user in ("ana", "bob"):
            until(lambda u=user: hub.server_model(u) is None, LONG_NOTICE + 60,
                  f"{user}'s server stopped", show=service.log)
        with Ledger(url) as ledger:
            for user, lease in held.items():
                ended = ledger.leases.get(lease.id)
                # Stopped for idleness, before the drain notice ended, after a warning.
                assert ended.release_code is ReleaseCode.STOPPED, (user, ended.release_code)
                assert ended.released_at < drains[user].deadline
                warned = [(e.kind, e.rule) for e in ledger.warnings.events(lease.id)]
                assert warned == [(WarningEvent.WARNED, StopRule.DRAIN),
                                  (WarningEvent.WARNED, StopRule.SERVER_IDLE)], (user, warned)
            until(lambda: not ledger.holds.changes(), 60, "the re-cut done", show=service.log)
        assert layout(tmp_path) == [("1g.18gb", 4), ("1g.18gb", 5), ("1g.18gb", 6),
                                    ("4g.71gb", 0)]
        assert service.counted("mig_spawner_service_culls_total", 2,
                               reason="server_idle") == 2
    finally:
        if service is not None:
            service.close()
        hub.close()
