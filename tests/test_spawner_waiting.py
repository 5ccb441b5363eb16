"""The spawner's side of waiting that needs no hub: the start timeout from the grant,
and who joins the line at all.

The rest (join, grant on release, places, cancel, max_wait, restart) runs on a real
hub in tests/test_hub_waiting.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Grant, Ledger, ReleaseCode
from mig_spawner.ledger.waitlist import Waits
from mig_spawner.spawner import LocalMIGSpawner, waiting
from mig_spawner.spawner.waiting import within_start_timeout
from tests.support.polling import until_async
from tests.support.spawners import make_spawner, mig_config


def _spawner(raised: int) -> SimpleNamespace:
    return SimpleNamespace(start_timeout=raised, log=logging.getLogger("test"),
                           _log_name="ana")


async def test_after_a_wait_the_start_timeout_counts_from_the_grant(caplog):
    spawner = _spawner(raised=3600)
    granted_at = time.monotonic() - 0.5
    tic = time.monotonic()
    with caplog.at_level(logging.WARNING, "test"), pytest.raises(TimeoutError):
        # A start that never ends: a timer ends it, and the one counted from the grant
        # (2 s, not 3600) says so; the outer bound only keeps a failure short.
        await asyncio.wait_for(
            within_start_timeout(spawner, asyncio.Event().wait(), 2, granted_at), 60)
    assert "ana did not start within 2s of its grant" in caplog.text
    assert time.monotonic() - tic >= 1.0  # not before the 2 s from the grant 0.5 s ago
    assert spawner.start_timeout == 2  # what JupyterHub's timeout message names


async def test_a_start_that_never_waited_keeps_the_hubs_own_timeout():
    spawner = _spawner(raised=60)
    started = asyncio.sleep(0, "url")  # a start that answers "url" at once
    assert await within_start_timeout(spawner, started, 60, None) == "url"


def _local(tmp_path, name: str, mode: str, sim: str) -> LocalMIGSpawner:
    config = mig_config(f"sqlite:///{tmp_path / 'ledger.sqlite'}", sim=sim,
                        sim_state=tmp_path / "sim.json", policies={"crowd": {
                            "allowed": ["1g.18gb", "3g.71gb"], "max_slices_per_user": 2,
                            "queue": True, "max_wait": "1h"}})
    config.LocalMIGSpawner.mig_mode = mode
    return make_spawner(config, name, ["crowd"])


async def in_line(spawner: LocalMIGSpawner) -> None:
    """Until ``spawner``'s spawn was told its place: it waits in line."""
    await until_async(lambda: any("in line" in e["message"]
                                  for e in spawner.progress_log.events),
                      30, f"{spawner.user.name} told its place in line")


async def _claim(spawner: LocalMIGSpawner, key: str):
    mine = spawner.user_policy(spawner.policies())
    return (await waiting.claim(spawner, mine.offer(key), mine)).lease


@pytest.mark.parametrize(("mode", "sim", "joins"), [
    ("pool", "h200x1:layout=3g.71gb,1g.18gb*2", False),
    # Dynamic mode carves every size from one room: a small claim takes the large
    # waiter's room, so it joins the line (and the order rule may pass the waiter over).
    ("dynamic", "h200x1", True),
])
async def test_a_claim_joins_the_line_only_when_someone_waits_for_what_it_takes(
        tmp_path, mode, sim, joins):
    """ana waits for a 3g.71gb: bo holds one (and, in dynamic mode, dan a 1g.18gb where
    the second would go). cy asks for a 1g.18gb, free: in pool mode no waiter can use
    it, so he starts at once and no wait is recorded for him (the report counted such
    starts as waits, of a second or so)."""
    SimulatedHost.from_spec(sim, tmp_path / "sim.json")
    await _claim(_local(tmp_path, "bo", mode, sim), "3g.71gb")
    if mode == "dynamic":
        await _claim(_local(tmp_path, "dan", mode, sim), "1g.18gb")
    waiter = asyncio.ensure_future(_claim(_local(tmp_path, "ana", mode, sim), "3g.71gb"))
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        await until_async(ledger.waits.waiting, 30, "ana in line")
        lease = await _claim(_local(tmp_path, "cy", mode, sim), "1g.18gb")
        assert lease.profile == "1g.18gb"
        since = lease.claimed_at.replace(year=2000)
        assert [e.user for e in ledger.waits.joined(since)] == (["ana", "cy"] if joins else ["ana"])
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_cancel_that_races_a_grant_ends_at_once_and_gives_the_slice_back(
        tmp_path, monkeypatch):
    """JupyterHub's DELETE of a pending spawn cancels it, waits one second and stops the
    server, answering 500 ("pending spawn") if the spawn has not ended by then. The
    cancel ended only after the wait's entry was cancelled in the ledger and a grant
    that came first was given back, which a loaded host took longer than that for.
    Here another process's grant commits just before the cancel's transaction, which
    is held until the cancelled spawn has ended."""
    sim = "h200x1:layout=3g.71gb,1g.18gb*2"
    SimulatedHost.from_spec(sim, tmp_path / "sim.json")
    holder = await _claim(_local(tmp_path, "bo", "pool", sim), "3g.71gb")
    ana = _local(tmp_path, "ana", "pool", sim)
    waiter = asyncio.ensure_future(_claim(ana, "3g.71gb"))
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    gate = threading.Event()
    real_cancel = Waits.cancel

    def cancel_after_a_grant(self, entry_id, reason, **kw):
        ledger.leases.release(holder.id, "stopped")  # the slice service stopped bo's server...
        [granted] = ledger.waits.grant(  # ...and a grant pass elsewhere served ana
            lambda entry, view: Grant(group="crowd", profile="3g.71gb", compute_slices=3,
                                      mode="pool", host=holder.host, gpu_uuid=holder.gpu_uuid,
                                      gpu_index=0, start=holder.start, size=holder.size,
                                      mig_uuid=holder.mig_uuid),
            quotas={}, capacity=8).granted
        assert granted.user == "ana"
        gate.wait(30)
        return real_cancel(self, entry_id, reason, **kw)

    with Ledger.open(url) as ledger:
        await in_line(ana)
        monkeypatch.setattr(Waits, "cancel", cancel_after_a_grant)
        waiter.cancel()
        done, _ = await asyncio.wait({waiter}, timeout=10)
        assert done, "the cancelled spawn waited for the ledger"
        # JupyterHub's stop polls the server: it waits for the give-back, and does not
        # take the granted lease for one the hub lost (released as server_exited).
        polled = asyncio.ensure_future(ana.poll())
        gate.set()
        await polled
        (lease,) = [x for x in ledger.leases.history(user="ana")]
        assert (lease.state, lease.release_code) == ("released", "cancelled")
        assert [e.state for e in ledger.waits.joined(lease.claimed_at.replace(year=2000))
                if e.user == "ana"] == ["granted"]


