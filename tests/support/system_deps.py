"""System programs some tests need (PostgreSQL, Chromium), and what to do without them.

A developer's machine may lack them: the tests that need them then skip, loudly.
``make test`` installs both and sets ``MIG_SPAWNER_REQUIRE_SYSTEM=1``, which turns
such a skip into a failure, so CI can never pass by skipping.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

CHROMIUM = "/usr/bin/chromium"
# Headless as root in a sandboxed network: no sandbox, no GPU, and none of the
# background connections that a closed network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def missing(reason: str) -> NoReturn:
    """Skip the test for a missing system program, or fail when the suite requires it."""
    if os.environ.get("MIG_SPAWNER_REQUIRE_SYSTEM") == "1":
        pytest.fail(reason + " (MIG_SPAWNER_REQUIRE_SYSTEM=1 forbids skipping)")
    pytest.skip("SKIPPING: " + reason)


def require_chromium() -> str:
    """The Chromium binary the browser tests drive."""
    if not Path(CHROMIUM).exists():
        missing(f"{CHROMIUM} is not installed (Debian: apt-get install chromium)")
    return CHROMIUM


def require_device_cgroup() -> Path:
    """The cgroup v1 ``devices`` hierarchy, writable, and ``mknod`` allowed: what the
    kernel-enforced isolation tests need (root on a cgroup v1 host, as in CI)."""
    from mig_spawner import device_cgroup

    support = device_cgroup.host_support()
    if support.mechanism != device_cgroup.CGROUP_V1:
        missing("the kernel-enforced isolation tests need root and a writable cgroup v1 "
                f"devices controller: {support.why or support.mechanism}")
    return device_cgroup.V1_DEVICES
