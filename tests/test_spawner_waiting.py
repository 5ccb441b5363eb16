"""The spawner's side of waiting that needs no hub: the start timeout from the grant.

The rest (join, grant on release, places, cancel, max_wait, restart) runs on a real
hub in tests/test_hub_waiting.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from mig_spawner.spawner.waiting import within_start_timeout


def _spawner(configured: int, raised: int, granted_ago: float | None) -> SimpleNamespace:
    spawner = SimpleNamespace(start_timeout=raised, log=logging.getLogger("test"),
                              _log_name="ana",
                              _granted_at=None if granted_ago is None
                              else time.monotonic() - granted_ago)
    spawner.__dict__["_configured_start_timeout"] = configured
    return spawner


async def test_after_a_wait_the_start_timeout_counts_from_the_grant(caplog):
    spawner = _spawner(configured=2, raised=3600, granted_ago=0.5)
    tic = time.monotonic()
    with caplog.at_level(logging.WARNING, "test"), pytest.raises(TimeoutError):
        # A start that never ends: a timer ends it, and the one counted from the grant
        # (2 s, not 3600) says so; the outer bound only keeps a failure short.
        await asyncio.wait_for(within_start_timeout(spawner, asyncio.Event().wait()), 60)
    assert "ana did not start within 2s of its grant" in caplog.text
    assert time.monotonic() - tic >= 1.0  # not before the 2 s from the grant 0.5 s ago
    assert spawner.start_timeout == 2  # what JupyterHub's timeout message names


async def test_a_start_that_never_waited_keeps_the_hubs_own_timeout():
    spawner = _spawner(configured=60, raised=60, granted_ago=None)
    assert await within_start_timeout(spawner, asyncio.sleep(0, "url")) == "url"
