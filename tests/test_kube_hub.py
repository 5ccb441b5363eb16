"""KubeMIGSpawner in a real JupyterHub, against the stand-in Kubernetes API.

One hub for the module, configured from the shipped snippets (20-groups.py and
examples/kube.py). The stand-in API runs in a thread; its scheduler places pods on
one A100 80GB node (2x 1g.10gb, 1x 3g.40gb, mixed strategy) and a small "kubelet"
runs each scheduled pod's notebook container as a local process on its own loopback
address (127.0.0.N stands for the pod IP), so the hub reaches real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import textwrap
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from mig_spawner.ledger import Ledger
from tests.support import reaper
from tests.support.hub_harness import REPO, VENV_BIN, HubProcess, free_port
from tests.support.kube_objects import gpu_labels, node, write_kubeconfig
from tests.support.kube_standin import KubeStandin
from tests.support.polling import until

pytestmark = pytest.mark.hub

SNIPPETS = [REPO / "jupyterhub_config.d" / "20-groups.py",
            REPO / "jupyterhub_config.d" / "examples" / "kube.py"]


class Kubelet:
    """Runs a scheduled pod's notebook container as a process on 127.0.0.N."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.count = 0

    def run(self, pod: dict) -> str:
        self.count += 1
        ip = f"127.0.0.{self.count + 1}"
        name = pod["metadata"]["name"]
        container = next(c for c in pod["spec"]["containers"] if c["name"] == "notebook")
        env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        # The pod's own network namespace: the server listens on the pod IP.
        url = urlsplit(env["JUPYTERHUB_SERVICE_URL"])
        env["JUPYTERHUB_SERVICE_URL"] = urlunsplit(url._replace(netloc=f"{ip}:{url.port}"))
        home = self.workdir / name
        home.mkdir(parents=True, exist_ok=True)
        env.update(HOME=str(home), PATH=f"{VENV_BIN}:/usr/bin:/bin")
        with (self.workdir / f"{name}.log").open("ab") as log:
            self.procs[name] = reaper.start(
                [*(container.get("command") or []), *container["args"]], f"pod {name}",
                env={**env, reaper.MARK: reaper.mark()}, cwd=home, stdout=log,
                stderr=subprocess.STDOUT,
            )
        return ip

    def stop(self, pod: dict) -> None:
        proc = self.procs.pop(pod["metadata"]["name"], None)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop({"metadata": {"name": name}})


