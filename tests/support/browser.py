"""Driving JupyterHub's own pages in Chromium (Playwright's sync API)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import reaper
from tests.support.system_deps import CHROMIUM, CHROMIUM_ARGS

#: ``MIG_SPAWNER_SCREENSHOTS=docs`` saves the browser tests' screenshots over the docs'
#: pictures (docs/img) to refresh them; otherwise they go to the run's folder, which the
#: reaper deletes, so that a test run leaves the working tree as it found it.
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def screenshot_path(name: str) -> Path:
    """Where to save the screenshot ``name`` (e.g. ``"slice-map.png"``)."""
    if os.environ.get("MIG_SPAWNER_SCREENSHOTS") == "docs":
        folder = DOCS_IMG
    else:
        folder = (reaper.run_dir() or Path(tempfile.gettempdir())) / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@contextlib.contextmanager
def launch_chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, through Playwright; closed on the way out. The
    caller has checked that both are there (``require_chromium``, ``importorskip``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def sign_in(page: Any, hub_url: str, user: str, next_url: str = "") -> Any:
    """Sign ``user`` in on the hub's login page (the test hubs accept any password),
    going on to ``next_url`` when given; returns ``page``."""
    page.goto(f"{hub_url}/hub/login" + (f"?next={next_url}" if next_url else ""))
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill("any password")
    page.get_by_role("button", name="Sign in").click()
    return page
