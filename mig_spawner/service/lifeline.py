"""End a hub-managed service when the hub that started it is gone.

JupyterHub starts managed services in sessions of their own, so a hub killed
outright (SIGKILL, OOM) leaves its service running with its token, while the
restarted hub starts a second one beside it. A managed service therefore
watches its parent: once re-parented, the hub that started it is gone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


async def call_when_orphaned(on_orphaned: Callable[[], None], interval: float = 2.0) -> None:
    """Call ``on_orphaned`` once this process's parent has changed, checking every
    ``interval`` seconds.

    A parent that is PID 1 is not watched: in a container the hub itself may be PID 1.
    """
    parent = os.getppid()
    if parent == 1:
        return
    while os.getppid() == parent:
        await asyncio.sleep(interval)
    on_orphaned()
