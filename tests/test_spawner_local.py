"""LocalMIGSpawner's backend hooks in-process, without a hub: what the form shows when the
GPU cannot be read, and the request mix that steers dynamic placement.

The spawner runs on a simulated H200 whose state file the test changes, and on a real
ledger; JupyterHub's User is stood in by the few attributes a Spawner reads.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import replace
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from jupyterhub.spawner import SpawnException

from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.spawner import LocalMIGSpawner
from mig_spawner.spawner.runtime import DEMAND_WINDOW
from tests.mocking import mig_device
from tests.support.polling import until_async
from tests.support.spawners import local_spawner

SIM = "h200x1"


@pytest.fixture
def sim(tmp_path):
    return SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")


class _Radios(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.radios: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "input" and a.get("type") == "radio":
            self.radios.append(a)


def radios(html: str) -> list[dict]:
    parser = _Radios()
    parser.feed(html)
    return parser.radios


@pytest.mark.parametrize(("spec", "mode"), [
    ("h200x1:perm=config", "dynamic"),  # may make instances, is not root
    ("h200x1:perm=none:layout=1g.18gb*7", "pool"),  # may only read
])
async def test_a_hub_without_root_offers_and_grants_slices(tmp_path, ledger_url, spec, mode):
    """NVML refuses such a hub the parent GPU's memory and process list: the form, the
    choice of a slice and (dynamic) making it work from what stays readable."""
    SimulatedHost.from_spec(spec, tmp_path / "sim-gpus.json")
    s = local_spawner(tmp_path, ledger_url, mode=mode, sim=spec)
    small = next(r for r in radios(await s.render_options_form()) if r["value"] == "small")
    assert "disabled" not in small
    mine = s.user_policy(s.policies())
    plan = await s.claim_decide(mine.offer("small"), mine)
    with Ledger.open(ledger_url) as ledger:
        lease = ledger.leases.claim(LeaseRequest("ana"), plan.decide)
    assert plan.granted(lease) == "GPU 0 (NVIDIA H200)"
    lease = await s.after_claim(lease)
    with connect(simulate=spec, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        assert mig_device(gpus.inventory(), lease.mig_uuid).profile == "1g.18gb"


async def test_form_says_why_when_the_gpu_cannot_be_read(tmp_path, ledger_url, sim, caplog):
    s = local_spawner(tmp_path, ledger_url, mode="dynamic")
    sim.inject_error("nvmlDeviceGetCount_v2", "GPU_IS_LOST")
    with caplog.at_level(logging.ERROR):
        html = await s.render_options_form()
    # What failed, in plain words; the driver's own words are for the admin's log.
    assert (
        "The GPU inventory cannot be read right now. Try again in a minute; if it persists, "
        "tell a hub admin." in html
    )
    assert "GPU is lost" not in html
    assert [r["value"] for r in radios(html)] == ["small", "medium"]
    assert all("disabled" in r and "checked" not in r for r in radios(html))
    assert "GPU is lost" in caplog.text and "dmesg" in caplog.text  # the hint, for admins
    # The next read works again: so does the form.
    html = await s.render_options_form()
    assert "cannot be read" not in html and "free now" in html


async def test_form_says_why_when_the_ledger_cannot_be_read(tmp_path, sim):
    (tmp_path / "not-a-db.sqlite").write_text("this is not a database")
    s = local_spawner(tmp_path, f"sqlite:///{tmp_path / 'not-a-db.sqlite'}")
    html = await s.render_options_form()
    assert "The lease ledger cannot be read right now. Try again in a minute" in html
    assert "not-a-db.sqlite" not in html  # the database's location is not the user's business
    assert all("disabled" in r for r in radios(html))


def big_slices_were_asked_for(ledger_url: str, how: str) -> None:
    """A week in which users mostly asked for 4g.71gb (granted, or refused)."""
    with Ledger.open(ledger_url) as ledger:
        for i in range(5):
            request = LeaseRequest(f"u{i}")
            if how == "refusals":
                ledger.refusals.record(request, offer="4g.71gb", profile="4g.71gb",
                                      reason="no_capacity")
                continue
            lease = ledger.leases.claim(request, lambda view: Grant(
                group="ml-team", profile="4g.71gb", compute_slices=4, mode="dynamic",
                host="elsewhere", gpu_uuid="GPU-x", gpu_index=0, start=0, size=4))
            ledger.leases.release(lease.id, "stopped")


@pytest.mark.parametrize("history", ["none", "leases", "refusals"])
async def test_recent_demand_steers_where_a_dynamic_instance_goes(
    tmp_path, ledger_url, sim, history
):
    """On an empty H200 a 1g.18gb goes to slice 0; when 4g.71gb (which only fits at 0)
    is in demand, it goes to slice 4 and leaves 0-3 whole."""
    if history != "none":
        big_slices_were_asked_for(ledger_url, history)
    s = local_spawner(tmp_path, ledger_url, mode="dynamic")
    mine = s.user_policy(s.policies())
    plan = await s.claim_decide(mine.offer("small"), mine)
    with Ledger.open(ledger_url) as ledger:
        lease = ledger.leases.claim(LeaseRequest("ana"), plan.decide)
    assert (lease.profile, lease.start) == ("1g.18gb", 0 if history == "none" else 4)
    assert plan.granted(lease) == "GPU 0 (NVIDIA H200)"


async def test_demand_is_read_once_per_minute_not_per_claim(tmp_path, ledger_url, sim):
    s = local_spawner(tmp_path, ledger_url, mode="dynamic")
    first = await s.runtime.run(s.runtime.demand)
    big_slices_were_asked_for(ledger_url, "refusals")
    assert await s.runtime.run(s.runtime.demand) == first == {}
    with Ledger.open(ledger_url) as ledger:
        assert ledger.refusals.request_counts(datetime(2026, 1, 1, tzinfo=UTC)) == {"4g.71gb": 5}


async def test_one_users_300_refused_spawns_move_demand_by_at_most_one(
    tmp_path, ledger_url, sim
):
    """Refusals count once per user per profile per demand window (docs/allocator.md),
    so one user hammering the API cannot steer where everyone's slices go."""
    holder = local_spawner(tmp_path, ledger_url, user="mal", mode="dynamic")
    with Ledger.open(ledger_url) as ledger:  # analysts may hold one slice: mal has it
        ledger.leases.claim(LeaseRequest("mal", "other"), lambda view: Grant(
            group="analysts", profile="1g.18gb", compute_slices=1, mode="dynamic",
            host="elsewhere", gpu_uuid="GPU-x", gpu_index=0, start=0, size=1))
    since = datetime.now(UTC) - DEMAND_WINDOW
    refusals = holder.runtime.ledger().refusals
    before = await holder.runtime.run(lambda: refusals.request_counts(since))
    for i in range(300):
        s = local_spawner(tmp_path, ledger_url, user="mal", mode="dynamic")
        # Half forbidden (1g.35gb is not the analysts'), half over the user's limit.
        s.user_options = {"profile": "1g.35gb" if i % 2 else "small"}
        with pytest.raises(SpawnException):
            await s.start()
    # All kept: refusals are written off the request's path, so wait for the last ones.
    async def all_kept() -> bool:
        return len(await holder.runtime.run(refusals.between)) >= 300

    await until_async(all_kept, 10, "300 refusals recorded", every=0.1)
    assert len(await holder.runtime.run(refusals.between)) == 300
    after = await holder.runtime.run(lambda: refusals.request_counts(since))
    for profile in ("1g.18gb", "1g.35gb"):
        assert after.get(profile, 0) - before.get(profile, 0) <= 1, (profile, before, after)


