"""``python -m mig_spawner.kube``: what the hub will see of the cluster's MIG slices.

Run it inside the hub pod (``kubectl exec deploy/hub -- python -m mig_spawner.kube``)
to check, with the hub's own service account, that it may list nodes and pods and
that every GPU node is offered: it prints free slices per GPU model and node, and each
GPU node left out with the reason, and how the cluster hands out MIG devices (NVIDIA's
device plugin or its DRA driver) next to the hub setting for it. Exit status 1 when the
API cannot be read, 2 when no GPU node is offered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .availability import ClusterAvailability, ClusterReadError, _list_all
from .cluster import ClusterSlices, unhealthy_words
from .dra import DEVICE_CLASS, DRIVER, served_by

#: What each way of handing out MIG devices is called, and the hub setting for it.
SERVED = {
    "dra": f"DRA (driver {DRIVER}, DeviceClass {DEVICE_CLASS}): "
           'c.KubeMIGSpawner.mig_resource_api = "dra"',
    "device-plugin": "NVIDIA's device plugin (node allocatable): "
                     'c.KubeMIGSpawner.mig_resource_api = "device-plugin" (the default)',
    "none": "nothing: no node advertises MIG devices and no DRA driver publishes any",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mig_spawner.kube",
        description="Show the MIG slices of the cluster as mig-spawner's KubeMIGSpawner "
        "sees them (in-cluster service account, else the kubeconfig).",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                        "$KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--strategy", choices=["mixed", "single"],
                        help="force the device plugin MIG strategy (default: node labels)")
    parser.add_argument("--node-selector", default="",
                        help="label selector for the nodes to read, e.g. "
                        "nvidia.com/gpu.present=true")
    parser.add_argument("--resource-api", choices=["device-plugin", "dra"],
                        default="device-plugin",
                        help="how the hub reads free slices (KubeMIGSpawner.mig_resource_api)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


async def _load_config(kubeconfig: str | None) -> None:
    from kubernetes_asyncio import config

    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return
        except config.ConfigException:
            pass
    await config.load_kube_config(config_file=kubeconfig)


def _as_dict(slices: ClusterSlices) -> dict[str, Any]:
    return {
        "free": slices.free(),
        "nodes": [
            {
                "name": n.name,
                "model": n.model_key,
                "product": n.product_label,
                "strategy": n.strategy,
                "allocatable": dict(n.allocatable),
                "used": dict(n.used),
                "unhealthy": dict(n.unhealthy),
            }
            for n in slices.nodes
        ],
        "skipped": [{"name": s.name, "reason": s.reason} for s in slices.skipped],
    }


def _print_table(slices: ClusterSlices) -> None:
    print(f"{'node':<24} {'model':<10} {'strategy':<8} {'profile':<12} {'free':>5} {'of':>4}")
    for n in slices.nodes:
        for profile, total in sorted(n.allocatable.items()):
            print(f"{n.name:<24} {n.model_key:<10} {n.strategy:<8} {profile:<12} "
                  f"{n.free(profile):>5} {total:>4}")
        if n.unhealthy:
            print(f"{n.name:<24} reported unhealthy: {unhealthy_words(n)}")
    for s in slices.skipped:
        print(f"{s.name:<24} not offered: {s.reason}")
    for key, per_profile in sorted(slices.free().items()):
        counts = ", ".join(f"{p}: {c}" for p, c in sorted(per_profile.items()))
        print(f"free on {key}: {counts}")


async def served(core: Any, resource: Any, node_selector: str = "") -> str:
    """How the cluster hands out MIG devices to the nodes ``node_selector`` selects
    (:func:`~mig_spawner.kube.dra.served_by`); a cluster without the
    ``resource.k8s.io/v1`` API (or without RBAC for it) has no DRA."""
    try:
        slices = await _list_all(resource.list_resource_slice, "resourceslices")
    except ClusterReadError:
        slices = []
    selector = {"label_selector": node_selector} if node_selector else {}
    return served_by(await _list_all(core.list_node, "nodes", **selector), slices)


async def _run(args: argparse.Namespace) -> int:
    from kubernetes_asyncio import client

    await _load_config(args.kubeconfig)
    async with client.ApiClient() as api_client:
        core, resource = client.CoreV1Api(api_client), client.ResourceV1Api(api_client)
        availability = ClusterAvailability(
            core, strategy=args.strategy, node_selector=args.node_selector,
            resource_api=resource if args.resource_api == "dra" else None,
        )
        try:
            slices = await availability.slices()
            found = await served(core, resource, args.node_selector)
        except ClusterReadError as e:
            print(f"error: {e}", file=sys.stderr)
            if e.hint:
                print(f"hint: {e.hint}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({**_as_dict(slices), "served_by": found}, indent=2,
                         sort_keys=True))
    else:
        print(f"MIG through: {SERVED[found]}")
        _print_table(slices)
    if found not in ("none", args.resource_api):
        print(f"the cluster serves MIG through {found}, but --resource-api is "
              f"{args.resource_api}", file=sys.stderr)
    if not slices.nodes:
        print("no GPU node offers MIG slices", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_run(_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