def a100_node() -> dict:
    return node(
        "gpu-a1",
        gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", config="balanced-a100-80gb"),
        {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1"},
        taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The stand-in API with its kubelet, on its own event loop in a thread."""
    workdir = tmp_path_factory.mktemp("kubelet")
    kubelet = Kubelet(workdir)
    standin = KubeStandin([a100_node()], kubelet=kubelet)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> str:
        return standin.start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield standin
    kubelet.close()
    loop.call_soon_threadsafe(standin.stop)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def hub(cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("kubehub")
    kubeconfig = write_kubeconfig(workdir / "kubeconfig", cluster.url)
    extra = textwrap.dedent(
        f"""
        c.KubeSpawner.k8s_api_host = "{cluster.url}"
        c.KubeSpawner.namespace = "jupyterhub"
        c.KubeSpawner.port = {free_port()}
        c.KubeSpawner.image = "quay.io/jupyter/base-notebook:latest"
        c.KubeSpawner.start_timeout = 60
        c.KubeSpawner.http_timeout = 60
        c.Spawner.poll_interval = 1
        c.MIGPolicyConfig.group_policies["waiters"] = {{
            "allowed": ["small"], "queue": True, "max_wait": "2m"}}
        """
    )
    hub = HubProcess.start(workdir, SNIPPETS, extra, env={"KUBECONFIG": kubeconfig},
                           timeout=120)
    for user, groups in (("ana", ["analysts"]), ("bob", ["analysts"]),
                         ("cy", ["analysts"]), ("dee", ["waiters"]), ("nobody", [])):
        hub.create_user(user, groups=groups)
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def ledger(hub):
    with Ledger(f"sqlite:///{hub.workdir / 'mig_spawner_ledger.sqlite'}") as ledger:
        yield ledger


def pod_of(cluster: KubeStandin, user: str) -> dict | None:
    return next((p for p in list(cluster.pods) if p["metadata"]["name"] == f"jupyter-{user}"),
                None)


def test_spawn_gets_a_pod_with_one_slice_and_stop_gives_it_back(hub, cluster, ledger):
    r, events = hub.spawn_and_follow("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    messages = [e["message"] for e in events]
    assert any("Reserved 1g.10gb on A100 80GB" in m for m in messages), messages

    spec = pod_of(cluster, "ana")["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert resources["requests"]["nvidia.com/mig-1g.10gb"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        spec["tolerations"])
    (lease,) = ledger.active()
    assert (lease.user, lease.mode, lease.profile, lease.node, lease.pod) == (
        "ana", "kube", "1g.10gb", "gpu-a1", "jupyterhub/jupyter-ana")

    hub.stop_server("ana")
    assert pod_of(cluster, "ana") is None
    assert ledger.active() == []
    assert ledger.get(lease.id).release_code == "stopped"


def test_forged_options_are_refused_before_any_pod(hub, cluster, ledger):
    r = hub.spawn("bob", {"profile": "full"})
    assert r.status_code == 403, r.text
    assert "not allowed for your groups (analysts)" in r.json()["message"]
    r = hub.spawn("nobody", {"profile": "small"})
    assert r.status_code == 403, r.text
    assert pod_of(cluster, "bob") is None and pod_of(cluster, "nobody") is None
    assert ledger.active() == []
    # Both kept for the usage report, with what was asked for and by which group.
    until(lambda: len(ledger.refusals()) >= 2, 10, "both refusals recorded",
          show=hub.log_path)
    assert [(r.user, r.offer, r.reason, r.group) for r in ledger.refusals()[-2:]] == [
        ("bob", "full", "not_allowed", "analysts"),
        ("nobody", "small", "no_gpu_access", "default"),
    ]


def test_when_the_cluster_is_full_the_next_user_hears_why(hub, cluster, ledger):
    for user in ("ana", "bob"):
        r = hub.spawn(user, {"profile": "small"})
        assert r.status_code in (201, 202), r.text
        hub.wait_ready(user)
    try:
        r = hub.spawn("cy", {"profile": "small"})
        assert r.status_code == 503, r.text
        assert "All 'Small" in r.json()["message"]
        assert pod_of(cluster, "cy") is None
        assert sorted(lease.user for lease in ledger.active()) == ["ana", "bob"]

        browser = hub.login("cy")
        page = browser.get(f"{hub.url}/hub/spawn").text
        # Small: both 1g.10gb taken; medium (2g.20gb) is in no node's layout.
        assert "all 2 in use right now" in page
        assert "Medium" not in page  # in no node's layout: left off the form
        assert "free now" not in page
    finally:
        for user in ("ana", "bob"):
            with contextlib.suppress(Exception):
                hub.stop_server(user)
    assert ledger.active() == []


def test_a_waiter_gets_its_pod_when_a_node_frees_a_slice(hub, cluster, ledger):
    # The last test's pods may still be terminating, and the nodes' counts are cached.
    until(lambda: not cluster.pods and not ledger.active(), 30,
          "the last test's pods and leases gone", show=(hub.log_path, lambda: cluster.pods))
    for user in ("ana", "bob"):
        until(lambda u=user: hub.spawn(u, {"profile": "small"}).status_code in (201, 202), 30,
              f"{user}'s spawn taken", show=hub.log_path, every=1)
        hub.wait_ready(user)
    try:
        assert hub.spawn("dee", {"profile": "small"}).status_code == 202
        assert [w.user for w in ledger.waiting()] == ["dee"]
        assert pod_of(cluster, "dee") is None  # no pod while waiting
        hub.stop_server("ana")
        hub.wait_ready("dee")
        lease = ledger.active_for_server("dee")
        assert (lease.profile, lease.node, lease.pod) == ("1g.10gb", "gpu-a1",
                                                          "jupyterhub/jupyter-dee")
        assert pod_of(cluster, "dee") is not None and ledger.waiting() == []
    finally:
        for user in ("ana", "bob", "dee"):
            with contextlib.suppress(Exception):
                hub.stop_server(user)
