"""Progress events of one start, for JupyterHub's spawn-pending page and event stream.

``start()`` appends events as it goes; each reader (every open spawn-pending
page calls ``Spawner.progress()`` afresh) replays them from the first and then
follows new ones until the start has finished. The pending page shows the latest
message as its headline (``templates/hub/spawn_pending.html``), so each message is one
plain sentence: the size as the form's heading names it, then the profile and its
memory as every screen shows them (``1g.18gb``, ``16.8 GiB``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mig_spawner.core.catalog import is_whole_gpu


class ProgressLog:
    """An append-only list of ``{"progress", "message"}`` events that readers can follow."""

    def __init__(self) -> None:
        self._events: list[dict] = []
        self._changed = asyncio.Event()
        self._done = False

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    def add(self, progress: int, message: str, html: str | None = None) -> None:
        """Record one step; ``progress`` is 0..100 as JupyterHub's progress bar expects;
        ``html``: the same step with links, for the pending page (escaped by the caller)."""
        event = {"progress": progress, "message": message}
        if html is not None:
            event["html_message"] = html
        self._events.append(event)
        self._wake()

    def finish(self) -> None:
        """The start is over (either way): readers stop after the last event."""
        self._done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[dict]:
        """Every event so far, then each new one, until :meth:`finish`."""
        seen = 0
        while True:
            changed = self._changed
            while seen < len(self._events):
                yield self._events[seen]
                seen += 1
            if self._done:
                return
            await changed.wait()


def reserving(named: str) -> str:
    """``"Reserving “Small: 1 of 7 compute slices”"``: the size as the form's heading
    names it (``Offer.named``)."""
    return f"Reserving {named}"


def reserved(profile: str, memory: str | None, where: str) -> str:
    """``"Reserved 1g.18gb (16.8 GiB) on GPU 0 (NVIDIA H200)"``; no memory when the
    backend does not know it."""
    name = "a whole GPU" if is_whole_gpu(profile) else profile
    size = f"{name} ({memory})" if memory else name
    return f"Reserved {size} on {where}"


def unschedulable(message: str) -> str:
    """``"Waiting for room in the cluster: 0/1 nodes are available: 1 Insufficient
    nvidia.com/mig-1g.18gb."``: the scheduler's FailedScheduling words (node counts and
    reasons, no names), without what its PostFilter plugins add after them ("no new
    claims to deallocate, preemption: ..."). A repeat's "(tried N times)" stays."""
    head, dot, rest = message.partition(". ")
    reasons = f"{head}." if dot else head.split(" preemption:", 1)[0].strip()
    repeat = rest[rest.rfind(" (tried "):] if rest.endswith(" times)") else ""
    return f"Waiting for room in the cluster: {reasons}{repeat}"
