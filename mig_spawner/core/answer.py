"""How long a new server may take to answer, from how long the last ones took.

JupyterHub gives a started server ``http_timeout`` (30 s by default) to answer, then
stops it; on a loaded host servers take longer (docs/operations.md, "Starting on a
loaded host": one server 7 s on 2 busy cores, 15 started at once 137-147 s). The
spawner waits for its own server instead, as long as the process lives, up to
:func:`answer_timeout`: the admin's ``http_timeout``, at least :data:`FLOOR`, and
:data:`HEADROOM` times the slowest of the last :data:`RECENT` answers it measured.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Seconds a server may always take: twice the slowest of 15 started at once on a
#: loaded 2-core host (147 s, measured at load 30).
FLOOR = 300.0
#: A start may take this many times the slowest recent one.
HEADROOM = 3.0
#: How many recent answers are kept (a process's memory; no read of the ledger).
RECENT = 20


def answer_timeout(configured: float, recent: Iterable[float]) -> float:
    """Seconds a server may take to answer: the configured ``http_timeout``, at least
    :data:`FLOOR`, and :data:`HEADROOM` times the slowest of ``recent`` answers."""
    return max(float(configured), FLOOR, HEADROOM * max(recent, default=0.0))


def start_bound(configured_start: float, answer: float, tries: int, wait: float = 0.0) -> int:
    """JupyterHub's ``start_timeout`` for a spawn whose ``start()`` waits for its server
    to answer: the backend's own start (``configured_start``) and the answer wait, for
    each of ``tries`` starts, plus ``wait`` seconds in line."""
    return int(tries * (configured_start + answer) + wait) + 1
