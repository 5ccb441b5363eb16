"""The MIG spawner in a real JupyterHub, with real single-user servers and kernels.

One hub for the whole module (pool mode, a simulated 2 x H200 with 10 small slices,
one 2g.35gb, one 1g.35gb and no 3g.71gb), configured from the repository's own
jupyterhub_config.d snippets. Every test stops the servers it started. The hub runs
unprivileged (perm=none: neither root nor the MIG config capability), as a pool-mode
hub may: NVML refuses it the parent GPUs' memory and process lists.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Ledger
from tests.mocking import mig_device
from tests.support.hub_harness import HubProcess, start_mig_hub
from tests.support.polling import until

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7:perm=none+h200x1:layout=1g.18gb*3,2g.35gb,1g.35gb"
#: The shipped "small" as the form's heading, and every sentence, names it.
SMALL = "\u201cSmall: 1 of 7 compute slices\u201d"


# What the tests add to the shipped snippets besides the simulated GPUs: fast polling.
HUB_EXTRA = """
        # A user's environment must not be able to point CUDA elsewhere.
        c.Spawner.environment = {"CUDA_VISIBLE_DEVICES": "all", "MIG_SPAWNER_PROFILE": "x"}
        c.Spawner.poll_interval = 1
        c.Spawner.start_timeout = 180
        c.Spawner.http_timeout = 180
        # A crowd of users with no quota, for the concurrency test. Its refusals must be
        # answered as refusals: on a loaded machine 30 claims at once can take longer than
        # JupyterHub's 10 s before it answers 202 and lets the spawn fail later.
        c.MIGPolicyConfig.group_policies["crowd"] = {"allowed": ["small"]}
        c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 60}
        # A user whose server cannot start: its slice must come back.
        def _break(spawner):
            if spawner.user.name == "broken":
                spawner.cmd = ["/nonexistent/jupyterhub-singleuser"]
        c.Spawner.pre_spawn_hook = _break
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mighub")
    hub = start_mig_hub(workdir, SIM, HUB_EXTRA)
    hub.create_user("ana", groups=["analysts"])
    hub.create_user("bob", groups=["analysts"])
    hub.create_user("mia", groups=["ml-team"])
    hub.create_user("nobody")
    hub.create_user("broken", groups=["analysts"])
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def ledger(hub):
    # The default ledger is a SQLite file beside the hub's database.
    path = hub.workdir / "mig_spawner_ledger.sqlite"
    with Ledger(f"sqlite:///{path}") as ledger:
        yield ledger


@pytest.fixture(scope="module")
def gpus(hub):
    adapter = connect(simulate=SIM, state_file=str(hub.workdir / "sim-gpus.json"))
    yield adapter
    adapter.close()


def _start(hub: HubProcess, user: str, profile: str) -> list[dict]:
    r, events = hub.spawn_and_follow(user, {"profile": profile})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready(user)
    return events


def _held(ledger: Ledger) -> dict[str, str]:
    return {lease.user: lease.profile for lease in ledger.leases.active()}


def test_each_group_gets_its_slice_and_the_kernel_sees_only_it(hub, ledger, gpus):
    events = _start(hub, "ana", "small")
    messages = [e["message"] for e in events]
    assert f"Reserving {SMALL}" in messages, messages
    assert any("Reserved 1g.18gb (16.0 GiB) on GPU" in m for m in messages), messages
    assert "Starting your server" in messages
    _start(hub, "mia", "1g.35gb")
    try:
        seen = {
            user: json.loads(hub.run_in_kernel(user, (
                "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
                "('CUDA_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES', 'MIG_SPAWNER_PROFILE')}))"
            )))
            for user in ("ana", "mia")
        }
        inventory = gpus.inventory()
        for user, profile in (("ana", "1g.18gb"), ("mia", "1g.35gb")):
            uuid = seen[user]["CUDA_VISIBLE_DEVICES"]
            device = mig_device(inventory, uuid)
            assert device is not None and device.profile == profile, seen
            assert seen[user]["NVIDIA_VISIBLE_DEVICES"] == uuid
            assert seen[user]["MIG_SPAWNER_PROFILE"] == profile
        assert seen["ana"]["CUDA_VISIBLE_DEVICES"] != seen["mia"]["CUDA_VISIBLE_DEVICES"]
        assert _held(ledger) == {"ana": "1g.18gb", "mia": "1g.35gb"}
    finally:
        hub.stop_server("ana")
        hub.stop_server("mia")
    assert _held(ledger) == {}
    released = [lease for lease in ledger.leases.history(user="ana")]
    assert released[-1].release_code == "stopped"


