"""The wait list in JupyterHub's own spawn page, on a real hub (proxy, jupyter_server).

One hub, 3 small slices, several checks in a row (the hub is slow to start):
a wait that reaches ``max_wait`` ends with a clear message; 3 users start and 5 wait,
each reading its place (1st..5th) in its progress; stopping a server starts the first
waiter's within 2 s of the release (the release time in the ledger against the
waiter's lease ``claimed_at``); a cancel renumbers the rest; ``kill -9`` of the hub
with waiters, restart: no leak, no double grant, the waits left behind are ended
``abandoned``, a waiter who comes back is told so, and one who starts again is back
in line. JupyterHub's ``start_timeout`` is shorter than the waits: it must not end them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import requests

from mig_spawner.ledger import Ledger
from tests.support.browser import launch_chromium, screenshot_path
from tests.support.hub_harness import STARTED, HubProcess, start_mig_hub
from tests.support.polling import until
from tests.support.system_deps import require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]
playwright = pytest.importorskip("playwright.sync_api")

SIM = "h200x1:layout=1g.18gb*3"
#: The shipped "small" as the form's heading, and every sentence, names it.
SMALL = "\u201cSmall: 1 of 7 compute slices\u201d"
CROWD = [f"u{i}" for i in range(1, 9)]
VIEWER = "u9"  # in the crowd too, with no server: sees the form's wait-list choice
EXTRA = """
c.Spawner.poll_interval = 1
c.Spawner.start_timeout = 15  # shorter than the waits below: it must not end them
c.Spawner.http_timeout = 60
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 1}  # POST answers 202 at once
c.MIGPolicyConfig.group_policies["crowd"] = {
    "allowed": ["small"], "queue": True, "max_wait": "10m"}
c.MIGPolicyConfig.group_policies["hurry"] = {
    "allowed": ["small"], "queue": True, "max_wait": "3s"}
c.MIGPolicyConfig.group_policies["clock"] = {
    "allowed": ["small"], "queue": True, "max_wait": "16s"}
"""
#: The issue's bound from a release to the first waiter's grant.
GRANT_WITHIN = 2.0


class Follower(threading.Thread):
    """Reads one pending spawn's progress stream into ``events`` until it ends."""

    def __init__(self, hub: HubProcess, name: str) -> None:
        super().__init__(daemon=True)
        self.hub, self.name, self.events = hub, name, []

    def run(self) -> None:
        path = f"/users/{self.name}/server/progress"
        try:
            with self.hub.request("GET", path, stream=True, timeout=120) as r:
                for line in r.iter_lines(decode_unicode=True):
                    if line and line.startswith("data:"):
                        self.events.append(json.loads(line[5:]))
        except requests.RequestException:
            pass  # the hub went away (the kill) or the spawn ended

    def last(self) -> str:
        return self.events[-1].get("message", "") if self.events else ""


def wait_pending(hub: HubProcess, name: str) -> Follower:
    hub.spawn(name, {"profile": "small"}, expect=(202,))
    follower = Follower(hub, name)
    follower.start()
    return follower


def places(hub: HubProcess, followers: dict[str, Follower], expected: dict[str, int]) -> None:
    def right() -> bool:
        return all(followers[n].last().startswith(_nth(p) + " in line") for n, p in
                   expected.items())

    until(right, 10, f"places {expected}",
          show=(lambda: {n: followers[n].last() for n in expected}, hub.log_path))


