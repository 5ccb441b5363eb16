"""Driving JupyterHub's own pages in Chromium (Playwright's sync API)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tests.support.system_deps import CHROMIUM, CHROMIUM_ARGS


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
