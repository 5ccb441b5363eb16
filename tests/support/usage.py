"""Past sessions with measured usage, as the slice service would have sampled them: for
the right-sizing tests (in-process and in the browser)."""

from __future__ import annotations

from datetime import datetime, timedelta

from mig_spawner.core.catalog import model
from mig_spawner.core.rightsize import UsageSample
from mig_spawner.ledger import Grant, LeaseRequest, Ledger

GIB = 1024


def samples(start: datetime, peak_gib: float, total_gib: float, count: int = 20,
            busy: int = 5) -> list[UsageSample]:
    """``count`` samples a minute apart from ``start``, half the peak until the last one
    reaches ``peak_gib``, the first ``busy`` of them with SMs active."""
    return [UsageSample(start + timedelta(minutes=i),
                        int(peak_gib * GIB * (0.5 if i < count - 1 else 1)),
                        int(total_gib * GIB), 0.4 if i < busy else 0.0, 1)
            for i in range(count)]


def seed_sessions(ledger: Ledger, advance, user: str, group: str, profile: str, start: int,
                  peaks_gib: list[float], purpose: str | None = None, count: int = 20,
                  host: str = "h", now=None) -> None:
    """One H200 lease of ``profile`` per peak, sampled ``count`` times, then released
    (``advance()`` moves the ledger's clock on an hour between them; ``now()``: its
    time, for the samples)."""
    found = model("h200").profile(profile)
    for peak in peaks_gib:
        decision = Grant(group=group, profile=profile, compute_slices=found.compute_slices,
                         mode="pool", host=host, gpu_uuid="GPU-past", gpu_index=0,
                         start=start, size=found.placement_size, mig_uuid=f"MIG-past-{start}")
        lease = ledger.leases.claim(LeaseRequest(user, ""), lambda v, d=decision: d)
        if purpose:
            ledger.leases.record_purpose(lease.id, purpose)
        for sample in samples(now() if now else lease.claimed_at, peak,
                              found.memory_mib / GIB, count):
            ledger.usage.record_samples({lease.id: sample})
        advance()
        ledger.leases.release(lease.id, "stopped")
