"""The environment a server gets for its slice: what CUDA, containers and the user read."""

from __future__ import annotations

from mig_spawner.ledger import Lease


def lease_environment(lease: Lease) -> dict[str, str]:
    """What every backend tells the server about its lease: the profile and the lease id."""
    return {"MIG_SPAWNER_PROFILE": lease.profile, "MIG_SPAWNER_LEASE_ID": lease.id}


def slice_environment(lease: Lease) -> dict[str, str]:
    """Environment variables that point CUDA, containers and the user at a local slice."""
    uuid = lease.mig_uuid or ""
    visible = uuid if uuid.startswith("MIG-") else f"MIG-{uuid}"
    return {
        "CUDA_VISIBLE_DEVICES": visible,
        "NVIDIA_VISIBLE_DEVICES": visible,
        **lease_environment(lease),
        "MIG_SPAWNER_GPU_INDEX": str(lease.gpu_index),
        "MIG_SPAWNER_GPU_UUID": lease.gpu_uuid or "",
        "MIG_SPAWNER_GI_ID": str(lease.gi_id),
        "MIG_SPAWNER_CI_ID": str(lease.ci_id),
    }