def _nth(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def no_double_grant(ledger: Ledger) -> None:
    held = ledger.leases.active()
    devices = [lease.mig_uuid for lease in held]
    assert len(devices) == len(set(devices)) <= 3, held
    servers = [(lease.user, lease.server_name) for lease in held]
    assert len(servers) == len(set(servers)), held


def login(browser, hub: HubProcess, name: str):
    page = browser.new_page(viewport={"width": 900, "height": 700})
    page.goto(f"{hub.url}/hub/login")
    page.get_by_label("Username").fill(name)
    page.get_by_label("Password").fill("any password")
    page.get_by_role("button", name="Sign in").click()
    return page


def test_wait_list_in_the_spawn_page(tmp_path: Path) -> None:
    require_chromium()
    url = f"sqlite:///{tmp_path}/ledger.sqlite"
    hub = start_mig_hub(tmp_path, SIM, EXTRA + f"\nc.MIGSettings.ledger_url = {url!r}\n")
    ledger = Ledger.open(url)
    try:
        hub.create_users([*CROWD, VIEWER], groups=["crowd"])
        hub.create_users(["h1"], groups=["hurry"])
        hub.create_users(["c1"], groups=["clock"])
        for name in CROWD[:3]:
            hub.spawn(name, {"profile": "small"}, expect=STARTED)
        for name in CROWD[:3]:
            hub.wait_ready(name)

        # max_wait: the spawn fails by itself, saying why and what to do.
        hurry = wait_pending(hub, "h1")
        until(lambda: hub.server_model("h1") is None, 15, "h1's server stopped",
              show=hub.log_path)
        hurry.join(5)
        failed = [e for e in hurry.events if e.get("failed")]
        assert failed and "Waited" in failed[-1]["message"], hurry.events
        assert "try again later" in failed[-1]["message"]

        # 5 wait and read their places.
        followers = {name: wait_pending(hub, name) for name in CROWD[3:]}
        places(hub, followers, {n: i for i, n in enumerate(CROWD[3:], 1)})

        with launch_chromium() as browser:
            # The form: the exhausted choice joins the wait list, with count and estimate.
            form = login(browser, hub, VIEWER)
            form.goto(f"{hub.url}/hub/spawn")
            text = form.locator("#spawn_form").inner_text()
            assert "All 3 in use \u2014 join the wait list (5 waiting, " in text, text
            assert form.get_by_role("radio", name=re.compile("Small")).is_enabled()
            form.locator("#spawn_form").screenshot(path=str(screenshot_path("spawn-form-wait.png")))
            # The pending page of the last in line: its place, then the line moving.
            pending = login(browser, hub, "u8")
            pending.goto(f"{hub.url}/hub/spawn-pending/u8")
            pending.locator(f"text=/5th in line for {SMALL}/").first.wait_for(
                timeout=15_000)
            pending.screenshot(path=str(screenshot_path("spawn-pending-wait.png")))

            # A release starts the first waiter's server within 2 s.
            hub.stop_server("u1")
            pending.locator(f"text=/4th in line for {SMALL}/").first.wait_for(
                timeout=15_000)
        hub.wait_ready("u4")
        released = next(lease for lease in ledger.leases.history(user="u1") if lease.released_at)
        granted = ledger.leases.active_for_server("u4")
        gap = (granted.claimed_at - released.released_at).total_seconds()
        print(f"release to grant: {gap:.3f} s")
        assert 0 <= gap <= GRANT_WITHIN
        places(hub, followers, {"u5": 1, "u6": 2, "u7": 3, "u8": 4})

        # A cancel (JupyterHub's stop of the pending spawn) renumbers the rest.
        hub.stop_server("u6")
        places(hub, followers, {"u5": 1, "u7": 2, "u8": 3})
        assert [e.user for e in ledger.waits.waiting()] == ["u5", "u7", "u8"]
        # ...and ends as a cancelled spawn: never "ready" (whose redirect would loop on a
        # server that is not there), in its progress or in the hub's log.
        followers["u6"].join(10)
        assert followers["u6"].events[-1].get("failed"), followers["u6"].events
        assert followers["u6"].last() == "Spawn cancelled"
        assert "Server u6 is ready" not in (hub.workdir / "hub.log").read_text(errors="replace")
        no_double_grant(ledger)
        # JupyterHub's start_timeout (15 s) does not end a wait (max_wait does). The
        # event that shows its time is past for u8: c1's wait, joined now with a 16 s
        # max_wait, ends expired by the grant loop's timer, in the hub's event loop
        # where JupyterHub's timer for u8's spawn (begun earlier, 15 s) would have fired
        # first; its cancel of u8 would have ended u8's wait "cancelled".
        wait_pending(hub, "c1")
        until(lambda: wait_of(ledger, "c1") == "expired", 60, "c1's wait expired",
              show=(lambda: ledger_waits(ledger), hub.log_path))
        assert wait_of(ledger, "u8") == "waiting", ledger_waits(ledger)
        assert hub.server_model("u8")["pending"] == "spawn"
        assert followers["u8"].last().startswith("3rd in line")

        # kill -9 with waiters; the restarted hub leaks nothing and grants nothing twice.
        os.killpg(hub.proc.pid, signal.SIGKILL)
        hub.proc.wait(10)
        hub._launch(120)
        hub.spawn("u5", {"profile": "small"}, expect=(202,))
        back = Follower(hub, "u5")
        back.start()
        until(lambda: back.last().startswith("1st in line"), 15, "u5 1st in line again",
              show=(back.last, hub.log_path))
        ended = {e.user: e for e in ledger_waits(ledger) if e.user in ("u7", "u8")}
        assert {e.state for e in ended.values()} == {"abandoned"}, ended
        assert all("restarted" in (e.reason or "") for e in ended.values())
        assert [e.user for e in ledger.waits.waiting()] == ["u5"]
        # ...and a waiter who comes back is told what happened.
        form = hub.login("u7").get(f"{hub.url}/hub/spawn/u7").content.decode()  # UTF-8
        assert f"Your wait for {SMALL} ended when the hub restarted" in form
        no_double_grant(ledger)
        assert {lease.user for lease in ledger.leases.active()} == {"u2", "u3", "u4"}
        metrics = hub.session.get(f"{hub.url}/hub/metrics", timeout=10).text
        assert 'mig_spawner_abandoned_waits_total{group="crowd",profile="small"} 3.0' in metrics
        assert 'mig_spawner_waiters{group="crowd",profile="small"} 1.0' in metrics
        hub.stop_server("u5")
        assert ledger.waits.waiting() == []
    finally:
        hub.close()
        hub.stop_hub()
        ledger.close()


def wait_of(ledger: Ledger, user: str) -> str | None:
    """The state of ``user``'s latest wait entry (None: never waited)."""
    states = [e.state for e in ledger_waits(ledger) if e.user == user]
    return states[-1] if states else None


def ledger_waits(ledger: Ledger) -> list:
    """Every wait entry, ended or not (ids are dense from 1)."""
    out, entry_id = [], 1
    while (entry := ledger.waits.entry(entry_id)) is not None:
        out.append(entry)
        entry_id += 1
    return out
