"""What the browser tests share: one Chromium per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import launch_chromium
from tests.support.system_deps import require_chromium


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, for every test of a module that asks for it."""
    require_chromium()
    pytest.importorskip("playwright.sync_api")
    with launch_chromium() as browser:
        yield browser


@pytest.fixture(autouse=True)
def close_hub_clients() -> Iterator[None]:
    """The suite's fixture of this name closes, in the test's event loop, the hub
    clients a test made. A browser test makes none, and Playwright's sync API runs an
    event loop of its own in this thread, in which pytest-asyncio cannot start one."""
    yield
