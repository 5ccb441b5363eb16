"""KubeMIGSpawner end to end against the stand-in API server: KubeSpawner's real start
and stop, pods scheduled by the stand-in's scheduler, leases in a real ledger."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from jupyterhub.spawner import SpawnException
from traitlets import TraitError

from mig_spawner.ledger import Ledger
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.mocking import h200_single
from tests.support.kube_objects import gpu_labels, node, pod
from tests.support.polling import until_async
from tests.support.spawners import a100_node, created, held, kube_spawner, make_spawner

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE_GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


async def hub_sees_pod_gone(s: KubeMIGSpawner) -> None:
    """Until KubeSpawner's pod reflector no longer has the spawner's pod."""
    await until_async(lambda: s.pod_reflector.pods.get(s.pod_ref) is None, 30,
                      f"the reflector without {s.pod_ref}", every=0.05)


async def test_start_asks_for_the_slice_and_the_lease_records_pod_and_node(kube, ledger_url):
    kube.nodes = [a100_node("gpu-a1", taints=[GPU_TAINT])]
    s = kube_spawner(kube, ledger_url, profile="large", mig_tolerations=[TOLERATE_GPU],
                     environment={"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0",
                                  "TEAM": "analytics"})
    url = await s.start()
    assert url.startswith("http://10.244.0.")

    spec = created(kube, s.pod_name)["spec"]
    notebook = spec["containers"][0]
    assert notebook["resources"]["requests"]["nvidia.com/mig-3g.40gb"] == "1"
    assert notebook["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == "1"
    assert TOLERATE_GPU in spec["tolerations"]
    assert spec["nodeName"] == "gpu-a1"
    env = {e["name"]: e.get("value") for e in notebook["env"]}
    assert env["MIG_SPAWNER_PROFILE"] == "3g.40gb"
    # The device plugin picks the device; a config that names devices is not passed on.
    assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["TEAM"] == "analytics"

    (lease,) = held(ledger_url)
    assert (lease.mode, lease.profile, lease.state) == ("kube", "3g.40gb", "active")
    assert (lease.pod, lease.node) == (f"jupyterhub/{s.pod_name}", "gpu-a1")
    assert s.get_state()["mig_lease_id"] == lease.id

    await s.stop()
    assert kube.pods == []
    assert held(ledger_url) == []


async def test_single_strategy_pod_selects_the_mig_product_node(kube, ledger_url):
    kube.nodes = [h200_single("gpu-h1", slices=2)]
    s = kube_spawner(kube, ledger_url, profile="small",
                     mig_node_selector={"pool": "gpu"})
    kube.nodes[0]["metadata"]["labels"]["pool"] = "gpu"
    await s.start()
    spec = created(kube, s.pod_name)["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] == {"pool": "gpu",
                                    "nvidia.com/gpu.product": "NVIDIA-H200-MIG-1g.18gb"}
    await s.stop()


async def test_mixed_fleet_class_goes_to_the_model_with_room(kube, ledger_url):
    """'small' means 1g.10gb on A100 and 1g.18gb on H200: each spawn goes where most are
    free (ties: model key order), and the pod is pinned to that model's nodes."""
    kube.nodes = [a100_node("gpu-a1"), h200_single("gpu-h1", slices=1)]
    spawners = [kube_spawner(kube, ledger_url, name=n) for n in ("ana", "ben", "cy")]
    for s in spawners:
        await s.start()
    placed = {p["metadata"]["name"]: (p["spec"]["nodeName"],
                                       p["spec"]["containers"][0]["resources"]["limits"])
              for p in kube.pods}
    assert placed == {
        "jupyter-ana": ("gpu-a1", {"nvidia.com/mig-1g.10gb": "1"}),
        "jupyter-ben": ("gpu-a1", {"nvidia.com/mig-1g.10gb": "1"}),
        "jupyter-cy": ("gpu-h1", {"nvidia.com/gpu": "1"}),
    }
    terms = created(kube, "jupyter-ana")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                            "values": ["NVIDIA-A100-SXM4-80GB"]}]}]
    assert sorted((lease.user, lease.profile, lease.node) for lease in held(ledger_url)) == [
        ("ana", "1g.10gb", "gpu-a1"), ("ben", "1g.10gb", "gpu-a1"), ("cy", "1g.18gb", "gpu-h1"),
    ]
    for s in spawners:
        await s.stop()