class ReleasedWhileStarting(LocalMIGSpawner):
    """The lease is released right after it was granted, before the instance is recorded
    (as when an admin or the slice service releases it at that moment)."""

    def plan_claim(self, fleet, offer, mine):
        plan = super().plan_claim(fleet, offer, mine)

        def granted(lease):
            with Ledger.open(self.ledger_url) as ledger:
                ledger.leases.release(lease.id, "stopped", "by an admin")
            return plan.granted(lease)

        return replace(plan, granted=granted)


async def test_an_instance_made_for_a_lease_that_ended_meanwhile_is_destroyed(
    tmp_path, ledger_url, sim
):
    s = local_spawner(tmp_path, ledger_url, mode="dynamic", cls=ReleasedWhileStarting)
    s.user_options = {"profile": "small"}
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.status_code == 409
    assert "given back while it was starting (its server was stopped)" in (
        info.value.jupyterhub_message)
    with connect(simulate=SIM, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        assert gpus.inventory().mig_devices == ()  # created, then destroyed: nothing leaks


async def test_a_stale_lease_whose_holder_cannot_be_checked_is_kept_and_said(
    tmp_path, ledger_url, sim
):
    """The last run of ana's server was recorded on another host: the hub cannot prove it
    is gone, so its slice stays held and ana hears why, in plain words."""
    s = local_spawner(tmp_path, ledger_url)
    s.user_options = {"profile": "small"}
    with Ledger.open(ledger_url) as ledger:
        def decide(view):
            return Grant(group="analysts", profile="1g.18gb", compute_slices=1,
                            mode="pool", host="another-host", gpu_uuid="GPU-x", gpu_index=0,
                            start=0, size=1, mig_uuid="MIG-elsewhere")

        old = ledger.leases.claim(LeaseRequest("ana"), decide)
        with pytest.raises(SpawnException) as info:
            await s.start()
        assert info.value.status_code == 409
        assert info.value.jupyterhub_message == (
            "The slice of this server's last run is not given back yet: a process of its "
            "last run that the hub cannot check or stop. Try again in a minute; if it "
            "persists, tell a hub admin."
        )
        kept = ledger.leases.get(old.id)
        assert kept.held and kept.state == "releasing"  # held, and the slice map says why



AUTOGROUP = Path("/proc/self/autogroup")


def _started_with(preexec) -> tuple[int, str | None]:
    """The nice value and scheduling group (None: no autogroup scheduling here) of a
    child started as JupyterHub starts a server: in a session of its own."""
    child = subprocess.run(
        ["/bin/sh", "-c", "nice; cat /proc/self/autogroup 2>/dev/null || true"],
        preexec_fn=preexec, start_new_session=True, capture_output=True, text=True,
        check=True, timeout=30)
    nice, *group = child.stdout.splitlines()
    return int(nice), (group or [None])[0]


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_nice_puts_each_server_and_its_session_behind_the_hub(tmp_path, ledger_url, user):
    """A server in a session of its own is a scheduling group of its own: without the
    group's value the hub got no more CPU than any one server of a class start."""
    s = local_spawner(tmp_path, ledger_url)
    hub = AUTOGROUP.read_text() if AUTOGROUP.exists() else None
    nice, group = _started_with(s.make_preexec_fn(user))
    assert nice == os.nice(0)
    assert group is None or group.endswith(" nice 0")
    s.nice = 10
    # Lowered before the child becomes the user: "nobody" could not write its /proc.
    nice, group = _started_with(s.make_preexec_fn(user))
    assert nice == max(10, os.nice(0))  # a higher one inherited (a run under nice) is kept
    assert group is None or group.endswith(" nice 10")
    # The hub's is untouched. In a container whose cpu cgroup is not an autogroup the file
    # is there and empty: the kernel shows no group.
    assert (AUTOGROUP.read_text() if AUTOGROUP.exists() else None) == hub


async def test_one_allocator_index_is_kept_across_claims_and_told_what_changed(
    tmp_path, ledger_url
):
    """The host's index lives as long as the runtime: each decision tells it what the
    ledger holds and each read of the GPUs what changed there. A slice someone uses
    outside mig-spawner and a slice given back are each seen by the next claim."""
    spec = "h200x2:layout=1g.18gb*7"
    sim = SimulatedHost.from_spec(spec, tmp_path / "sim-gpus.json")
    s = local_spawner(tmp_path, ledger_url, sim=spec)
    mine = s.user_policy(s.policies())
    index = await s.runtime.run(s.runtime.index_here)

    async def claim(user: str):
        plan = await s.claim_decide(mine.offer("small"), mine)
        assert (await s.read_fleet()).index is index  # kept, not built again
        with Ledger.open(ledger_url) as ledger:
            return ledger.leases.claim(LeaseRequest(user), plan.decide)

    first = await claim("ana")
    assert (first.gpu_index, first.start) == (0, 0)
    await s.render_options_form()  # the form's count tells the index of ana's lease
    # Someone runs processes on two slices of GPU 1: only the GPU read says so. GPU 1 is
    # now the busier, and packing fills it first.
    outside = [d.uuid for d in sim_devices(tmp_path, spec, 1) if d.start < 2]
    for uuid in outside:
        sim.set_processes(uuid, [(4242, 100)])
    second = await claim("bob")
    assert (second.gpu_index, second.start) == (1, 2)
    with Ledger.open(ledger_url) as ledger:
        ledger.leases.release(first.id, "stopped")
        ledger.leases.release(second.id, "stopped")
    await s.render_options_form()
    for uuid in outside:  # they are done: both GPUs are empty again
        sim.set_processes(uuid, [])
    third = await claim("cy")
    assert (third.gpu_index, third.start) == (0, 0)


def sim_devices(tmp_path, spec, gpu):
    with connect(simulate=spec, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        return gpus.inventory().gpus[gpu].mig_devices