async def test_a_cancelled_wait_leaves_no_server_record_to_roll_back(tmp_path):
    """JupyterHub rolls back a session that a request handler leaves dirty when it
    finishes (BaseHandler.finish). The cancelled start dropped the server's record in
    the hub's session without committing it, so the next request to finish brought it
    back: a server "ready" that never started and held no lease, which the slice service
    read through the proxy (a 424, counted as its user's activity)."""
    from jupyterhub import orm
    from sqlalchemy.orm import object_session

    sim = "h200x1:layout=3g.71gb,1g.18gb*2"
    SimulatedHost.from_spec(sim, tmp_path / "sim.json")
    await _claim(_local(tmp_path, "bo", "pool", sim), "3g.71gb")
    hub_db = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    db = orm.new_session_factory(hub_db)()
    record = orm.Spawner(user=orm.User(name="ana"), name="", server=orm.Server())
    db.add(record)
    db.commit()
    ana = _local(tmp_path, "ana", "pool", sim)
    ana.orm_spawner = record
    ana.user_options = {"profile": "3g.71gb"}
    start = asyncio.ensure_future(ana.start())
    await in_line(ana)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert not object_session(record).dirty  # nothing a rollback could bring back
    db.rollback()
    assert ana.server is None and record.server is None
    fresh = orm.new_session_factory(hub_db)()
    assert fresh.query(orm.Server).count() == 0
    await waiting.wait_ended(ana)


def test_a_server_may_take_what_the_last_ones_took_and_more_to_answer():
    from mig_spawner.core.answer import FLOOR, HEADROOM, answer_timeout, start_bound

    # JupyterHub's 30 s is never all: a loaded host took 147 s for 15 starts at once.
    assert answer_timeout(30, []) == FLOOR == 300
    assert answer_timeout(600, [5.0]) == 600  # an admin's longer http_timeout stands
    assert answer_timeout(30, [20.0, 150.0, 40.0]) == HEADROOM * 150 == 450
    # JupyterHub's start_timeout covers each try's start and answer, and a wait in line.
    assert start_bound(60, 300, 2) == 721
    assert start_bound(60, 300, 1, wait=1801) == 2162


async def test_jupyterhubs_timeouts_fit_the_answer_wait_and_a_wait_in_line(tmp_path):
    sim = "h200x1:layout=3g.71gb"
    ana = _local(tmp_path, "ana", "pool", sim)
    ana.start_timeout, ana.http_timeout = 60, 30
    ana.user_options = {"profile": "3g.71gb"}
    ana.runtime.answers.clear()
    ana.runtime.answers.extend([12.0, 140.0])
    ana.run_pre_spawn_hook()
    # 3 x 140 s to answer, twice (a second start on the same slice), plus max_wait (1 h).
    assert ana.http_timeout == 420
    assert ana.start_timeout == 2 * (60 + 420) + 3600 + 1 + 1
    # The configured values are what the next spawn starts from.
    ana.runtime.answers.clear()
    ana.user_options = {"profile": "7g.141gb"}  # not allowed: start() refuses it later
    ana.run_pre_spawn_hook()
    assert (ana.http_timeout, ana.start_timeout) == (300, 2 * (60 + 300) + 1)


async def test_a_released_slice_is_granted_while_the_event_loop_is_held(tmp_path):
    """Once ``stop()`` returns, JupyterHub's stop handler holds the event loop (its
    database commits, the proxy's route) for up to a few tenths of a second on a busy
    hub: the next waiter's grant is committed on the thread that released the slice,
    not after the loop is free again. Here the loop is held, as that handler holds it,
    until the ledger shows ana's grant."""
    sim = "h200x1:layout=3g.71gb,1g.18gb*2"
    SimulatedHost.from_spec(sim, tmp_path / "sim.json")
    bo = _local(tmp_path, "bo", "pool", sim)
    held = await _claim(bo, "3g.71gb")
    ana = _local(tmp_path, "ana", "pool", sim)
    waiter = asyncio.ensure_future(_claim(ana, "3g.71gb"))
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        await in_line(ana)
        bo.lease_id = held.id
        await bo._release(ReleaseCode.STOPPED)
        # The loop is held from here (no await) until the grant shows, or 30 s pass.
        deadline = time.monotonic() + 30
        while (granted := ledger.leases.active_for_server("ana", "")) is None and (
                time.monotonic() < deadline):
            time.sleep(0.01)  # holds the event loop on purpose: the grant must not need it
        assert granted is not None, "the grant waited for the event loop"
        assert (await asyncio.wait_for(waiter, 30)).id == granted.id