async def test_a_whole_gpu_pod_asks_for_nvidia_com_gpu_on_a_mixed_strategy_node(
        kube, ledger_url):
    """Mixed strategy advertises a node's GPUs with MIG off as nvidia.com/gpu beside its
    MIG slices: the whole-GPU offer asks for one of those, pinned to the model's nodes,
    and is charged the model's compute slices."""
    kube.nodes = [node("gpu-a1", gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed"),
                       {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/gpu": "1"})]
    allowed = ("small", "gpu")
    whole = kube_spawner(kube, ledger_url, profile="gpu", allowed=allowed)
    assert "A whole GPU" in await whole.render_options_form()
    await whole.start()
    spec = created(kube, whole.pod_name)["spec"]
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert spec["nodeName"] == "gpu-a1"
    small = kube_spawner(kube, ledger_url, name="ben", allowed=allowed)
    await small.start()
    assert created(kube, small.pod_name)["spec"]["containers"][0]["resources"][
        "limits"] == {"nvidia.com/mig-1g.10gb": "1"}
    assert sorted((lease.user, lease.mode, lease.profile, lease.compute_slices)
                  for lease in held(ledger_url)) == [("ana", "kube", "gpu", 7),
                                                     ("ben", "kube", "1g.10gb", 1)]
    with pytest.raises(SpawnException, match="slices of the cluster are in use"):
        await kube_spawner(kube, ledger_url, name="cy", profile="gpu", allowed=allowed).start()
    for s in (whole, small):
        await s.stop()


async def test_full_cluster_refuses_with_reason_and_keeps_no_lease(kube, ledger_url):
    kube.nodes = [a100_node("gpu-a1")]
    kube.pods = [pod("batch-train", "gpu-a1", {"nvidia.com/mig-3g.40gb": "1"},
                     namespace="batch")]
    s = kube_spawner(kube, ledger_url, profile="large")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.status_code == 503
    assert "All 'Large' slices of the cluster are in use" in str(info.value)
    assert held(ledger_url) == []
    with Ledger.open(ledger_url) as ledger:
        # Written on one of the worker threads without waiting: it comes, soon.
        await until_async(ledger.refusals, 10, "the refusal recorded")
        assert [(r.user, r.offer, r.profile, r.reason, r.group) for r in ledger.refusals()] == [
            ("ana", "large", "3g.40gb", "none_free", "analysts")]
    assert [p["metadata"]["name"] for p in kube.pods] == ["batch-train"]


async def test_node_being_reconfigured_is_not_offered_and_the_refusal_says_so(
    kube, ledger_url
):
    kube.nodes = [a100_node("gpu-a1", state="pending")]
    s = kube_spawner(kube, ledger_url, profile="large")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert "gpu-a1: MIG Manager is applying a layout" in str(info.value)
    form = await s.render_options_form()
    assert "free now" not in form
    assert "no GPU in the cluster has this size" in form
    assert held(ledger_url) == []


async def test_form_shows_cluster_free_counts_from_one_cached_read(kube, ledger_url):
    kube.nodes = [a100_node("gpu-a1"), h200_single("gpu-h1", slices=3)]
    kube.pods = [pod("other", "gpu-h1", {"nvidia.com/gpu": "1"}, namespace="x")]
    forms = [await kube_spawner(kube, ledger_url, name=f"u{i}").render_options_form()
             for i in range(5)]
    assert "4 free now" in forms[0]  # small: 2 A100 1g.10gb + 2 H200 1g.18gb
    assert "1 free now" in forms[0]  # large: the A100's 3g.40gb
    assert len(set(forms)) == 1
    assert kube.list_hits() == 2  # five users, one Node list and one Pod list


async def test_form_counts_a_profile_that_two_models_share_once(kube, ledger_url):
    """'small' is 1g.10gb on the A100 80GB and on the H100: 2 + 3 free, not 5 per model."""
    h100 = node("gpu-h1", gpu_labels("NVIDIA-H100-80GB-HBM3", "mixed"),
                {"nvidia.com/mig-1g.10gb": "3"})
    kube.nodes = [a100_node("gpu-a1"), h100]
    form = await kube_spawner(kube, ledger_url).render_options_form()
    assert "5 free now" in form and "10 free now" not in form


async def test_form_says_why_when_the_cluster_cannot_be_read(kube, ledger_url):
    kube.fail_with = (403, 'nodes is forbidden: User "system:serviceaccount:jhub:hub" '
                              'cannot list resource "nodes"')
    form = await kube_spawner(kube, ledger_url).render_options_form()
    assert "The cluster&#39;s GPU nodes cannot be read right now. Try again" in form
    # The API server's words name accounts and resources: for the hub log only.
    assert "serviceaccount" not in form and "free now" not in form
    assert form.count(" disabled>") == 2  # small and large, neither selectable
    assert "button.disabled = true" in form  # nor Start


async def test_quota_is_checked_in_the_ledger_before_the_cluster(kube, ledger_url):
    kube.nodes = [a100_node("gpu-a1")]
    first = kube_spawner(kube, ledger_url, server="one")
    await first.start()
    second = kube_spawner(kube, ledger_url, server="two")
    with pytest.raises(SpawnException) as info:
        await second.start()
    assert info.value.status_code == 409
    assert "you already hold 1 of 1" in str(info.value)
    assert len(kube.pods) == 1
    await first.stop()


async def test_unschedulable_pod_gives_its_slice_back(kube, ledger_url):
    """The cluster looked free but the pod cannot be placed (here: a configured node
    selector no node has): the start times out and the lease is released."""
    kube.nodes = [a100_node("gpu-a1")]
    s = kube_spawner(kube, ledger_url, profile="large", mig_node_selector={"pool": "none"},
                     start_timeout=2)
    with pytest.raises(TimeoutError):
        await s.start()
    assert held(ledger_url) == []


async def test_manifest_without_a_lease_has_no_gpu(kube, ledger_url):
    kube.nodes = [a100_node("gpu-a1")]
    s = kube_spawner(kube, ledger_url, profile="large", mig_tolerations=[TOLERATE_GPU],
                     mig_node_selector={"pool": "gpu"})
    kube.nodes[0]["metadata"]["labels"]["pool"] = "gpu"
    await s.start()
    await s.stop()
    pod_after = await s.get_pod_manifest()
    resources = pod_after.spec.containers[0].resources
    assert not any(k.startswith("nvidia.com/") for k in {**(resources.limits or {}),
                                                         **(resources.requests or {})})
    assert not pod_after.spec.node_selector
    assert not pod_after.spec.tolerations
    assert s.node_selector == {} and s.tolerations == []


def test_bad_settings_are_refused_at_config_time(tmp_path):
    with pytest.raises(TraitError, match="unknown GPU model 'h300'"):
        KubeMIGSpawner.class_traits()["mig_product_models"]
        KubeMIGSpawner(_mock=True, mig_product_models={"X": "h300"})
    with pytest.raises(TraitError, match="'Equal' or 'Exists'"):
        KubeMIGSpawner(_mock=True, mig_tolerations=[{"key": "a", "operator": "Is"}])


async def test_shipped_example_config_builds_a_working_spawner(kube, ledger_url):
    """jupyterhub_config.d/examples/kube.py with the shipped group policies."""
    from traitlets.utils.importstring import import_item

    from mig_spawner.config import load_config_files

    shipped = Path(__file__).resolve().parents[1] / "jupyterhub_config.d"
    c = load_config_files([shipped / "20-groups.py", shipped / "examples" / "kube.py"])
    assert import_item(c.JupyterHub.spawner_class) is KubeMIGSpawner
    c.MIGSettings.ledger_url = ledger_url
    c.KubeMIGSpawner.k8s_api_host = kube.url
    s = make_spawner(c, cls=KubeMIGSpawner)
    kube.nodes = [h200_single("gpu-h1", slices=2, taints=[GPU_TAINT])]
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
    kube.nodes = [a100_node("gpu-a1")]
    before = kube_spawner(kube, ledger_url, name="ana")
    await before.start()
    state = before.get_state()
    (lease,) = held(ledger_url)

    # The hub restarts: a new spawner object gets the saved state and polls.
    after = kube_spawner(kube, ledger_url, name="ana")
    after.load_state(state)
    assert await after.poll() is None
    assert [x.id for x in held(ledger_url)] == [lease.id]

    # The pod is deleted behind the hub's back (node drained, kubectl delete ...).
    kube.delete_pod("jupyterhub", after.pod_name)
    await hub_sees_pod_gone(after)
    assert await after.poll() is not None
    assert held(ledger_url) == []
    with Ledger.open(ledger_url) as ledger:
        assert ledger.get(lease.id).release_code == "server_exited"



async def test_stop_returns_once_the_pod_is_gone_and_a_start_right_after_gets_the_slice(
    kube, ledger_url
):
    """The pod Terminates for a while and holds its slice meanwhile; another user's form
    read then sees the slice taken. Once stop returns it is free, and the same user's
    start right after gets it (not the form's stale 'all in use')."""
    kube.nodes = [a100_node("gpu-a1")]
    kube.shutdown_seconds = 0.5
    s = kube_spawner(kube, ledger_url, profile="large")
    await s.start()
    stopping = asyncio.ensure_future(s.stop())
    await until_async(lambda: created(kube, s.pod_name)["metadata"].get("deletionTimestamp"),
                      10, "the pod terminating")
    assert len(held(ledger_url)) == 1  # released only once the pod is gone
    other = await kube_spawner(kube, ledger_url, name="ben").render_options_form()
    assert "Unavailable: the only large slice is in use right now" in other
    await stopping
    assert kube.pods == [] and held(ledger_url) == []
    await s.start()
    assert created(kube, s.pod_name)["status"]["phase"] == "Running"
    await s.stop()


async def test_a_pod_that_waits_for_a_node_says_why_on_the_progress_page(kube, ledger_url):
    """A pod outside the hub takes the last slice between the check and the pod: the
    pod is Pending, the progress page shows the scheduler's reason, and the pod starts
    when the other one goes."""
    kube.nodes = [a100_node("gpu-a1")]

    def batch_job_takes_the_slice(spawner, pod_manifest):
        kube.pods.append(pod("batch-train", "gpu-a1", {"nvidia.com/mig-3g.40gb": "1"},
                             namespace="batch"))
        return pod_manifest

    s = kube_spawner(kube, ledger_url, profile="large", modify_pod_hook=batch_job_takes_the_slice)
    starting = asyncio.ensure_future(s.start())
    await asyncio.sleep(0)  # JupyterHub reads the progress of a start under way

    async def until_waiting() -> list[str]:
        messages = []
        async for event in s.progress():
            messages.append(event["message"])
            if messages[-1].startswith("Waiting for room"):
                break
        return messages

    messages = await asyncio.wait_for(until_waiting(), 10)
    assert messages[-1] == ("Waiting for room in the cluster: 0/1 nodes are available: "
                            "1 Insufficient nvidia.com/mig-3g.40gb.")
    assert created(kube, s.pod_name)["status"]["phase"] == "Pending"
    kube.delete_pod("batch", "batch-train")
    await starting
    assert created(kube, s.pod_name)["spec"]["nodeName"] == "gpu-a1"
    await s.stop()


async def test_a_forbidden_pod_is_plain_words_to_the_user_and_named_in_the_log(
    kube, ledger_url, caplog
):
    kube.nodes = [a100_node("gpu-a1")]
    kube.rbac = [replace(r, verbs=r.verbs - {"create"}) if r.namespace else r
                 for r in kube.rbac]
    s = kube_spawner(kube, ledger_url, profile="large")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.jupyterhub_message == (
        "The cluster does not let the hub start servers; tell a hub admin.")
    assert info.value.status_code == 500
    assert 'HTTP 403: pods is forbidden: User "system:serviceaccount:jhub:hub" cannot create ' \
        'resource "pods"' in caplog.text
    assert held(ledger_url) == []


async def test_a_product_name_too_long_for_a_label_still_gets_its_node(kube, ledger_url):
    """GFD cuts 'NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition-MIG-1g.24gb'
    (67 characters, over the API's 63) to fit; the hub knows the model and selects the
    label the node carries, which admission accepts."""
    label = "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edi-MIG-1g.24gb"
    kube.nodes = [node("gpu-r1", gpu_labels(label, "single"), {"nvidia.com/gpu": "4"})]
    s = kube_spawner(kube, ledger_url, profile="tiny")
    s.config.MIGPolicyConfig.slice_classes["tiny"] = {
        "display_name": "Tiny", "profiles": {"rtx-pro-6000": "1g.24gb"}}
    s.config.MIGPolicyConfig.group_policies["analysts"]["allowed"].append("tiny")
    await s.start()
    spec = created(kube, s.pod_name)["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": label}
    assert spec["nodeName"] == "gpu-r1"
    await s.stop()


async def test_after_an_expired_watch_the_hub_lists_again_and_sees_what_happened(
    kube, ledger_url
):
    """The API server compacted its history: the pod watch ends with 410 Gone, and
    KubeSpawner's reflector lists again, so a pod deleted meanwhile is noticed."""
    kube.nodes = [a100_node("gpu-a1")]
    s = kube_spawner(kube, ledger_url)
    await s.start()
    lists = kube.hits["/api/v1/namespaces/jupyterhub/pods"]
    kube.expire_watches()
    kube.delete_pod("jupyterhub", s.pod_name)
    await hub_sees_pod_gone(s)
    assert await s.poll() is not None
    assert kube.hits["/api/v1/namespaces/jupyterhub/pods"] > lists
    assert held(ledger_url) == []
