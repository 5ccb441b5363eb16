"""KubeMIGSpawner in a real JupyterHub on the real control plane, end to end.

The hub (configured from the shipped snippets, 20-groups.py and examples/kube.py) asks
kube-scheduler for its pods; they land on the cluster's process node, whose "kubelet"
(tests/support/kube_agents.py) runs each pod's notebook server as a local process on
a loopback address of its own, with the device the pod was given: through NVIDIA's
device plugin (the node's A100 80GB: 3g.40gb + 2x 1g.10gb, mixed strategy) for one
hub, through a DRA claim (its H200: 2x 1g.18gb + 3g.71gb) for the other. One hub per
wiring for the module; the node is the module's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from mig_spawner.ledger import Ledger
from tests.support.hub_harness import REPO, HubProcess, free_port
from tests.support.kube_agents import process_node_gpus
from tests.support.kube_cluster import PROCESS_NODE, ClusterInfo
from tests.support.kube_fixture import KubeTest, namespace_for
from tests.support.kube_gpus import dra_device_uuids
from tests.support.kube_rest import Kube
from tests.support.kube_tap import Tap
from tests.support.polling import until

pytestmark = pytest.mark.hub

SNIPPETS = [REPO / "jupyterhub_config.d" / "20-groups.py",
            REPO / "jupyterhub_config.d" / "examples" / "kube.py"]


class Cluster:
    """The module's namespace on the run's cluster, read and written from sync tests
    (each call on a fresh connection in its own event loop)."""

    def __init__(self, info: ClusterInfo, namespace: str, workdir: Path) -> None:
        self.info = info
        self.ns = namespace
        self.workdir = workdir
        self.tap = Tap(info.server, info.ca)
        self.test: KubeTest | None = None

    def run(self, work):  # work: async (KubeTest) -> value
        async def go():
            async with Kube(self.info.credentials()) as admin:
                test = KubeTest(self.info, self.ns, admin, self.tap, self.workdir)
                test.hub_token = self.test.hub_token if self.test else ""
                return await work(test)

        return asyncio.run(go())

    def pod(self, user: str) -> dict | None:
        return self.run(lambda k: k.pod(f"jupyter-{user}"))

    def claims(self) -> list[dict]:
        return self.run(lambda k: k.claims())


@pytest.fixture(scope="module")
def cluster(kube_cluster: ClusterInfo, tmp_path_factory, request) -> Iterator[Cluster]:
    """A namespace for the module's hubs, the hub's account bound to the documented
    Roles, and a tap in front of the API server."""
    c = Cluster(kube_cluster, namespace_for(request.node.nodeid), tmp_path_factory.mktemp("kube"))
    c.tap.start()

    async def setup(test: KubeTest) -> KubeTest:
        await test.admin.create({"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": c.ns}})
        await test.admin.watch_object(f"/api/v1/namespaces/{c.ns}/serviceaccounts/default",
                               lambda sa: sa is not None)
        await test.grant()
        return test

    c.test = c.run(setup)
    yield c
    with contextlib.suppress(Exception):
        c.run(lambda k: k.admin.delete(f"/api/v1/namespaces/{c.ns}"))
        c.run(lambda k: _delete_all(k, c.test.cluster_objects))
    c.tap.stop()


async def _delete_all(kube: KubeTest, paths: list[str]) -> None:
    for path in paths:
        await kube.admin.delete(path)


def start_hub(cluster: Cluster, workdir: Path, resource_api: str) -> HubProcess:
    kubeconfig = cluster.test.kubeconfig()
    extra = textwrap.dedent(
        f"""
        c.KubeSpawner.k8s_api_host = "{cluster.tap.url}"
        c.KubeSpawner.namespace = "{cluster.ns}"
        c.KubeSpawner.port = {free_port()}
        c.KubeSpawner.image = "quay.io/jupyter/base-notebook:latest"
        c.KubeSpawner.start_timeout = 90
        c.KubeSpawner.http_timeout = 90
        c.Spawner.poll_interval = 1
        c.KubeMIGSpawner.mig_resource_api = "{resource_api}"
        c.KubeMIGSpawner.mig_node_label_selector = "kubernetes.io/hostname={PROCESS_NODE}"
        c.KubeMIGSpawner.mig_node_selector = {{"kubernetes.io/hostname": "{PROCESS_NODE}"}}
        c.MIGPolicyConfig.group_policies["waiters"] = {{
            "allowed": ["small"], "queue": True, "max_wait": "2m"}}
        """
    )
    hub = HubProcess.start(workdir, SNIPPETS, extra, env={"KUBECONFIG": kubeconfig},
                           timeout=120)
    for user, groups in (("ana", ["analysts"]), ("bob", ["analysts"]),
                         ("cy", ["analysts"]), ("dee", ["waiters"]), ("nobody", [])):
        hub.create_user(user, groups=groups)
    return hub


@pytest.fixture(scope="module")
def hub(cluster, tmp_path_factory):
    hub = start_hub(cluster, tmp_path_factory.mktemp("kubehub"), "device-plugin")
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def ledger(hub):
    with Ledger(f"sqlite:///{hub.workdir / 'mig_spawner_ledger.sqlite'}") as ledger:
        yield ledger


def server_environment(pod: dict) -> dict[str, str]:
    """The environment of the pod's running notebook server process (the kubelet names
    its pid in the container ID): what the server really got."""
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].split("://")[1])
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def stop_watching_the_release(hub: HubProcess, cluster: Cluster, ledger: Ledger,
                              user: str) -> None:
    """Stop ``user``'s server; while its pod is there (Terminating: its server is
    being stopped), its lease must still be held."""
    hub.stop_server(user, wait=False)
    while True:
        released = ledger.leases.active_for_server(user) is None
        there = cluster.pod(user) is not None  # read after: a release before it counts
        assert not (released and there), "the lease was released before the pod went"
        if not there:
            break
    until(lambda: ledger.leases.active_for_server(user) is None, 60, f"{user}'s lease released")


def test_spawn_gets_a_pod_with_one_slice_and_stop_gives_it_back(hub, cluster, ledger):
    r, events = hub.spawn_and_follow("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    messages = [e["message"] for e in events]
    assert any("Reserved 1g.10gb on A100 80GB" in m for m in messages), messages

    pod = cluster.pod("ana")
    spec = pod["spec"]
    resources = spec["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert resources["requests"]["nvidia.com/mig-1g.10gb"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        spec["tolerations"])
    assert spec["nodeName"] == PROCESS_NODE
    # The device plugin's device, and no other, is the server's.
    env = server_environment(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
    assert "," not in env["NVIDIA_VISIBLE_DEVICES"]
    assert env["MIG_SPAWNER_PROFILE"] == "1g.10gb"
    (lease,) = ledger.leases.active()
    assert (lease.user, lease.mode, lease.profile, lease.node, lease.pod) == (
        "ana", "kube", "1g.10gb", PROCESS_NODE, f"{cluster.ns}/jupyter-ana")
    assert lease.holder_pod_uid == pod["metadata"]["uid"]

    stop_watching_the_release(hub, cluster, ledger, "ana")
    assert cluster.pod("ana") is None
    assert ledger.leases.get(lease.id).release_code == "stopped"


def test_forged_options_are_refused_before_any_pod(hub, cluster, ledger):
    r = hub.spawn("bob", {"profile": "full"})
    assert r.status_code == 403, r.text
    assert "not allowed for your groups (analysts)" in r.json()["message"]
    r = hub.spawn("nobody", {"profile": "small"})
    assert r.status_code == 403, r.text
    assert cluster.pod("bob") is None and cluster.pod("nobody") is None
    assert ledger.leases.active() == []
    # Both kept for the usage report, with what was asked for and by which group.
    until(lambda: len(ledger.refusals.between()) >= 2, 10, "two refusals recorded")
    assert [(r.user, r.offer, r.reason, r.group) for r in ledger.refusals.between()[-2:]] == [
        ("bob", "full", "not_allowed", "analysts"),
        ("nobody", "small", "no_gpu_access", "default"),
    ]


def test_when_the_cluster_is_full_the_next_user_hears_why(hub, cluster, ledger):
    for user in ("ana", "bob"):
        until(lambda u=user: hub.spawn(u, {"profile": "small"}).status_code in (201, 202),
              30, f"{user}'s spawn accepted", every=1)
        hub.wait_ready(user)
    try:
        r = hub.spawn("cy", {"profile": "small"})
        assert r.status_code == 503, r.text
        assert "All 'Small" in r.json()["message"]
        assert cluster.pod("cy") is None
        assert sorted(lease.user for lease in ledger.leases.active()) == ["ana", "bob"]
        # Two servers on the node's port, each on its own pod IP, each its own device.
        envs = [server_environment(cluster.pod(u)) for u in ("ana", "bob")]
        assert envs[0]["NVIDIA_VISIBLE_DEVICES"] != envs[1]["NVIDIA_VISIBLE_DEVICES"]

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
    assert ledger.leases.active() == []


def test_a_waiter_gets_its_pod_when_a_node_frees_a_slice(hub, cluster, ledger):
    for user in ("ana", "bob"):
        until(lambda u=user: hub.spawn(u, {"profile": "small"}).status_code in (201, 202),
              30, f"{user}'s spawn accepted", every=1)
        hub.wait_ready(user)
    try:
        assert hub.spawn("dee", {"profile": "small"}).status_code == 202
        assert [w.user for w in ledger.waits.waiting()] == ["dee"]
        assert cluster.pod("dee") is None  # no pod while waiting
        hub.stop_server("ana")
        hub.wait_ready("dee", timeout=90)
        lease = ledger.leases.active_for_server("dee")
        assert (lease.profile, lease.node, lease.pod) == ("1g.10gb", PROCESS_NODE,
                                                          f"{cluster.ns}/jupyter-dee")
        assert cluster.pod("dee") is not None and ledger.waits.waiting() == []
    finally:
        for user in ("ana", "bob", "dee"):
            with contextlib.suppress(Exception):
                hub.stop_server(user)


# --- the same through a DRA claim ------------------------------------------------------


@pytest.fixture(scope="module")
def dra_hub(cluster, hub, tmp_path_factory):
    """A second hub (after the first's tests: the node's slices are the module's), its
    pods asking NVIDIA's DRA driver through a claim."""
    hub.close()
    dra = start_hub(cluster, tmp_path_factory.mktemp("kubehub-dra"), "dra")
    yield dra
    dra.close()


def test_a_dra_spawn_runs_the_server_on_the_device_its_claim_was_allocated(
        dra_hub, cluster):
    with Ledger(f"sqlite:///{dra_hub.workdir / 'mig_spawner_ledger.sqlite'}") as ledger:
        r = dra_hub.spawn("ana", {"profile": "small"})
        assert r.status_code in (201, 202), r.text
        dra_hub.wait_ready("ana")
        pod = cluster.pod("ana")
        assert pod["spec"]["resourceClaims"] == [
            {"name": "mig", "resourceClaimTemplateName": "mig-h200-1g-18gb"}]
        (claim,) = cluster.claims()
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["pool"] == PROCESS_NODE and "-mig-1g18gb-" in result["device"]
        # The server's environment names the device the claim was allocated.
        uuid = dra_device_uuids(PROCESS_NODE, process_node_gpus())[result["device"]]
        assert server_environment(pod)["NVIDIA_VISIBLE_DEVICES"] == uuid
        (lease,) = ledger.leases.active()
        assert (lease.profile, lease.node) == ("1g.18gb", PROCESS_NODE)

        stop_watching_the_release(dra_hub, cluster, ledger, "ana")
        assert cluster.pod("ana") is None and cluster.claims() == []
        assert ledger.leases.get(lease.id).release_code == "stopped"
