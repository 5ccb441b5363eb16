"""Grants for ledger tests without an allocator: a tiny first-fit over two GPUs of one
host, as a decide callback (``ledger.leases.claim(request, first_free)``)."""

from __future__ import annotations

from datetime import timedelta

from mig_spawner.ledger import Grant, LedgerView

HOST = "gpu-host-1"
GPUS = ("GPU-aaaa", "GPU-bbbb")


class NoFreeSlot(Exception):
    """Stands for the allocator's refusal."""


def first_free(view: LedgerView, size: int = 1, mode: str = "dynamic") -> Grant:
    """A tiny allocator: first GPU/start where ``size`` memory slices (of 7) are free."""
    for index, gpu in enumerate(GPUS):
        taken = view.taken(HOST, gpu)
        for start in range(0, 8 - size, size):
            if taken.isdisjoint(range(start, start + size)):
                return Grant(
                    group="physics",
                    profile=f"{size}g.{10 * size}gb",
                    compute_slices=size,
                    mode=mode,
                    host=HOST,
                    gpu_uuid=gpu,
                    gpu_index=index,
                    start=start,
                    size=size,
                    mig_uuid=f"MIG-{gpu}-{start}" if mode == "pool" else None,
                    expires_at=view.now + timedelta(hours=8),
                )
    raise NoFreeSlot(f"no {size}-slice placement free for {view.request.user}")
