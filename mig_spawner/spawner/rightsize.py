"""The spawn form's right-sizing hint: what a returning user's measured sessions say.

Reads the user's past leases and their usage samples from the ledger (on the runtime's
worker thread), maps each lease's profile to the offer the form shows for it, and asks
the pure rule (:func:`mig_spawner.core.rightsize.judge`) about the size the form
preselects. No JupyterHub import: the mixin calls :func:`form_hint`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mig_spawner.core.catalog import GpuModel
from mig_spawner.core.policy import UserPolicy
from mig_spawner.core.rightsize import RightsizeRule, Session, Size, judge
from mig_spawner.ledger import Ledger

Run = Callable[[Callable[[], Any]], Awaitable[Any]]


def sizes_here(mine: UserPolicy, models: Sequence[GpuModel]) -> tuple[dict[str, str], list[Size]]:
    """Profile name -> the user's offer that serves it here (the first in the policy's
    order), and each offer served here with its memory (its smallest on a mixed fleet)."""
    offer_of: dict[str, str] = {}
    sizes = []
    for offer in mine.offers:
        served = [gpu.profile(name) for gpu in models
                  if (name := offer.profile_for(gpu.key)) is not None]
        if not served:
            continue
        for profile in served:
            offer_of.setdefault(profile.name, offer.key)
        sizes.append(Size(offer.key, min(p.memory_mib for p in served)))
    return offer_of, sizes


async def form_hint(run: Run, ledger: Callable[[], Ledger], user: str, mine: UserPolicy,
                    models: Sequence[GpuModel], preselected: str | None,
                    rule: RightsizeRule) -> str | None:
    """The hint for ``user`` about ``preselected`` (else the size of their latest
    session), or ``None`` when their measured sessions say nothing (too few, or the
    size fits). May raise the ledger's errors."""
    offer_of, sizes = sizes_here(mine, models)
    if len(sizes) < 2:
        return None  # nothing else to suggest

    def read() -> list[Session]:
        store = ledger()
        past = sorted(store.leases.history(user=user), key=lambda x: x.claimed_at,
                      reverse=True)[: 4 * rule.recent]
        usage = store.usage.summaries(x.id for x in past)
        # Running ones too: judge() leaves them out, as it does for the report.
        return [Session(offer_of[x.profile], usage.get(x.id), x.held) for x in past
                if x.profile in offer_of]

    sessions = await run(read)
    if not sessions:
        return None
    key = preselected if any(s.key == preselected for s in sessions) else sessions[0].key
    names = {offer.key: offer.named for offer in mine.offers}
    text = judge(sessions, key, sizes, rule).sentence("your", names.__getitem__)
    return None if text is None else text[0].upper() + text[1:] + "."
