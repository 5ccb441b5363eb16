"""``python -m mig_spawner.kube``: what the hub will see of the cluster's MIG slices.

Run it inside the hub pod (``kubectl exec deploy/hub -- python -m mig_spawner.kube``)
to check, with the hub's own service account, that it may list nodes and pods and
that every GPU node is offered: it prints free slices per GPU model and node, and each
GPU node left out with the reason. Exit status 1 when the API cannot be read, 2 when
no GPU node is offered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .availability import ClusterAvailability, ClusterReadError
from .cluster import ClusterSlices


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
    for s in slices.skipped:
        print(f"{s.name:<24} not offered: {s.reason}")
    for key, per_profile in sorted(slices.free().items()):
        counts = ", ".join(f"{p}: {c}" for p, c in sorted(per_profile.items()))
        print(f"free on {key}: {counts}")


async def _run(args: argparse.Namespace) -> int:
    from kubernetes_asyncio import client

    await _load_config(args.kubeconfig)
    async with client.ApiClient() as api_client:
        availability = ClusterAvailability(
            client.CoreV1Api(api_client), strategy=args.strategy,
            node_selector=args.node_selector,
        )
        try:
            slices = await availability.slices()
        except ClusterReadError as e:
            print(f"error: {e}", file=sys.stderr)
            if e.hint:
                print(f"hint: {e.hint}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(_as_dict(slices), indent=2, sort_keys=True))
    else:
        _print_table(slices)
    if not slices.nodes:
        print("no GPU node offers MIG slices", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_run(_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
