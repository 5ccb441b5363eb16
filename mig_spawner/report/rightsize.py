"""``report --rightsize``: users and groups whose slices are over- or under-sized, and
usage by purpose.

Every verdict comes from :func:`mig_spawner.core.rightsize.judge` on the measured
sessions (leases that ended, with usage samples) of one user, or one group, on one
profile, as the spawn form's hint judges them (a session still running is left out by
``judge`` for both); the
sizes to move to are the profiles of the same GPU model in the catalog (its ``+me``
variants left out). Sessions without samples are never guessed from: too few measured
ones give a line that says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from mig_spawner.core.catalog import MODELS, format_gib
from mig_spawner.core.rightsize import RightsizeRule, Session, Size, Usage, Verdict, judge
from mig_spawner.ledger.reports import LeaseFacts
from mig_spawner.report.demand import lease_end

#: What a purpose-less lease is listed as.
NO_PURPOSE = "(not given)"


@dataclass(frozen=True)
class RightsizeRow:
    """One verdict: ``who`` (``user`` or ``group``) ``name`` on ``profile``."""

    who: str
    name: str
    profile: str
    verdict: Verdict
    measured: int
    needed: int
    sessions: int
    peak_mib: int | None
    memory_mib: int | None
    suggested: str | None
    suggested_mib: int | None

    @property
    def text(self) -> str:
        """The verdict in words."""
        if self.verdict is Verdict.SMALLER:
            return f"over-sized: {self.suggested} ({format_gib(self.suggested_mib or 0)}) would do"
        if self.verdict is Verdict.LARGER:
            return f"under-sized: hit the limit; {self.suggested} " \
                   f"({format_gib(self.suggested_mib or 0)}) would give room"
        if self.verdict is Verdict.FITS:
            return "fits"
        return f"too few measured sessions ({self.measured} of {self.needed} needed)"


def catalog_sizes(profile: str) -> list[Size]:
    """The profiles of the GPU model that has ``profile`` (the first such in the catalog,
    verified models first: a lease names its profile, not its model), without media
    variants (``+me``, ``-me``, ``+gfx``), with their memory; empty for an unknown one."""
    for gpu in sorted(MODELS, key=lambda m: not m.verified):
        if gpu.has_profile(profile):
            return [Size(p.name, p.memory_mib) for p in gpu.profiles
                    if "+" not in p.name and "-" not in p.name]
    return []


def rightsize_rows(leases: Iterable[LeaseFacts], usage: Mapping[str, Usage],
                   rule: RightsizeRule) -> list[RightsizeRow]:
    """A verdict per user and per group on each profile they held in ``leases``
    (judged newest first), users first, then groups, each by name and profile."""
    newest = sorted(leases, key=lambda x: x.claimed_at, reverse=True)
    by: dict[tuple[str, str, str], list[LeaseFacts]] = {}
    for lease in newest:
        by.setdefault(("user", lease.user, lease.profile), []).append(lease)
        by.setdefault(("group", lease.group, lease.profile), []).append(lease)
    rows = []
    sizes = {profile: catalog_sizes(profile) for profile in {key[2] for key in by}}
    for (who, name, profile), held in sorted(by.items(), key=lambda kv: (
            kv[0][0] != "user", kv[0][1], kv[0][2])):
        # Lazily: judge reads a group's thousands of sessions only to its newest few.
        sessions = (Session(profile, usage.get(x.id), x.held) for x in held)
        found = judge(sessions, profile, sizes[profile], rule)
        rows.append(RightsizeRow(
            who=who, name=name, profile=profile, verdict=found.verdict,
            measured=found.measured, needed=found.needed, sessions=len(held),
            peak_mib=found.peak_mib, memory_mib=found.memory_mib,
            suggested=found.suggested.key if found.suggested else None,
            suggested_mib=found.suggested.memory_mib if found.suggested else None,
        ))
    return rows


def rightsize_text(rows: Sequence[RightsizeRow], rule: RightsizeRule) -> str:
    """The ``--rightsize`` section: the over- and under-sized, then what could not be
    judged for want of measured sessions, with the thresholds stated."""
    lines = ["Right-sizing from measured GPU memory", f"  rule: {rule.stated()}", ""]
    if not rows:
        return "\n".join([*lines, "no leases in this window"])
    if not any(r.measured for r in rows):
        return "\n".join([*lines, "no measured sessions in this window: right-sizing needs "
                          "the slice service's usage samples (c.SliceServiceApp."
                          "usage_sample_interval); nothing is guessed without them"])
    judged = [r for r in rows if r.verdict in (Verdict.SMALLER, Verdict.LARGER)]
    if judged:
        head = ("WHO", "NAME", "PROFILE", "MEASURED", "PEAK", "VERDICT")
        cells = [head, *((r.who, r.name, r.profile, f"{r.measured}/{r.sessions}",
                          format_gib(r.peak_mib or 0), r.text) for r in judged)]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                  for row in cells]
    else:
        lines.append("every size judged fits its measured peaks")
    few = [r for r in rows if r.verdict is Verdict.TOO_FEW]
    if few:
        lines += ["", f"too few measured sessions to judge ({len(few)}): " + ", ".join(
            f"{r.who} {r.name} on {r.profile} ({r.measured} of {r.needed})" for r in few)]
    return "\n".join(lines)


@dataclass(frozen=True)
class PurposeRow:
    """Usage by purpose: leases, users and hold hours in the window."""

    purpose: str
    leases: int
    users: int
    hold_hours: float


def purpose_rows(leases: Iterable[LeaseFacts], since: datetime, until: datetime
                 ) -> list[PurposeRow]:
    """Leases, users and hold hours per purpose (as its users wrote it), most hours
    first; leases without one under :data:`NO_PURPOSE`."""
    totals: dict[str, tuple[int, set[str], float]] = {}
    for lease in leases:
        key = lease.purpose or NO_PURPOSE
        count, users, seconds = totals.get(key, (0, set(), 0.0))
        users.add(lease.user)
        end, start = min(lease_end(lease, until), until), max(lease.claimed_at, since)
        totals[key] = (count + 1, users, seconds + max(0.0, (end - start).total_seconds()))
    rows = [PurposeRow(k, n, len(u), s / 3600) for k, (n, u, s) in totals.items()]
    return sorted(rows, key=lambda r: (-r.hold_hours, r.purpose))


def purpose_text(rows: Sequence[PurposeRow]) -> str:
    """The usage-by-purpose table."""
    head = ("PURPOSE", "LEASES", "USERS", "HOLD H")
    cells = [head, *((r.purpose, str(r.leases), str(r.users), f"{r.hold_hours:.1f}")
                     for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in cells)
