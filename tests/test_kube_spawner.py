"""KubeMIGSpawner end to end against the real control plane (tests/support/
kube_cluster.py): KubeSpawner's real start and stop, pods placed by kube-scheduler on
KWOK nodes whose device plugin advertises MIG slices, leases in a real ledger. The hub
talks to the API server as the service account the documented Roles bind, through a
tap that counts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from jupyterhub.spawner import SpawnException
from kubernetes_asyncio.config import kube_config
from traitlets import TraitError

from mig_spawner.ledger import Ledger
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.mocking import Hub, OrmSpawner, User
from tests.support.kube_fixture import GPU_TAINT, TOLERATE_GPU, KubeTest
from tests.support.kube_gpus import OWNER_LABEL, Gpu, Gpus, device_plugin_view
from tests.support.polling import until_async
from tests.support.spawners import created, held
from tests.support.spawners import kube_spawner as make

#: An A100 80GB cut 3g.40gb + 2x 1g.10gb, mixed strategy.
A100 = Gpus((Gpu("a100-80gb", {"3g.40gb": 1, "1g.10gb": 2}),))
#: KWOK's pod CIDR (tests/support/kube_cluster.py).
POD_IPS = "http://10.244."


def h200_single(slices: int) -> Gpus:
    """An H200 cut into 1g.18gb only, single strategy: the device plugin advertises
    plain ``nvidia.com/gpu``."""
    return Gpus((Gpu("h200", {"1g.18gb": slices}),), strategy="single")


async def hub_sees_pod_gone(s: KubeMIGSpawner) -> None:
    """Until KubeSpawner's pod reflector, which follows the API's watch, no longer has
    the spawner's pod."""
    await until_async(lambda: s.pod_reflector.pods.get(s.pod_ref) is None, 60,
                      f"the hub no longer seeing {s.pod_ref}",
                      show=lambda: sorted(s.pod_reflector.pods), every=0.05)


def requests_of(kube: KubeTest, pod: dict) -> dict:
    return pod["spec"]["containers"][0]["resources"]


