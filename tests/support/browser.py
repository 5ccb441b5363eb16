"""Driving JupyterHub's own pages in Chromium (Playwright's sync API)."""

from __future__ import annotations

from typing import Any


def sign_in(page: Any, hub_url: str, user: str, next_url: str = "") -> Any:
    """Sign ``user`` in on the hub's login page (the test hubs accept any password),
    going on to ``next_url`` when given; returns ``page``."""
    page.goto(f"{hub_url}/hub/login" + (f"?next={next_url}" if next_url else ""))
    page.get_by_label("Username").fill(user)
    page.get_by_label("Password").fill("any password")
    page.get_by_role("button", name="Sign in").click()
    return page