@pytest.mark.parametrize(
    ("user", "body", "status", "words"),
    [
        ("ana", {"profile": "large"}, 403, "'large' is not allowed for your groups (analysts)"),
        ("ana", {"profile": "small", "gpu": "1"}, 400, "unknown option(s) 'gpu'"),
        ("ana", {"profile": "s" * 10_000}, 400, "10000 characters long"),
        ("ana", {"profile": ["small"]}, 400, "must be one name"),
        ("ana", {"profile": "7g.999gb"}, 400, "not a MIG profile offered on this hub"),
        ("nobody", {"profile": "small"}, 403, "not allowed any GPU slice"),
    ],
)
def test_forged_options_through_the_rest_api_are_refused(hub, ledger, user, body, status, words):
    r = hub.spawn(user, body)
    assert r.status_code == status, r.text
    assert words in r.json()["message"]
    assert len(r.text) < 1000
    assert hub.server_model(user) is None
    assert _held(ledger) == {}


def test_query_and_form_paths_are_validated_too(hub, ledger):
    browser = hub.login("ana")
    # ?opt-profile=... on the spawn page: refused, and the form is shown with the reason.
    r = browser.get(f"{hub.url}/hub/spawn/ana", params={"opt-profile": "large"})
    assert r.status_code == 403
    # In a sentence for the person on the page, not advice on what a script sends.
    # The page is UTF-8 (its meta tag says so; requests would guess Latin-1).
    assert ("Error: Your groups (analysts) are not allowed \u201cLarge: 3 of 7 compute "
            "slices\u201d.") in r.content.decode()
    assert 'name="profile"' in r.text  # the form again, to pick an allowed size
    # A form post (as the browser sends it) with a value the form never offered.
    r = browser.post(
        f"{hub.url}/hub/spawn/ana", params={"_xsrf": hub.xsrf(browser)}, data={"profile": "full"}
    )
    assert r.status_code == 403
    assert (f"are not allowed \u201cWhole GPU (one MIG instance)\u201d. Choose one of: {SMALL}, "
            "\u201cMedium: 2 of 7 compute slices\u201d.") in r.content.decode()
    assert hub.server_model("ana") is None
    assert _held(ledger) == {}


def test_options_are_handled_and_a_body_without_them_is_refused_not_reused(hub, ledger):
    """JupyterHub 5.3+ warns "Received unhandled user_options" at a spawn unless the
    spawner handles them; and a REST body without options would reuse the last start's."""
    _start(hub, "ana", "small")  # the REST API: {"profile": "small"} is now her last choice
    hub.stop_server("ana")
    browser = hub.login("bob")
    r = browser.post(
        f"{hub.url}/hub/spawn/bob", params={"_xsrf": hub.xsrf(browser)}, data={"profile": "small"}
    )
    assert r.status_code == 200, r.status_code
    hub.wait_ready("bob")
    hub.stop_server("bob")
    for body in (None, {}, {"user_options": None}):
        r = hub.spawn("ana", body)
        assert r.status_code == 400, (body, r.text)
        # analysts name no default_offer: refused, in the admin page's words.
        message = r.json()["message"]
        assert message.startswith("no GPU slice size was chosen: \"Start Server\"")
        assert 'send {"profile": ...} with one of: small' in message
        assert hub.server_model("ana") is None
    assert _held(ledger) == {}
    hub.check_log()  # no "unhandled user_options" after either path


