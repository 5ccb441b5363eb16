"""Slice requests for NVIDIA's device plugin, checked in KubeSpawner's real pod manifest."""

from __future__ import annotations

import copy

import pytest
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner

from mig_spawner.kube import (
    KubeConfigError,
    apply_to_pod,
    check_kube_profiles,
    check_toleration,
    mig_resource,
    model_for_label,
    parse_product_label,
    single_product_label,
    slice_request,
)

GPU_TAINT_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    """KubeSpawner loads a kubeconfig when it is built (no cluster is needed to build
    manifests). kubernetes_asyncio reads $KUBECONFIG at import, so point its default
    location at ours, as its own tests do."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: none\n"
        "clusters: [{name: none, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: hub, user: {token: t}}]\n"
        "contexts: [{name: none, context: {cluster: none, user: hub}}]\n")
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return str(path)


async def manifest_json(pod) -> dict:
    """The pod as the API server would receive it (KubeSpawner posts it this way)."""
    async with ApiClient() as client:
        return client.sanitize_for_serialization(pod)


# --- composing requests --------------------------------------------------------------


def test_mixed_strategy_asks_for_the_profile_resource():
    request = slice_request("MIG 3G.71GB", "mixed", tolerations=[GPU_TAINT_TOLERATION])
    assert request.resource == "nvidia.com/mig-3g.71gb"
    assert request.resources == {"nvidia.com/mig-3g.71gb": "1"}
    assert request.node_selector == {}
    assert request.tolerations == (GPU_TAINT_TOLERATION,)


def test_single_strategy_asks_for_a_gpu_on_a_node_labelled_with_the_profile():
    request = slice_request("1g.18gb", "single", product="NVIDIA H200")
    assert request.resources == {"nvidia.com/gpu": "1"}
    assert request.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200-MIG-1g.18gb"}


def test_single_strategy_without_a_product_says_what_to_set():
    with pytest.raises(KubeConfigError, match="mig_product"):
        slice_request("1g.18gb", "single")


def test_unknown_strategy_is_refused_with_the_choices():
    with pytest.raises(KubeConfigError, match="mixed, single"):
        slice_request("1g.18gb", "none")


def test_configured_selector_and_tolerations_are_copied_not_shared():
    selector = {"hub.jupyter.org/node-purpose": "user"}
    tolerations = [dict(GPU_TAINT_TOLERATION)]
    request = slice_request("1g.18gb", "single", product="NVIDIA-H200",
                            node_selector=selector, tolerations=tolerations)
    assert selector == {"hub.jupyter.org/node-purpose": "user"}
    assert request.node_selector is not selector
    assert request.tolerations[0] is not tolerations[0]


@pytest.mark.parametrize(
    "label, product, profile, shared",
    [
        ("NVIDIA-H200", "NVIDIA-H200", None, False),
        ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "NVIDIA-A100-SXM4-80GB", "1g.10gb", False),
        ("A100-SXM4-40GB-MIG-1g.5gb-SHARED", "A100-SXM4-40GB", "1g.5gb", True),
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb+me", "NVIDIA-H100-80GB-HBM3", "1g.10gb+me", False),
    ],
)
def test_product_labels_parse(label, product, profile, shared):
    parsed = parse_product_label(label)
    assert (parsed.product, parsed.profile, parsed.shared) == (product, profile, shared)


@pytest.mark.parametrize(
    "label, key",
    [
        ("NVIDIA-H200", "h200"),
        ("NVIDIA-A100-SXM4-80GB-MIG-3g.40gb", "a100-80gb"),
        ("A100-SXM4-40GB", "a100-40gb"),  # drivers before R470 had no NVIDIA prefix
        ("NVIDIA-A100-80GB-PCIe", "a100-80gb"),
        ("NVIDIA-H100-80GB-HBM3", "h100"),
        ("Tesla-T4", None),
    ],
)
def test_product_labels_map_to_catalog_models(label, key):
    found = model_for_label(label)
    assert (found.key if found else None) == key


def test_admin_can_map_an_unknown_product_label():
    assert model_for_label("NVIDIA-H200-SXM-141GB") is None
    assert model_for_label("NVIDIA-H200-SXM-141GB", {"NVIDIA-H200-SXM-141GB": "h200"}).key == "h200"


def test_single_label_from_nvml_name_or_label():
    assert single_product_label("NVIDIA A100-SXM4-40GB", "1g.5gb") == (
        "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    )
    assert single_product_label("NVIDIA-H200-MIG-1g.18gb", "2g.35gb") == "NVIDIA-H200-MIG-2g.35gb"
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb+me"


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"key": "a", "operater": "Exists"}, "unknown field"),
        ({"key": "a", "operator": "Maybe"}, "'Equal' or 'Exists'"),
        ({"key": "a", "operator": "Exists", "value": "x"}, "takes no value"),
        ({"operator": "Equal", "value": "x"}, "needs a key"),
        ({"key": "a", "effect": "NoRun"}, "NoSchedule"),
    ],
)
def test_bad_tolerations_are_explained(bad, words):
    with pytest.raises(KubeConfigError, match=words):
        check_toleration(bad)


# --- through KubeSpawner's real get_pod_manifest() ------------------------------------


def spawner(**config) -> KubeSpawner:
    return KubeSpawner(_mock=True, **config)


async def test_mixed_manifest_has_exact_request_limit_and_toleration(kubeconfig):
    s = spawner(cpu_limit=2.0, mem_limit="8G",
                extra_resource_limits={"example.com/fpga": "1"})
    pod = apply_to_pod(
        await s.get_pod_manifest(),
        slice_request("3g.71gb", "mixed", tolerations=[GPU_TAINT_TOLERATION]),
    )
    spec = (await manifest_json(pod))["spec"]
    notebook = next(c for c in spec["containers"] if c["name"] == "notebook")
    assert notebook["resources"]["requests"] == {"nvidia.com/mig-3g.71gb": "1"}
    assert notebook["resources"]["limits"] == {
        "cpu": 2.0, "memory": 8 * 1024**3, "example.com/fpga": "1", "nvidia.com/mig-3g.71gb": "1",
    }
    assert spec["tolerations"] == [GPU_TAINT_TOLERATION]
    assert "nodeSelector" not in spec


async def test_single_manifest_selects_the_product_node(kubeconfig):
    s = spawner(node_selector={"hub.jupyter.org/node-purpose": "user"})
    pod = apply_to_pod(
        await s.get_pod_manifest(),
        slice_request("1g.10gb", "single", product="NVIDIA-A100-SXM4-80GB"),
    )
    spec = (await manifest_json(pod))["spec"]
    notebook = spec["containers"][0]
    assert notebook["resources"]["requests"] == {"nvidia.com/gpu": "1"}
    assert notebook["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert spec["nodeSelector"] == {
        "hub.jupyter.org/node-purpose": "user",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
    }


async def test_product_pinning_is_added_to_every_configured_affinity_term(kubeconfig):
    zone = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    ssd = {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
    s = spawner(node_affinity_required=[zone, ssd])
    before = copy.deepcopy(s.node_affinity_required)
    request = slice_request("1g.10gb", "mixed", products=["NVIDIA-H100-80GB-HBM3"])
    pod = apply_to_pod(await s.get_pod_manifest(), request)
    terms = (await manifest_json(pod))["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    pin = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    assert terms == [
        {"matchExpressions": [*zone["matchExpressions"], pin]},
        {"matchExpressions": [*ssd["matchExpressions"], pin]},
    ]
    assert s.node_affinity_required == before


async def test_cpu_spawn_after_gpu_spawn_carries_nothing_of_the_gpu(kubeconfig):
    """KubeSpawner puts its own node_selector dict into the manifest; writing the slice
    into it in place would leave the GPU selector in the next, CPU-only, spawn."""
    s = spawner(
        node_selector={"hub.jupyter.org/node-purpose": "user"},
        tolerations=[{"key": "hub.jupyter.org/dedicated", "operator": "Equal",
                      "value": "user", "effect": "NoSchedule"}],
        extra_resource_limits={"example.com/fpga": "1"},
    )
    cpu_before = await manifest_json(await s.get_pod_manifest())
    gpu = await manifest_json(apply_to_pod(
        await s.get_pod_manifest(),
        slice_request("1g.18gb", "single", product="NVIDIA-H200",
                      tolerations=[GPU_TAINT_TOLERATION], products=[]),
    ))
    assert gpu["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200-MIG-1g.18gb"
    cpu_after = await manifest_json(await s.get_pod_manifest())

    assert cpu_after == cpu_before
    notebook = cpu_after["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in notebook["resources"]["limits"]
    assert "nvidia.com/gpu" not in notebook["resources"].get("requests", {})
    assert cpu_after["spec"]["nodeSelector"] == {"hub.jupyter.org/node-purpose": "user"}
    assert GPU_TAINT_TOLERATION not in cpu_after["spec"]["tolerations"]
    assert s.node_selector == {"hub.jupyter.org/node-purpose": "user"}
    assert s.extra_resource_limits == {"example.com/fpga": "1"}


# --- +me and the other variants: what the device plugin publishes ---------------------------


@pytest.mark.parametrize("profile", ["1g.18gb+me", "1g.24gb+me.all", "1g.24gb-me", "2g.48gb+gfx"])
@pytest.mark.parametrize("strategy", ["mixed", "single"])
def test_variant_profiles_are_refused_saying_why(profile, strategy):
    with pytest.raises(KubeConfigError) as exc:
        slice_request(profile, strategy, product="NVIDIA-H200")
    message = str(exc.value)
    plain = profile.split("+")[0].removesuffix("-me")
    assert f"{profile} cannot be requested on Kubernetes" in message
    assert f"nvidia.com/mig-{plain}" in message and f"Offer {plain} instead" in message


def test_plain_profiles_pass_the_kubernetes_check():
    check_kube_profiles(["1g.18gb", "3g.71gb", "7g.141gb"])
    assert slice_request("1g.18gb", "mixed").resource == "nvidia.com/mig-1g.18gb"


def test_kubernetes_hub_refuses_to_start_with_a_variant_profile():
    from traitlets.config import Config

    from mig_spawner.spawner.startup import check_hub_config

    config = Config()
    config.JupyterHub.spawner_class = "mig-kube"
    config.MIGPolicyConfig.group_policies = {
        "video": {"allowed": ["1g.18gb+me", "2g.35gb"]}}
    with pytest.raises(SystemExit) as exc:
        check_hub_config(config)
    assert "1g.18gb+me cannot be requested on Kubernetes" in str(exc.value)
    assert "2g.35gb" not in str(exc.value).split("cannot")[0]
    config.MIGPolicyConfig.group_policies = {"video": {"allowed": ["2g.35gb"]}}
    check_hub_config(config)
