"""The Kubernetes fixtures: the run's real cluster (tests/support/kube_cluster.py) and, per
test, a namespace of its own with the hub's service account bound to the Roles that
docs/kubernetes.md documents, nodes only that test uses, and a tap in front of the API
server for the hub's requests.

Tests share one control plane, so each one keeps to its own: its namespace (deleted at
the end, the namespace controller removing what is in it), its nodes (labelled
:data:`~tests.support.kube_gpus.OWNER_LABEL` with the namespace; deleted at the end),
and its hub pods select those nodes (``KubeMIGSpawner.mig_node_selector``) while the
hub reads only them (``mig_node_label_selector``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import kube_cluster as cluster
from tests.support.kube_cluster import PROCESS_NODE, ClusterInfo
from tests.support.kube_gpus import GPUS_ANNOTATION, OWNER_LABEL, Gpus, gpu_node
from tests.support.kube_rest import ApiError, Kube
from tests.support.kube_tap import Tap

DOCS = Path(__file__).resolve().parents[2] / "docs"
HUB_ACCOUNT = "hub"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE_GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def documented_rbac(doc: Path) -> list[dict]:
    """The Roles, ClusterRoles and bindings in the YAML blocks of ``doc``."""
    blocks = re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.DOTALL)
    return [d for b in blocks for d in yaml.safe_load_all(b)
            if isinstance(d, dict) and d.get("apiVersion", "").startswith(
                "rbac.authorization.k8s.io")]


def _run_id(config: pytest.Config) -> str:
    worker = getattr(config, "workerinput", None)
    return worker["testrunuid"] if worker else f"pid{os.getpid()}"


@pytest.fixture(scope="session")
def kube_cluster(request: pytest.FixtureRequest) -> Iterator[ClusterInfo]:
    """The run's cluster, shared by every worker (the first starts it, the last
    stops it)."""
    run = _run_id(request.config)
    try:
        yield cluster.acquire(run)
    finally:
        cluster.release(run)


class KubeTest:
    """One test's share of the cluster (see the module doc). ``admin`` reads and writes
    as the cluster admin; the hub's requests go through ``tap``."""

    def __init__(self, info: ClusterInfo, namespace: str, admin: Kube, tap: Tap,
                 tmp: Path) -> None:
        self.info = info
        self.ns = namespace
        self.admin = admin
        self.tap = tap
        self.tmp = tmp
        self.hub_token = ""
        self.cluster_objects: list[str] = []  # paths of cluster-scoped objects made
        self.taps: list[Tap] = []  # more taps, for other accounts

    # --- names ---------------------------------------------------------------------

    def node_name(self, short: str) -> str:
        """The cluster-wide name of this test's node ``short``."""
        return f"{self.ns}-{short}"

    @property
    def selector(self) -> str:
        """A label selector for this test's nodes."""
        return f"{OWNER_LABEL}={self.ns}"

    @property
    def url(self) -> str:
        """Where the hub reaches the API server: through the tap."""
        return self.tap.url

    def kubeconfig(self, name: str = "kubeconfig", token: str | None = None,
                   server: str | None = None) -> str:
        """A kubeconfig for the hub's service account (``token`` for another), through
        the tap unless ``server`` says otherwise."""
        return self.info.kubeconfig(self.tmp / name, token or self.hub_token, self.ns,
                                    server=server or self.tap.url)

    def spawner_config(self) -> dict[str, Any]:
        """KubeMIGSpawner settings that keep a spawn to this test's nodes."""
        return {"namespace": self.ns, "k8s_api_host": self.tap.url,
                "mig_node_label_selector": self.selector,
                "mig_node_selector": {OWNER_LABEL: self.ns}}

    @contextlib.asynccontextmanager
    async def client(self, kubeconfig: str | None = None) -> AsyncIterator[Any]:
        """A kubernetes_asyncio ``ApiClient`` as the hub's account (or ``kubeconfig``'s),
        configured the way KubeSpawner configures its own."""
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        await config.load_kube_config(config_file=kubeconfig or self.kubeconfig(),
                                      client_configuration=configuration)
        async with client.ApiClient(configuration) as api_client:
            yield api_client

    def compact(self) -> int:
        """Compact etcd's history up to now, as the API server does every 5 minutes:
        continue tokens and watches (not served from the watch cache) from an older
        version then get 410 Gone. Returns the revision."""
        import base64
        import json
        import urllib.request

        def call(path: str, body: dict) -> dict:
            request = urllib.request.Request(
                self.info.etcd + path, data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.loads(r.read())

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        # A write first (outside the API server's keys), so that the versions read
        # until now are all older than the compaction's; then what the API server's
        # own compaction writes, which its caches follow (compact_rev_key).
        tick = {"key": b64("/mig-spawner-test/tick"), "value": b64(self.ns)}
        revision = int(call("/v3/kv/put", tick)["header"]["revision"])
        call("/v3/kv/put", {"key": b64("compact_rev_key"), "value": b64(str(revision))})
        call("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    # --- RBAC ----------------------------------------------------------------------

    async def grant(self, docs: Iterable[str] = ("kubernetes.md",),
                    account: str = HUB_ACCOUNT, drop: Mapping[str, set[str]] | None = None
                    ) -> str:
        """Bind ``account`` (created) to the RBAC objects documented in ``docs``, in this
        namespace; ``drop`` takes verbs out of a (Cluster)Role's rules by its name.
        Returns a token of the account; waits until RBAC allows what was granted."""
        await self.admin.apply({"apiVersion": "v1", "kind": "ServiceAccount",
                                "metadata": {"name": account, "namespace": self.ns}})
        subject = {"kind": "ServiceAccount", "name": account, "namespace": self.ns}
        wanted: set[tuple[str, str]] = set()
        for doc in docs:
            for obj in documented_rbac(DOCS / doc):
                obj = await self._grant_one(obj, subject, dict(drop or {}))
                wanted |= {(res, verb) for r in obj.get("rules") or []
                           for res in r["resources"] for verb in r["verbs"]}
        token = (await self.admin.request(
            "POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": 7200}}))["status"]["token"]
        # RBAC reads its objects through informers: wait until they are seen.
        async with Kube(self.info.credentials(token)) as hub:
            for _ in range(200):
                review = await hub.request(
                    "POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
                    {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
                     "spec": {"namespace": self.ns}})
                rules = review["status"].get("resourceRules") or []
                seen = {(res, verb) for r in rules for res in r.get("resources", [])
                        for verb in r.get("verbs", [])}
                if wanted <= seen:
                    break
                await asyncio.sleep(0.05)
        if account == HUB_ACCOUNT:
            self.hub_token = token
        return token

    async def _grant_one(self, obj: dict, subject: dict, drop: dict[str, set[str]]) -> dict:
        kind = obj["kind"]
        name = obj["metadata"]["name"]
        if kind in ("Role", "ClusterRole") and name in drop:
            rules = [{**r, "verbs": [v for v in r["verbs"] if v not in drop[name]]}
                     for r in obj["rules"]]
            obj = {**obj, "rules": [r for r in rules if r["verbs"]]}
        # Each account its own copy: another account's dropped verbs stay its own.
        own = f"{name}-{subject['name']}"
        if kind == "Role":
            obj = {**obj, "metadata": {"name": own, "namespace": self.ns}}
            await self.admin.apply(obj)
            await self.admin.apply({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": own, "namespace": self.ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": own},
                "subjects": [subject]})
        elif kind == "ClusterRole":
            own = f"{own}-{self.ns}"
            await self.admin.apply({**obj, "metadata": {"name": own}})
            self.cluster_objects.append(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{own}")
            await self.admin.apply({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": own},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": own},
                "subjects": [subject]})
            self.cluster_objects.append(
                f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{own}")
        return obj

    async def account(self, name: str, drop: Mapping[str, set[str]] | None = None
                      ) -> tuple[str, str]:
        """Another service account of the hub's, bound like ``hub`` but with ``drop``'s
        verbs taken out; its kubeconfig and a tap of its own (KubeSpawner loads one
        configuration per API host). Returns ``(kubeconfig, url)``."""
        token = await self.grant(account=name, drop=drop)
        tap = Tap(self.info.server, self.info.ca)
        tap.start()
        self.taps.append(tap)
        return self.kubeconfig(f"kubeconfig-{name}", token, server=tap.url), tap.url

    # --- nodes and pods ---------------------------------------------------------------

    async def add_node(self, short: str, gpus: Gpus | Iterable | None = None, *,
                       ready: bool = True, **kw: Any) -> dict:
        """Create this test's node ``short`` (tests/support/kube_gpus.gpu_node's
        arguments) and wait until KWOK has made it Ready and the GPU agents have
        published its devices. Returns the node as the API has it then."""
        name = self.node_name(short)
        body = gpu_node(name, gpus, owner=self.ns, **kw)
        await self.admin.create(body)
        want_slices = gpus is not None and any(
            g.api == "dra" for g in (gpus.gpus if isinstance(gpus, Gpus) else gpus))

        def published(node: dict | None) -> bool:
            """Ready, and the node lifecycle controller took the not-ready taint off
            that the API server puts on every new node."""
            if node is None:
                return False
            return usable(node) or not ready or not kw.get("kwok", True)

        node = await self.admin.watch_object(f"/api/v1/nodes/{name}", published)
        if want_slices:
            for _ in range(400):
                if await self.slices(short):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"no ResourceSlice for {name}")
        assert node is not None
        return node

    async def slices(self, short: str) -> list[dict]:
        return await self.admin.items("/apis/resource.k8s.io/v1/resourceslices",
                                      fieldSelector=f"spec.nodeName={self.node_name(short)}")

    async def node(self, short: str) -> dict:
        return await self.admin.get(f"/api/v1/nodes/{self.node_name(short)}")

    async def pods(self, namespace: str | None = None) -> list[dict]:
        return await self.admin.items(f"/api/v1/namespaces/{namespace or self.ns}/pods")

    async def pod(self, name: str, namespace: str | None = None) -> dict | None:
        return await self.admin.find(f"/api/v1/namespaces/{namespace or self.ns}/pods/{name}")

    async def claims(self) -> list[dict]:
        return await self.admin.items(
            f"/apis/resource.k8s.io/v1/namespaces/{self.ns}/resourceclaims")

    async def run_pod(self, name: str, node_short: str, limits: Mapping[str, str] | None = None,
                      *, namespace: str | None = None, running: bool = True,
                      **spec: Any) -> dict:
        """A pod of someone else (a batch job) on this test's node ``node_short``, bound
        there by the scheduler; waits until it runs when ``running``."""
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace or self.ns},
                "spec": {"containers": [{"name": "job", "image": "batch:1",
                                         "resources": {"limits": dict(limits or {})}}],
                         "nodeSelector": {"kubernetes.io/hostname": self.node_name(node_short)},
                         "tolerations": [TOLERATE_GPU], **spec}}
        if namespace and namespace != self.ns:
            await self.namespace(namespace)
        created = await self.admin.create(body)
        if not running:
            return created
        path = f"/api/v1/namespaces/{namespace or self.ns}/pods/{name}"
        found = await self.admin.watch_object(path, lambda p: p is not None and p.get(
            "status", {}).get("phase") == "Running")
        assert found is not None
        return found

    async def namespace(self, name: str) -> str:
        """Another namespace of this test's (``name``: by convention ``<ns>-<what>``),
        its ``default`` service account in place; deleted with the test."""
        await self.admin.apply({"apiVersion": "v1", "kind": "Namespace",
                                "metadata": {"name": name, "labels": {OWNER_LABEL: self.ns}}})
        await self.admin.watch_object(f"/api/v1/namespaces/{name}/serviceaccounts/default",
                               lambda sa: sa is not None)
        self.cluster_objects.append(f"/api/v1/namespaces/{name}")
        return name

    async def close(self) -> None:
        """Delete what the test made: its nodes (their ResourceSlices go with them),
        namespaces and cluster roles."""
        for node in await self.admin.items("/api/v1/nodes", labelSelector=self.selector):
            await self.admin.delete(f"/api/v1/nodes/{node['metadata']['name']}")
        for path in self.cluster_objects:
            await self.admin.delete(path)
        await self.admin.delete(f"/api/v1/namespaces/{self.ns}")


