"""The one way the tests wait for something to happen: :func:`until` (and
:func:`until_async` in a test's event loop) asks ``check`` again and again until it gives
something true, and returns that. If ``timeout`` passes first, the test fails with what
it waited for, the last thing ``check`` gave, and whatever the caller passes as
``show``: the hub's log, the service's log, the ledger's rows. A wait that fails says
why; a bare "timed out" sends the next engineer to rerun it.

    lease = until(lambda: ledger.leases.active_for_server("ana"), 30, "ana's lease",
                  show=service.log)
    await until_async(lambda: api_sees(pod), 5, "the pod deleted", show=standin.pods)

``timeout`` is how long something that will happen may take on a loaded machine, not
a claim about speed: a test that must show that something did *not* happen waits for
the event that proves the code looked (a sweep counted, a log line, a ledger row) and
then asserts, never sleeps and asserts (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: What a failed wait shows: a log file (its tail), something to call (a log reader, a
#: ledger query) or a value (rows read before).
Shown = Path | Callable[[], object] | object
#: The tail of each thing shown, in characters.
SHOWN_CHARS = 6000


class NotSeen(AssertionError):
    """What a test waited for did not happen in time; the message has what was shown."""


def until(check: Callable[[], T], timeout: float, what: str, *,
          show: Shown | Sequence[Shown] = (), every: float = 0.2) -> T:
    """``check()``'s first true answer, asked every ``every`` seconds; fails the test
    with :class:`NotSeen` (``what``, the last answer and ``show``) after ``timeout``
    seconds. An exception ``check`` raises (a process found dead) ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise NotSeen(_report(what, timeout, answer, show))
        time.sleep(every)


async def until_async(check: Callable[[], T | Awaitable[T]], timeout: float, what: str, *,
                      show: Shown | Sequence[Shown] = (), every: float = 0.02) -> T:
    """:func:`until` in the running event loop: ``check`` may be a coroutine function,
    and the loop runs between two asks."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return answer
        if time.monotonic() >= deadline:
            raise NotSeen(_report(what, timeout, answer, show))
        await asyncio.sleep(every)


def _report(what: str, timeout: float, answer: object, show: Shown | Sequence[Shown]) -> str:
    lines = [f"{what}: not seen within {timeout:g} s"]
    if answer not in (None, False):
        lines.append(f"last answer: {_tail(repr(answer))}")
    text = shown(show)
    return "\n".join([*lines, text] if text else lines)


def shown(show: Shown | Sequence[Shown]) -> str:
    """What ``show`` gives, each thing under its name (a log as its tail): a failure
    raised outside a wait (a refused request, a process found dead) says as much as a
    failed wait."""
    items = show if isinstance(show, Sequence) and not isinstance(show, str) else [show]
    return "\n".join(f"--- {_name(item)} ---\n{_text(item)}" for item in items)


def _name(item: Shown) -> str:
    if isinstance(item, Path):
        return str(item.name)
    return getattr(item, "__qualname__", None) or type(item).__name__


def _text(item: Shown) -> str:
    try:
        if isinstance(item, Path):
            return _tail(item.read_text(errors="replace")) if item.exists() else "(no file)"
        value = item() if callable(item) else item
    except Exception as e:  # what is shown must not hide why the wait failed
        return f"(could not be read: {e!r})"
    return _tail(value if isinstance(value, str) else repr(value))


def _tail(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else "..." + text[-SHOWN_CHARS:]