def test_the_next_spawn_when_all_are_taken_hears_why(hub, ledger):
    _start(hub, "ana", "medium")  # the only 2g.35gb
    try:
        r = hub.spawn("bob", {"profile": "medium"})
        assert r.status_code == 503, r.text
        message = r.json()["message"]
        assert "no 2g.35gb free" in message and "1 leased" in message
        assert "free now: 1g.18gb: 10" in message  # what bob could pick instead
        # The form shows the same: medium disabled, small with its free count.
        form = hub.login("bob").get(f"{hub.url}/hub/spawn/bob").text
        assert "the only one is in use right now" in form and "10 free now" in form
        # ...and one slice per user: ana cannot start a second server's worth.
        assert _held(ledger) == {"ana": "2g.35gb"}
    finally:
        hub.stop_server("ana")


def metric(hub: HubProcess, name: str, **labels: str) -> float:
    """One sample of the hub's own /hub/metrics (0 when the series does not exist yet)."""
    r = hub.session.get(f"{hub.url}/hub/metrics")
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def test_refused_spawns_are_recorded_and_every_outcome_is_counted(hub, ledger):
    refused = {
        "not_allowed": ("mig_spawner_spawn_refusals_total",
                        {"reason": "not_allowed", "group": "analysts"}),
        "none_free": ("mig_spawner_spawn_refusals_total",
                      {"reason": "none_free", "group": "ml-team"}),
    }
    granted = ("mig_spawner_leases_claimed_total",
               {"profile": "1g.18gb", "group": "analysts", "mode": "pool"})
    released = ("mig_spawner_leases_released_total", {"reason": "stopped"})
    claims = ("mig_spawner_claim_duration_seconds_count", {})
    trips = ("mig_spawner_worker_wait_seconds_count", {})
    watched = [*refused.values(), granted, released, claims, trips]
    before = [metric(hub, name, **labels) for name, labels in watched]
    since = datetime.now(UTC)

    assert hub.spawn("bob", {"profile": "large"}).status_code == 403  # not for analysts
    assert hub.spawn("mia", {"profile": "large"}).status_code == 503  # no 3g.71gb made
    _start(hub, "bob", "small")
    hub.stop_server("bob")

    until(lambda: len(ledger.refusals.between(since)) == 2, 10, "both refusals recorded",
          show=hub.log_path)
    assert [(r.user, r.offer, r.profile, r.reason, r.group)
            for r in ledger.refusals.between(since)] == [
        ("bob", "large", None, "not_allowed", "analysts"),
        ("mia", "large", "3g.71gb", "none_free", "ml-team"),
    ]
    assert "not allowed for your groups" in ledger.refusals.between(since)[0].message
    after = [metric(hub, name, **labels) for name, labels in watched]
    # Two refusals, one grant and one release; three claims were timed (two reached the
    # backend: the not-allowed one was refused before).
    # Every trip to a worker thread is timed: several per spawn.
    *counted, timed = [a - b for a, b in zip(after, before, strict=True)]
    assert counted == [1, 1, 1, 1, 2] and timed >= 6


def test_spawn_page_says_why_when_the_gpu_cannot_be_read(hub):
    sim = SimulatedHost.from_spec(SIM, hub.workdir / "sim-gpus.json")
    sim.inject_error("nvmlDeviceGetCount_v2", "GPU_IS_LOST")
    try:
        r = hub.login("ana").get(f"{hub.url}/hub/spawn/ana")
    finally:
        sim.clear_errors()
    assert r.status_code == 200, r.text  # the form, not an error page
    assert ("The GPU inventory cannot be read right now. Try again in a minute; if it "
            "persists, tell a hub admin.") in r.text
    assert "GPU is lost" not in r.text  # the driver's words are for the hub log


