"""A GPU lost on a real hub: JupyterHub with the MIG spawner on two simulated H200s, real
single-user servers, and ``mig-spawner-service`` in its own process. GPU 1 falls off the
bus (Xid 79) while bob and cy hold slices there and ana one on GPU 0. What users and the
admin see: the form stops offering GPU 1 within one sweep and says why, bob and cy are
warned with the reason and stopped after their group's ``fault_grace``, ana is left
alone, new spawns go to GPU 0, nothing is granted on GPU 1 until ``mig-spawner health
clear`` (across a restart of the hub and of the service, and after GPU 1 is back), and
no MIG device is ever in two live servers. docs/health.md.

Limits shortened together: the service sweeps every second (default 60 s) and
``fault_grace`` is 10 s (default 10 min), ``orphan_grace`` 5 s (default 5 min): their
ratios to the sweep kept.
"""

from __future__ import annotations

import re

import pytest

from mig_spawner.cli.main import main
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Ledger, ReleaseCode
from tests.support.hub_harness import HubProcess
from tests.support.live_servers import assert_one_server_per_slice
from tests.support.polling import until
from tests.support.slice_service import Service, service_config_dir

pytestmark = pytest.mark.hub

#: GPU 0 has only 2g.35gb slices, GPU 1 only 1g.18gb ones: where a spawn lands is its size.
SIM = "h200x1:layout=2g.35gb*3+h200x1:layout=1g.18gb*7"
GRACE = 10
TAG = "gpu-faults"
# The size's line on the form; while its holders on GPU 1 still run, it says first that
# they are in use ("Unavailable: all 2 in use; GPU 1 reported a hardware fault").
UNAVAILABLE = re.compile(r"Unavailable: [^<]*GPU 1 reported a hardware fault")


def form_of(hub: HubProcess, user: str) -> str:
    page = hub.login(user).get(f"{hub.url}/hub/spawn", timeout=30)
    page.raise_for_status()
    return page.text


def test_a_lost_gpu_is_withheld_its_holders_warned_and_stopped_others_serve_on(tmp_path):
    config_d = service_config_dir(tmp_path, SIM, f"""
        c.Spawner.environment = {{"MIG_TEST_HUB": "{TAG}"}}
        c.MIGPolicyConfig.group_policies = {{"analysts": {{
            "allowed": ["1g.18gb", "2g.35gb"], "fault_grace": "{GRACE}s"}}}}
        c.SliceServiceApp.orphan_grace = 5
    """)
    hub = HubProcess.start(tmp_path, sorted(config_d.glob("*.py")), timeout=120)
    service = None
    url = f"sqlite:///{tmp_path}/mig_spawner_ledger.sqlite"
    state = tmp_path / "sim-gpus.json"
    cli = ["--sim-state", str(state), "--ledger-url", url, "-f", str(config_d)]
    try:
        hub.create_users(["ana", "bob", "cy", "dan", "eve"], groups=["analysts"])
        for user, size in (("ana", "2g.35gb"), ("bob", "1g.18gb"), ("cy", "1g.18gb")):
            assert hub.spawn(user, {"profile": size}).status_code in (201, 202)
        for user in ("ana", "bob", "cy"):
            hub.wait_ready(user, timeout=120)
        service = Service(hub, config_d)
        service.wait_up()
        service.swept()
        assert not UNAVAILABLE.search(form_of(hub, "dan"))
        with Ledger(url) as ledger:
            lease = {u: ledger.leases.active_for_server(u) for u in ("ana", "bob", "cy")}
            assert {u: x.gpu_index for u, x in lease.items()} == {"ana": 0, "bob": 1, "cy": 1}

            SimulatedHost.open(state).lose_gpu(1)
            service.swept()  # one whole sweep after the loss
            form = form_of(hub, "dan")
            assert UNAVAILABLE.search(form), form
            for user in ("bob", "cy"):
                warned = ledger.leases.get(lease[user].id)
                assert warned.warning == "gpu_fault"
            [notice] = hub.login("bob").get(f"{hub.url}/hub/api/mig-spawner/warnings",
                                             timeout=10).json()["warnings"]
            assert "hardware fault" in notice["message"] and not notice["keep"]
            [event] = ledger.warnings.events(lease["bob"].id)
            assert "GPU 1" in event.detail and "fallen off the bus" in event.detail
            assert service.counted("mig_spawner_gpu_faults_total", 1, gpu="1", kind="lost")
            assert service.metric("mig_spawner_withheld_slices") == 8

            # New spawns go to GPU 0.
            assert hub.spawn("dan", {"profile": "2g.35gb"}).status_code in (201, 202)
            hub.wait_ready("dan", timeout=120)
            assert ledger.leases.active_for_server("dan").gpu_index == 0
            assert_one_server_per_slice(TAG)

            # After fault_grace, bob's and cy's servers are stopped (code gpu_fault);
            # their leases stay held while GPU 1 cannot say what runs on it.
            for user in ("bob", "cy"):
                until(lambda user=user: hub.server_model(user) is None, GRACE + 60,
                      f"{user}'s server stopped", show=service.log)
                ended = ledger.leases.get(lease[user].id)
                assert ended.release_code is ReleaseCode.GPU_FAULT
                assert ended.state == "releasing", ended
            assert ledger.leases.get(lease["ana"].id).warning is None  # ana untouched
            assert hub.server_model("ana") is not None
            held = [(f.gpu_index, f.kind) for f in ledger.holds.faults()]
            assert sorted(held) == [(1, "lost"), (1, "xid")]

        # A restart of the hub and of the service remembers the fault.
        hub.restart_hub()
        service.close()
        service = Service(hub, config_d)
        service.wait_up()
        with Ledger(url) as ledger:
            service.swept()
            # The new service, which never read GPU 1, adds no fault of its own.
            assert [(f.gpu_index, f.kind) for f in ledger.holds.faults()] == held
            assert UNAVAILABLE.search(form_of(hub, "eve"))
            assert main(["health", "clear", "1", *cli]) == 1  # still lost: kept
            # GPU 1 comes back after a reset, its layout made again: still withheld.
            SimulatedHost.open(state).reset_gpu(1)
            with connect(state_file=str(state)) as gpus:
                for start in range(7):
                    gpus.create_instance(1, "1g.18gb", start)
            until(lambda: all(ledger.leases.get(lease[u].id).state == "released"
                              for u in ("bob", "cy")), 60, "bob's and cy's slices back",
                  show=hub.log_path)
            service.swept()
            assert UNAVAILABLE.search(form_of(hub, "eve"))
            assert [x.gpu_index for x in ledger.leases.active()] == [0, 0]

            assert main(["health", *cli]) == 1  # a fault holds
            assert main(["health", "clear", "1", *cli]) == 0
            assert ledger.holds.faults() == []
            assert not UNAVAILABLE.search(form_of(hub, "eve"))
            assert hub.spawn("eve", {"profile": "1g.18gb"}).status_code in (201, 202)
            hub.wait_ready("eve", timeout=120)
            assert ledger.leases.active_for_server("eve").gpu_index == 1
        assert_one_server_per_slice(TAG)
    finally:
        if service is not None:
            service.close()
        hub.close()
