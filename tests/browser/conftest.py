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
