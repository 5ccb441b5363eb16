"""Who may join the wait list: the rule a join checks, pure.

The ledger's wait-list store calls :func:`check_join` inside the join's transaction,
with the line and the server's held lease as that transaction read them under the
claim lock, so the check and the join it guards are one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from mig_spawner.core.refusal import Reason, Refused

from .order import Waiter

W = TypeVar("W", bound=Waiter)


def check_join(user: str, server_name: str, line: Sequence[W], *, max_waiting: int,
               holds_slice: bool) -> W | None:
    """Whether ``user``'s server ``server_name`` may join ``line`` (every entry still
    waiting): the entry it has already (a restarted hub joins again and resumes it), or
    ``None``: it may join. Raises :class:`Refused`: ``user_limit`` when the user already
    waits for ``max_waiting`` other servers, ``previous_lease`` when the server still
    holds a slice (``holds_slice``)."""
    mine = [entry for entry in line if entry.user == user]
    for entry in mine:
        if entry.server_name == server_name:
            return entry
    if len(mine) >= max_waiting:
        raise Refused(Reason.USER_LIMIT,
                      f"you already wait for {len(mine)} of {max_waiting} servers",
                      "cancel a waiting server to wait for this one")
    if holds_slice:
        raise Refused(Reason.PREVIOUS_LEASE, "this server still holds a slice", "stop it first")
    return None