def usable(node: dict) -> bool:
    """Ready, and without the taints the API server and the node lifecycle controller
    put on a node that is new or not ready (``node.kubernetes.io/*``)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    taints = (node.get("spec") or {}).get("taints") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
        t["key"].startswith("node.kubernetes.io/") for t in taints)


async def nodes_usable(admin: Kube, selector: str, count: int, timeout: float = 300) -> None:
    """Wait until ``count`` nodes matching ``selector`` are :func:`usable` (benchmarks
    that make many nodes at once)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await admin.items("/api/v1/nodes", labelSelector=selector)
        if len(found) == count and all(usable(n) for n in found):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{selector}: {sum(map(usable, found))} of {count} nodes usable")
        await asyncio.sleep(0.5)


async def run_check_command(kubeconfig: str, *args: str) -> tuple[int, str, str]:
    """``python -m mig_spawner.kube --kubeconfig KUBECONFIG ARGS``: its exit status,
    standard output and standard error."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mig_spawner.kube", "--kubeconfig", kubeconfig, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def namespace_for(nodeid: str) -> str:
    """A fresh namespace name that says which test made it."""
    name = re.sub(r"[^a-z0-9]+", "-", nodeid.rsplit("::", 1)[-1].lower()).strip("-")
    return f"{name[:40].strip('-')}-{secrets.token_hex(3)}"


@pytest.fixture
async def kube(kube_cluster: ClusterInfo, request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeTest]:
    """This test's namespace on the shared cluster, its ``default`` service account in
    place (the API refuses pods without it), the hub's account bound to the documented
    Roles and written as KubeSpawner's default kubeconfig, and a tap in front of the API
    server. KubeSpawner's pod reflectors (kept per class) stop with the test."""
    from kubernetes_asyncio.config import kube_config
    from kubespawner import KubeSpawner
    from kubespawner.clients import load_config

    from mig_spawner.spawner.kube import KubeMIGSpawner

    namespace = namespace_for(request.node.nodeid)
    admin = Kube(kube_cluster.credentials())
    tap = Tap(kube_cluster.server, kube_cluster.ca)
    tap.start()
    test = KubeTest(kube_cluster, namespace, admin, tap, tmp_path)
    try:
        await admin.create({"apiVersion": "v1", "kind": "Namespace",
                            "metadata": {"name": namespace}})
        await admin.watch_object(f"/api/v1/namespaces/{namespace}/serviceaccounts/default",
                          lambda sa: sa is not None)
        await test.grant()
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", test.kubeconfig())
        yield test
    finally:
        for reflector in list(KubeSpawner.reflectors.values()):
            await reflector.stop()
        KubeSpawner.reflectors.clear()
        KubeMIGSpawner._readers.clear()
        # KubeSpawner loads one configuration per API host: a later test's tap may get
        # this one's port.
        load_config.cache_clear()
        try:
            await test.close()
        finally:
            for one in (tap, *test.taps):
                one.stop()
            await admin.close()


__all__ = ["GPUS_ANNOTATION", "GPU_TAINT", "PROCESS_NODE", "TOLERATE_GPU", "ApiError",
           "KubeTest", "kube", "kube_cluster"]


async def run_doctor(kube: KubeTest, kubeconfig: str, **settings: str) -> tuple[int, dict]:
    """Run ``mig-spawner doctor --kube --json`` with a hub config of ``settings``
    (KubeMIGSpawner's) and this test's namespace and nodes."""
    conf = kube.tmp / f"conf-{len(list(kube.tmp.iterdir()))}"
    conf.mkdir()
    lines = [f"c.KubeSpawner.namespace = {kube.ns!r}",
             f"c.KubeMIGSpawner.mig_node_label_selector = {kube.selector!r}",
             *(f"c.KubeMIGSpawner.{k} = {v!r}" for k, v in settings.items())]
    (conf / "40-kube.py").write_text("\n".join(lines) + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mig_spawner.cli.main", "doctor", "--kube", "--json", "-f",
        str(conf), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KUBECONFIG": kubeconfig})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out, err.decode()
    return proc.returncode, {c["name"]: c for c in json.loads(out)["checks"]}