def test_a_start_that_fails_gives_the_slice_back(hub, ledger):
    hub.spawn("broken", {"profile": "small"})
    until(lambda: hub.server_model("broken") is None, 60, "the failed start over",
          show=hub.log_path)
    last = ledger.leases.history(user="broken")[-1]
    assert not last.held
    assert last.release_code == "start_failed"


def test_thirty_concurrent_spawns_for_ten_slices_give_ten_servers(hub, ledger):
    users = [f"crowd{i:02d}" for i in range(30)]
    hub.create_users(users, groups=["crowd"])
    with ThreadPoolExecutor(30) as pool:
        codes = list(pool.map(lambda u: hub.spawn(u, {"profile": "small"}).status_code, users))
    try:
        started = [u for u, code in zip(users, codes, strict=True) if code in (201, 202)]
        assert len(started) == 10, codes
        assert sorted(set(codes) - {201, 202}) == [503]
        for user in started:
            hub.wait_ready(user, timeout=240)
        leases = ledger.leases.active()
        assert len(leases) == 10
        assert len({lease.mig_uuid for lease in leases}) == 10  # never one slice twice
    finally:
        with ThreadPoolExecutor(10) as pool:
            list(pool.map(lambda u: hub.stop_server(u, wait=False), users))
        until(lambda: not ledger.leases.active(), 120, "every lease released",
              show=(hub.log_path, ledger.leases.active))


def test_a_server_killed_from_outside_frees_its_slice(hub, ledger):
    _start(hub, "bob", "small")
    pid = hub.server_state("bob")["pid"]
    os.kill(pid, signal.SIGKILL)
    until(lambda: not ledger.leases.active(), 30, "bob's lease released", show=hub.log_path)
    assert ledger.leases.history(user="bob")[-1].release_code == "server_exited"
    until(lambda: hub.server_model("bob") is None, 30, "bob's server gone",
          show=hub.log_path)


# Started from a kernel: a process that escapes the server (``setsid``), keeps the slice's
# CUDA_VISIBLE_DEVICES and names another lease. It prints its PID (setsid execs in place:
# the child of Popen is not a process-group leader).
ESCAPE = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(['setsid', sys.executable, '-c', 'import time; time.sleep(600)'],\n"
    "    env={**os.environ, 'MIG_SPAWNER_LEASE_ID': 'not-this-lease'},\n"
    "    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print(p.pid)"
)


def test_a_process_left_behind_on_the_slice_is_stopped_before_the_slice_is_free(hub, ledger):
    _start(hub, "ana", "small")
    lease = ledger.leases.active_for_server("ana")
    pid = int(hub.run_in_kernel("ana", ESCAPE).strip())
    try:
        hub.stop_server("ana")
        until(lambda: not ledger.leases.get(lease.id).held or not _alive(pid), 30,
              "the lease released or the escaped process gone", show=hub.log_path)
        # Never: the slice free for another server while that process still uses it.
        until(lambda: not ledger.leases.get(lease.id).held, 30, "ana's lease released",
              show=hub.log_path)
        assert not _alive(pid), "the slice was released while a process still used it"
        assert ledger.leases.get(lease.id).release_code == "stopped"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_hub_restart_keeps_live_leases_and_frees_dead_ones(hub, ledger):
    _start(hub, "ana", "small")
    _start(hub, "bob", "small")
    live = ledger.leases.active_for_server("ana")
    bob_pid = hub.server_state("bob")["pid"]
    hub.stop_hub()
    os.kill(bob_pid, signal.SIGKILL)
    hub.restart_hub(timeout=120)
    try:
        until(lambda: ledger.leases.active_for_server("bob") is None, 30, "bob's lease released",
              show=hub.log_path)
        assert ledger.leases.active_for_server("ana") == live
        # ana's server is still there and still on the same slice.
        out = hub.run_in_kernel("ana", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
        assert out.strip() == live.mig_uuid
    finally:
        hub.stop_server("ana")
        hub.stop_server("bob")
