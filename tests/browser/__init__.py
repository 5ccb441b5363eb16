"""Tests that drive headless Chromium through Playwright against a real hub."""