async def test_start_asks_for_the_slice_and_the_lease_records_pod_and_node(kube, ledger_url):
    await kube.add_node("a1", A100, taints=[GPU_TAINT], mig_config="all-balanced")
    s = make(kube, ledger_url, profile="large", mig_tolerations=[TOLERATE_GPU],
             environment={"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0",
                          "TEAM": "analytics"})
    url = await s.start()
    assert url.startswith(POD_IPS)

    pod = await created(kube, s.pod_name)
    spec = pod["spec"]
    notebook = spec["containers"][0]
    assert notebook["resources"]["requests"]["nvidia.com/mig-3g.40gb"] == "1"
    assert notebook["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == "1"
    assert TOLERATE_GPU in spec["tolerations"]
    assert spec["nodeName"] == kube.node_name("a1")
    env = {e["name"]: e.get("value") for e in notebook["env"]}
    assert env["MIG_SPAWNER_PROFILE"] == "3g.40gb"
    # The device plugin picks the device; a config that names devices is not passed on.
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["TEAM"] == "analytics"

    (lease,) = held(ledger_url)
    assert (lease.mode, lease.profile, lease.state) == ("kube", "3g.40gb", "active")
    assert (lease.pod, lease.node) == (f"{kube.ns}/{s.pod_name}", kube.node_name("a1"))
    # The UID the API server gave the pod (random), the lease's holder.
    assert lease.holder_pod_uid == pod["metadata"]["uid"]
    assert s.get_state()["mig_lease_id"] == lease.id

    await s.stop()
    assert await kube.pods() == []
    assert held(ledger_url) == []


async def test_single_strategy_pod_selects_the_mig_product_node(kube, ledger_url):
    await kube.add_node("h1", h200_single(2), labels={"pool": "gpu"})
    s = make(kube, ledger_url, profile="small",
             mig_node_selector={"pool": "gpu", OWNER_LABEL: kube.ns})
    await s.start()
    spec = (await created(kube, s.pod_name))["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] == {"pool": "gpu", OWNER_LABEL: kube.ns,
                                    "nvidia.com/gpu.product": "NVIDIA-H200-MIG-1g.18gb"}
    assert spec["nodeName"] == kube.node_name("h1")
    await s.stop()


async def test_mixed_fleet_class_goes_to_the_model_with_room(kube, ledger_url):
    """'small' means 1g.10gb on A100 and 1g.18gb on H200: each spawn goes where most are
    free (ties: model key order), and the pod is pinned to that model's nodes."""
    await kube.add_node("a1", A100)
    await kube.add_node("h1", h200_single(1))
    spawners = [make(kube, ledger_url, name=n) for n in ("ana", "ben", "cy")]
    for s in spawners:
        await s.start()
    placed = {p["metadata"]["name"]: (p["spec"]["nodeName"], requests_of(kube, p)["limits"])
              for p in await kube.pods()}
    a1, h1 = kube.node_name("a1"), kube.node_name("h1")
    assert placed == {
        "jupyter-ana": (a1, {"nvidia.com/mig-1g.10gb": "1"}),
        "jupyter-ben": (a1, {"nvidia.com/mig-1g.10gb": "1"}),
        "jupyter-cy": (h1, {"nvidia.com/gpu": "1"}),
    }
    terms = (await created(kube, "jupyter-ana"))["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                            "values": ["NVIDIA-A100-SXM4-80GB"]}]}]
    assert sorted((lease.user, lease.profile, lease.node) for lease in held(ledger_url)) == [
        ("ana", "1g.10gb", a1), ("ben", "1g.10gb", a1), ("cy", "1g.18gb", h1),
    ]
    for s in spawners:
        await s.stop()


async def test_a_whole_gpu_pod_asks_for_nvidia_com_gpu_on_a_mixed_strategy_node(
        kube, ledger_url):
    """Mixed strategy advertises a node's GPUs with MIG off as nvidia.com/gpu beside its
    MIG slices: the whole-GPU offer asks for one of those, pinned to the model's nodes,
    and is charged the model's compute slices."""
    await kube.add_node("a1", [Gpu("a100-80gb", {"1g.10gb": 2}), Gpu("a100-80gb", "off")])
    allowed = ("small", "gpu")
    whole = make(kube, ledger_url, profile="gpu", allowed=allowed)
    assert "A whole GPU" in await whole.render_options_form()
    await whole.start()
    spec = (await created(kube, whole.pod_name))["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert spec["nodeName"] == kube.node_name("a1")
    small = make(kube, ledger_url, name="ben", allowed=allowed)
    await small.start()
    assert requests_of(kube, await created(kube, small.pod_name))["limits"] == {
        "nvidia.com/mig-1g.10gb": "1"}
    assert sorted((lease.user, lease.mode, lease.profile, lease.compute_slices)
                  for lease in held(ledger_url)) == [("ana", "kube", "gpu", 7),
                                                     ("ben", "kube", "1g.10gb", 1)]
    with pytest.raises(SpawnException, match="slices of the cluster are in use"):
        await make(kube, ledger_url, name="cy", profile="gpu", allowed=allowed).start()
    for s in (whole, small):
        await s.stop()


async def test_full_cluster_refuses_with_reason_and_keeps_no_lease(kube, ledger_url):
    await kube.add_node("a1", A100)
    batch = await kube.namespace(f"{kube.ns}-batch")
    await kube.run_pod("batch-train", "a1", {"nvidia.com/mig-3g.40gb": "1"},
                          namespace=batch)
    s = make(kube, ledger_url, profile="large")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.status_code == 503
    assert "All 'Large' slices of the cluster are in use" in str(info.value)
    assert held(ledger_url) == []
    with Ledger.open(ledger_url) as ledger:
        # Written on one of the worker threads without waiting: it comes, soon.
        await until_async(ledger.refusals.between, 30, "the refusal recorded", every=0.1)
        assert [(r.user, r.offer, r.profile, r.reason, r.group)
                for r in ledger.refusals.between()] == [
            ("ana", "large", "3g.40gb", "none_free", "analysts")]
    assert await kube.pods() == []


async def test_node_being_reconfigured_is_not_offered_and_the_refusal_says_so(
    kube, ledger_url
):
    labels, resources = device_plugin_view(A100)
    await kube.add_node("a1", None, labels={
        **labels, "nvidia.com/mig.config": "all-balanced",
        "nvidia.com/mig.config.state": "pending"}, allocatable=resources)
    s = make(kube, ledger_url, profile="large")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert f"{kube.node_name('a1')}: MIG Manager is applying a layout" in str(info.value)
    form = await s.render_options_form()
    assert "free now" not in form
    assert "no GPU in the cluster has this size" in form
    assert held(ledger_url) == []


async def test_form_shows_cluster_free_counts_from_one_cached_read(kube, ledger_url):
    await kube.add_node("a1", A100)
    await kube.add_node("h1", h200_single(3))
    other = await kube.namespace(f"{kube.ns}-x")
    await kube.run_pod("other", "h1", {"nvidia.com/gpu": "1"}, namespace=other)
    kube.tap.reset()
    forms = [await make(kube, ledger_url, name=f"u{i}").render_options_form()
             for i in range(5)]
    assert "4 free now" in forms[0]  # small: 2 A100 1g.10gb + 2 H200 1g.18gb
    assert "1 free now" in forms[0]  # large: the A100's 3g.40gb
    assert len(set(forms)) == 1
    # Five users, one Node list and one Pod list.
    assert kube.tap.count("GET", "/api/v1/nodes") == 1
    assert kube.tap.count("GET", "/api/v1/pods") == 1


async def test_form_counts_a_profile_that_two_models_share_once(kube, ledger_url):
    """'small' is 1g.10gb on the A100 80GB and on the H100: 2 + 3 free, not 5 per model."""
    await kube.add_node("a1", A100)
    await kube.add_node("h1", [Gpu("h100", {"1g.10gb": 3})])
    form = await make(kube, ledger_url).render_options_form()
    assert "5 free now" in form and "10 free now" not in form


async def test_form_says_why_when_the_cluster_cannot_be_read(kube, ledger_url,
                                                            monkeypatch):
    """The hub's account without 'list' in the ClusterRole: the API server's own 403."""
    kubeconfig, url = await kube.account("hub-no-list", drop={
        "mig-spawner-gpu-capacity": {"list"}})
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    form = await make(kube, ledger_url, k8s_api_host=url).render_options_form()
    assert "The cluster&#39;s GPU nodes cannot be read right now. Try again" in form
    # The API server's words name accounts and resources: for the hub log only.
    assert "serviceaccount" not in form and "free now" not in form
    assert form.count(" disabled>") == 2  # small and large, neither selectable
    assert "button.disabled = true" in form  # nor Start


async def test_quota_is_checked_in_the_ledger_before_the_cluster(kube, ledger_url):
    await kube.add_node("a1", A100)
    first = make(kube, ledger_url, server="one")
    await first.start()
    second = make(kube, ledger_url, server="two")
    with pytest.raises(SpawnException) as info:
        await second.start()
    assert info.value.status_code == 409
    assert "you already hold 1 of 1" in str(info.value)
    assert len(await kube.pods()) == 1
    await first.stop()


async def test_unschedulable_pod_gives_its_slice_back(kube, ledger_url):
    """The cluster looked free but the pod cannot be placed (here: a configured node
    selector no node has): the start times out and the lease is released."""
    await kube.add_node("a1", A100)
    s = make(kube, ledger_url, profile="large", mig_node_selector={"pool": "none"},
             start_timeout=3)
    with pytest.raises(TimeoutError):
        await s.start()
    assert held(ledger_url) == []


async def test_manifest_without_a_lease_has_no_gpu(kube, ledger_url):
    await kube.add_node("a1", A100, labels={"pool": "gpu"})
    s = make(kube, ledger_url, profile="large", mig_tolerations=[TOLERATE_GPU],
             mig_node_selector={"pool": "gpu", OWNER_LABEL: kube.ns})
    await s.start()
    await s.stop()
    pod_after = await s.get_pod_manifest()
    resources = pod_after.spec.containers[0].resources
    assert not any(k.startswith("nvidia.com/") for k in {**(resources.limits or {}),
                                                         **(resources.requests or {})})
    assert not pod_after.spec.node_selector
    assert not pod_after.spec.tolerations
    assert s.node_selector == {} and s.tolerations == []


def test_bad_settings_are_refused_at_config_time():
    with pytest.raises(TraitError, match="unknown GPU model 'h300'"):
        KubeMIGSpawner(_mock=True, mig_product_models={"X": "h300"})
    with pytest.raises(TraitError, match="'Equal' or 'Exists'"):
        KubeMIGSpawner(_mock=True, mig_tolerations=[{"key": "a", "operator": "Is"}])


async def test_shipped_example_config_builds_a_working_spawner(kube, ledger_url):
    """jupyterhub_config.d/examples/kube.py with the shipped group policies (and this
    test's node selector, which keeps it to its own nodes)."""
    from traitlets.utils.importstring import import_item

    from mig_spawner.config import load_config_files

    shipped = Path(__file__).resolve().parents[1] / "jupyterhub_config.d"
    c = load_config_files([shipped / "20-groups.py", shipped / "examples" / "kube.py"])
    assert import_item(c.JupyterHub.spawner_class) is KubeMIGSpawner
    c.MIGSettings.ledger_url = ledger_url
    c.KubeMIGSpawner.k8s_api_host = kube.url
    c.KubeMIGSpawner.mig_node_label_selector = kube.selector
    s = KubeMIGSpawner(config=c, user=User("ana", ["analysts"]), hub=Hub(),
                       orm_spawner=OrmSpawner(""), _mock=True)
    await kube.add_node("h1", h200_single(2), taints=[GPU_TAINT])
    form = await s.render_options_form()
    assert "2 free now" in form  # the example tolerates the usual GPU taint


def test_every_setting_is_explained():
    own = {name: trait for name, trait in KubeMIGSpawner.class_own_traits(config=True).items()}
    assert {"mig_strategy", "mig_tolerations", "mig_node_selector", "mig_product_models",
            "mig_availability_ttl", "mig_node_label_selector"} <= set(own)
    for name, trait in own.items():
        assert len(trait.help) > 40, name


async def test_after_a_hub_restart_a_live_pod_keeps_its_lease_and_a_gone_one_frees_it(
    kube, ledger_url
):
    await kube.add_node("a1", A100)
    before = make(kube, ledger_url, name="ana")
    await before.start()
    state = before.get_state()
    (lease,) = held(ledger_url)

    # The hub restarts: a new spawner object gets the saved state and polls.
    after = make(kube, ledger_url, name="ana")
    after.load_state(state)
    assert await after.poll() is None
    assert [x.id for x in held(ledger_url)] == [lease.id]

    # The pod is deleted behind the hub's back (node drained, kubectl delete ...).
    await kube.admin.delete(f"/api/v1/namespaces/{kube.ns}/pods/{after.pod_name}",
                               {"gracePeriodSeconds": 0})
    await hub_sees_pod_gone(after)
    assert await after.poll() is not None
    assert held(ledger_url) == []
    with Ledger.open(ledger_url) as ledger:
        assert ledger.leases.get(lease.id).release_code == "server_exited"


async def test_stop_returns_once_the_pod_is_gone_and_a_start_right_after_gets_the_slice(
    kube, ledger_url
):
    """The pod Terminates for a while (its container takes 1.5 s to stop) and holds its
    slice meanwhile; another user's form read then sees the slice taken. Once stop
    returns it is free, and the same user's start right after gets it (not the form's
    stale 'all in use')."""
    await kube.add_node("a1", A100)
    slow = {"pod-delete.stage.kwok.x-k8s.io/delay": "1500ms"}
    s = make(kube, ledger_url, profile="large", extra_annotations=slow)
    await s.start()
    stopping = asyncio.ensure_future(s.stop())
    terminating = await kube.admin.watch_object(
        f"/api/v1/namespaces/{kube.ns}/pods/{s.pod_name}",
        lambda p: p is None or p["metadata"].get("deletionTimestamp"))
    assert terminating is not None and not stopping.done()
    assert len(held(ledger_url)) == 1  # released only once the pod is gone
    other = await make(kube, ledger_url, name="ben").render_options_form()
    assert "Unavailable: the only one is in use right now" in other
    await stopping
    assert await kube.pods() == [] and held(ledger_url) == []
    await s.start()
    assert (await created(kube, s.pod_name))["status"]["phase"] == "Running"
    await s.stop()


async def test_a_pod_that_waits_for_a_node_says_why_on_the_progress_page(kube, ledger_url):
    """A pod outside the hub takes the last slice between the check and the pod: the
    pod is Pending, the progress page shows the scheduler's reason, and the pod starts
    when the other one goes."""
    s, starting = await a_pending_spawn(kube, ledger_url)
    messages = await waiting_messages(s, 1)
    # The scheduler counts every node of the cluster (other tests' too).
    assert re.fullmatch(r"Waiting for room in the cluster: 0/\d+ nodes are available: .*"
                        r"1 Insufficient nvidia\.com/mig-3g\.40gb[^.]*\.", messages[-1]), messages
    # Not what the scheduler's PostFilter plugins add (before: "... no new claims to
    # deallocate," was shown).
    assert "preemption" not in messages[-1] and "deallocate" not in messages[-1]
    assert (await created(kube, s.pod_name))["status"]["phase"] == "Pending"
    await kube.admin.delete(f"/api/v1/namespaces/{kube.ns}-batch/pods/batch-train",
                               {"gracePeriodSeconds": 0})
    await asyncio.wait_for(starting, 60)
    assert (await created(kube, s.pod_name))["spec"]["nodeName"] == kube.node_name("a1")
    await s.stop()


async def test_a_forbidden_pod_is_plain_words_to_the_user_and_named_in_the_log(
    kube, ledger_url, caplog, monkeypatch
):
    """The documented Role without 'create' on pods: the real API server's 403."""
    await kube.add_node("a1", A100)
    kubeconfig, url = await kube.account("hub-no-create", drop={"hub": {"create"}})
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    s = make(kube, ledger_url, profile="large", k8s_api_host=url)
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.jupyterhub_message == (
        "The cluster does not let the hub start servers; tell a hub admin.")
    assert info.value.status_code == 500
    assert (f'HTTP 403: pods is forbidden: User "system:serviceaccount:{kube.ns}:'
            f'hub-no-create" cannot create resource "pods"') in caplog.text
    assert held(ledger_url) == []


async def test_a_product_name_too_long_for_a_label_still_gets_its_node(kube, ledger_url):
    """GFD cuts 'NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition-MIG-1g.24gb'
    (67 characters, over the API's 63) to fit; the hub knows the model and selects the
    label the node carries, which the API server accepts."""
    label = "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edi-MIG-1g.24gb"
    await kube.add_node("r1", None, labels={
        "nvidia.com/gpu.product": label, "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.present": "true"}, allocatable={"nvidia.com/gpu": "4"})
    s = make(kube, ledger_url, profile="tiny")
    s.config.MIGPolicyConfig.slice_classes["tiny"] = {
        "display_name": "Tiny", "profiles": {"rtx-pro-6000": "1g.24gb"}}
    s.config.MIGPolicyConfig.group_policies["analysts"]["allowed"].append("tiny")
    await s.start()
    spec = (await created(kube, s.pod_name))["spec"]
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == label
    assert spec["nodeName"] == kube.node_name("r1")
    await s.stop()


async def waiting_messages(s: KubeMIGSpawner, count: int, timeout: float = 60) -> list[str]:
    """The start's progress messages until ``count`` of them say the pod waits."""
    messages: list[str] = []

    async def follow() -> None:
        async for event in s.progress():
            messages.append(event["message"])
            if sum(m.startswith("Waiting for room") for m in messages) >= count:
                return

    await asyncio.wait_for(follow(), timeout)
    return messages


async def a_pending_spawn(kube, ledger_url, labels: dict | None = None, **spawner
                          ) -> tuple[KubeMIGSpawner, asyncio.Future]:
    """A large spawn whose pod waits: a batch job took the A100's 3g.40gb between the
    hub's check and the pod (the progress page says so once). ``labels``: the node's."""
    await kube.add_node("a1", A100, labels=labels)
    batch = await kube.namespace(f"{kube.ns}-batch")

    async def batch_job_takes_the_slice(spawner, pod_manifest):
        await kube.run_pod("batch-train", "a1", {"nvidia.com/mig-3g.40gb": "1"},
                              namespace=batch)
        return pod_manifest

    s = make(kube, ledger_url, profile="large", start_timeout=120,
             modify_pod_hook=batch_job_takes_the_slice, **spawner)
    starting = asyncio.ensure_future(s.start())
    await asyncio.sleep(0)  # one turn of the loop: the start begins
    await waiting_messages(s, 1)
    return s, starting


async def cordon_and_uncordon(kube: KubeTest, short: str) -> None:
    """Makes kube-scheduler try a waiting pod again (a node that becomes schedulable):
    with nothing else changed, it fails the same way."""
    path = f"/api/v1/nodes/{kube.node_name(short)}"
    await kube.admin.patch(path, {"spec": {"unschedulable": True}})
    await kube.admin.patch(path, {"spec": {"unschedulable": False}})


async def repeat_as_the_scheduler_does(kube: KubeTest, pod: str) -> None:
    """What kube-scheduler's event recorder does when the pod fails again the same way
    (client-go tools/events, ``recordToSink``): the Event of the last failure is not
    made again but merge-patched through ``events.k8s.io/v1`` with a higher
    ``series.count`` and its ``lastObservedTime``; a watch sees it MODIFIED.

    Done here rather than waited for: the scheduler says "0/N nodes are available", and
    other tests' nodes come and go, so its next failure is seldom word for word the
    last (it is then a new Event, ADDED)."""
    events = await kube.admin.items(f"/api/v1/namespaces/{kube.ns}/events",
                                    fieldSelector=f"involvedObject.name={pod},"
                                                  "reason=FailedScheduling")
    last = max(events, key=lambda e: e["metadata"]["creationTimestamp"])
    count = max(int((last.get("series") or {}).get("count") or 0), 1) + 1
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    await kube.admin.patch(
        f"/apis/events.k8s.io/v1/namespaces/{kube.ns}/events/{last['metadata']['name']}",
        {"series": {"count": count, "lastObservedTime": now}})


async def test_a_repeated_scheduling_failure_is_said_again(kube, ledger_url):
    """kube-scheduler reports a failure again when it tries the pod again: as a new
    Event, or, when the Event is isomorphic to the last, as one event series (the Event
    updated: MODIFIED, series.count 2). The progress page says the series' repeat too
    (before: only ADDED Events were relayed)."""
    s, starting = await a_pending_spawn(kube, ledger_url)
    await repeat_as_the_scheduler_does(kube, s.pod_name)

    messages: list[str] = []

    async def until_a_repeat() -> None:
        async for event in s.progress():
            messages.append(event["message"])
            if "times)" in event["message"]:
                return

    await asyncio.wait_for(until_a_repeat(), 60)
    waiting = [m for m in messages if m.startswith("Waiting for room")]
    assert re.fullmatch(r".+ \(tried \d+ times\)", waiting[-1]), messages
    assert waiting[-1].split(" (tried")[0] in waiting[:-1]
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await starting
    await s.stop()


async def test_the_scheduling_relay_survives_a_dropped_watch_and_a_compaction(
        kube, ledger_url):
    """The Events watch breaks (a lost connection) while etcd compacts the version it
    had reached (Events have no watch cache: watching from it is 410 Gone). The relay
    watches again from its last version (with bookmarks, which keep it current),
    lists again on 410, and the next failure still reaches the progress page (before:
    the relay ended with its first watch)."""
    s, starting = await a_pending_spawn(kube, ledger_url)

    def event_watches() -> list:
        return [r for r in kube.tap.requests if r.path.endswith("/events")
                and r.query.get("watch", "").lower() == "true"]

    first = event_watches()
    assert first and first[0].query.get("allowWatchBookmarks", "").lower() == "true"
    kube.compact()
    assert any(path.endswith("/events") for path in kube.tap.drop_watches())
    # Watched again (from the version reached, which the compaction usually expired:
    # then a list comes between, as the 410 Gone arrives inside the watch's stream).
    # The relay reads the cut stream to its end before it watches again, so what the
    # page says from here on came through the new watch: the scheduler may have tried
    # the pod again before the cut (a repeat, "tried 2 times"), over the first one.
    await until_async(lambda: len(event_watches()) > len(first), 60,
                      "the Events watched again")
    before = [e["message"] for e in s.progress_log.events]
    await kube.admin.patch(f"/api/v1/nodes/{kube.node_name('a1')}",
                              {"metadata": {"labels": {"pool": "gpu"}}})
    await cordon_and_uncordon(kube, "a1")
    await until_async(lambda: [e["message"] for e in s.progress_log.events[len(before):]
                               if e["message"].startswith("Waiting for room")], 60,
                      "a failure after the cut on the progress page",
                      show=lambda: "\n".join(e["message"] for e in s.progress_log.events))
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await starting
    await s.stop()


async def test_a_missing_service_account_is_said_as_such(kube, ledger_url, caplog):
    """The API server refuses a pod whose service account does not exist (403, from
    its ServiceAccount admission; a new namespace's 'default' comes a moment after
    the namespace). That is not a missing permission of the hub: the user and the log
    say which account is missing."""
    await kube.add_node("a1", A100)
    s = make(kube, ledger_url, profile="large", service_account="notebooks")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.jupyterhub_message == (
        "The cluster lacks the account this server would run as; tell a hub admin.")
    assert (f"error looking up service account {kube.ns}/notebooks: serviceaccount "
            '"notebooks" not found') in caplog.text
    assert held(ledger_url) == []


async def test_the_lease_records_the_node_the_scheduler_chose(kube, ledger_url):
    """kube-scheduler scores equal nodes alike and picks among them at random: the hub
    does not guess; each lease records the node its pod was bound to."""
    for short in ("a1", "a2"):
        await kube.add_node(short, A100)
    spawners = [make(kube, ledger_url, name=n) for n in ("ana", "ben", "cy")]
    for s in spawners:
        await s.start()
    bound = {f"{kube.ns}/{p['metadata']['name']}": p["spec"]["nodeName"]
             for p in await kube.pods()}
    assert {lease.pod: lease.node for lease in held(ledger_url)} == bound
    assert set(bound.values()) <= {kube.node_name("a1"), kube.node_name("a2")}
    for s in spawners:
        await s.stop()


@pytest.mark.parametrize("resource_api", ["device-plugin", "dra"])
async def test_the_api_server_finds_no_unknown_field_in_what_a_spawn_sends(
        kube, ledger_url, resource_api):
    """The API server takes a field it does not know with a warning and drops it (field
    validation ``Warn``, its default for a client that does not ask): a typo in the pod
    or the claim template would pass unnoticed and the slice be lost. Every write of a
    start and a stop, the pod and the DRA claim template included, comes back without
    a warning."""
    dra = resource_api == "dra"
    await kube.add_node("n1", Gpus((Gpu("h200", {"1g.18gb": 2}, "dra"),)) if dra else A100)
    s = make(kube, ledger_url, mig_resource_api=resource_api)
    kube.tap.reset()
    await s.start()
    await s.stop()
    writes = [r for r in kube.tap.requests if r.method in ("POST", "PUT", "PATCH")]
    made = {r.path.rsplit("/", 1)[-1] for r in writes if r.method == "POST"}
    assert {"pods", *(["resourceclaimtemplates"] if dra else [])} <= made
    assert [(r.method, r.path, r.warnings) for r in kube.tap.requests if r.warnings] == []
