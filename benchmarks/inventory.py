"""How long one full GPU inventory takes on a simulated 8x H200 host with 56 MIG devices.

Goal: under 20 ms per inventory. Baseline, measured in the same run: the bare pynvml walk
a hand-written script would do (every MIG device's UUID, name, memory, GI/CI IDs and
processes) without listing GPU instances or building the Inventory snapshot.

Run: .venv/bin/python benchmarks/inventory.py [--runs 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pynvml

from mig_spawner.gpu import connect

SPEC = "h200x8:layout=1g.18gb*7"
GOAL_MS = 20.0


def raw_walk() -> int:
    """The baseline: the MIG device walk with plain pynvml calls, no snapshot."""
    seen = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
        pynvml.nvmlDeviceGetName(gpu)
        pynvml.nvmlDeviceGetUUID(gpu)
        pynvml.nvmlDeviceGetMigMode(gpu)
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
            except pynvml.NVMLError_NotFound:
                continue
            pynvml.nvmlDeviceGetUUID(mig)
            pynvml.nvmlDeviceGetName(mig)
            pynvml.nvmlDeviceGetMemoryInfo(mig)
            pynvml.nvmlDeviceGetGpuInstanceId(mig)
            pynvml.nvmlDeviceGetComputeInstanceId(mig)
            pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
            seen += 1
    return seen


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm caches (profile tables, pynvml's symbol cache)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed runs per case")
    args = parser.parse_args()

    adapter = connect(SPEC)
    devices = len(adapter.inventory().mig_devices)
    assert devices == 56 and raw_walk() == 56, devices
    baseline = median_ms(raw_walk, args.runs)
    in_memory = median_ms(adapter.inventory, args.runs)
    adapter.close()

    with tempfile.TemporaryDirectory() as tmp:
        shared = connect(SPEC, Path(tmp) / "sim.json")
        with_file = median_ms(shared.inventory, args.runs)
        shared.close()

    rows = [
        ("raw pynvml walk (baseline)", baseline),
        ("GpuAdapter.inventory()", in_memory),
        ("GpuAdapter.inventory(), shared state file", with_file),
    ]
    print(f"8x H200, {devices} MIG devices, median of {args.runs} runs")
    print(f"{'case':<44}{'ms':>8}{'x baseline':>12}")
    for name, ms in rows:
        print(f"{name:<44}{ms:>8.2f}{ms / baseline:>12.2f}")
    verdict = "meets" if in_memory < GOAL_MS else "MISSES"
    print(f"inventory {verdict} the {GOAL_MS:.0f} ms goal")


if __name__ == "__main__":
    main()
