"""The ledger's tables, as SQLAlchemy Core metadata.

The migrations in ``migrations/versions`` create exactly this schema (a test
compares them). The ledger uses Core rather than the ORM on purpose: callers
get frozen ``Lease`` records, so there is no identity map or lazy loading to
go wrong across the hub's threads.

Two tables carry the uniqueness guarantee, enforced by the database itself so
that it holds across processes and hosts sharing one database:

* ``lease_slots``: primary key ``(host, gpu_uuid, memory_slice)``, one row per
  memory slice a held lease covers. Two held leases can never overlap.
* ``lease_servers``: primary key ``(user_name, server_name)``, one row per
  server that holds a lease. One server can never hold two.

Both rows are written in the claim transaction and deleted at release; the
``leases`` rows stay forever as history.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)

#: Alembic's version table for the ledger: not ``alembic_version``, so the
#: ledger can share JupyterHub's own database without the two colliding.
VERSION_TABLE = "mig_spawner_alembic_version"

metadata = MetaData()

#: User and server names: as long as JupyterHub lets them be (its SQLite database takes
#: any length). Unbounded on PostgreSQL, which enforces ``varchar(n)``; SQLite never
#: enforces a declared length, so its ``varchar(255)`` already holds any name and
#: migration 0003 need not rebuild its tables.
NAME = String(255).with_variant(Text(), "postgresql")


class UtcDateTime(TypeDecorator[datetime]):
    """Stores aware datetimes as naive UTC and returns them aware (UTC) on every backend.

    SQLite has no time zones, so storing UTC everywhere keeps comparisons in
    SQL (``expires_at <= now``) right on both SQLite and PostgreSQL.
    """

    impl = DateTime(timezone=False)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()} given; use an aware one")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC)


leases = Table(
    "leases",
    metadata,
    Column("id", String(32), primary_key=True, comment="uuid4 hex; never reused"),
    Column("user_name", NAME, nullable=False),
    Column("server_name", NAME, nullable=False),
    Column("group_name", String(255), nullable=False, comment="group charged for the slice"),
    Column("profile", String(64), nullable=False),
    Column("compute_slices", Integer, nullable=False),
    Column("mode", String(16), nullable=False, comment="pool | dynamic | kube"),
    Column("state", String(16), nullable=False, comment="claimed|active|releasing|released"),
    Column("host", String(255)),
    Column("gpu_uuid", String(64)),
    Column("gpu_index", Integer),
    Column("placement_start", Integer),
    Column("placement_size", Integer),
    Column("mig_uuid", String(64)),
    Column("gi_id", Integer),
    Column("ci_id", Integer),
    Column("node", String(255), comment="Kubernetes node"),
    Column("pod", String(255), comment="Kubernetes pod"),
    Column("claimed_at", UtcDateTime(), nullable=False),
    Column("started_at", UtcDateTime()),
    Column("last_activity_at", UtcDateTime()),
    Column("expires_at", UtcDateTime(), comment="max session age"),
    Column("released_at", UtcDateTime()),
    Column("release_detail", String(255),
           comment="why it ended, the particulars in free text (beside release_code)"),
    Column("holder_host", String(255), comment="host the server process runs on"),
    Column("holder_pid", Integer, comment="PID of the server process"),
    Column("holder_start", BigInteger,
           comment="its start time (/proc/<pid>/stat field 22), so a reused PID is told"),
    Column("server_url", String(1000),
           comment="internal URL of the server, read without the proxy"),
    Column("gpu_active_at", UtcDateTime(), comment="last time the slice did GPU work"),
    Column("peak_memory_mib", Integer, comment="most GPU memory the slice held (MiB)"),
    Column("warning", String(32), comment="the stop the user was warned of (a rule), if pending"),
    Column("warned_at", UtcDateTime()),
    Column("warning_deadline", UtcDateTime(), comment="when that stop is due"),
    Column("kept_at", UtcDateTime(), comment="last 'Keep my server' (counts as activity)"),
    Column("extensions", Integer, comment="times max session age was extended"),
    Column("holder_pod_uid", String(64),
           comment="UID of the server's pod (Kubernetes), so a recreated pod is told"),
    Column("release_code", String(32),
           comment="why it ended: stopped|server_exited|start_failed|stale|cancelled|orphan|"
                   "drain|budget"),
    Column("held_by", String(255), comment="while releasing: what still holds its slice"),
    Column("purpose", String(255), comment="what the server is for, as its user said"),
    Column("warning_state", String(16),
           comment="where its latest warning stands: pending|withdrawn|kept|carried_out"),
    Column("stops", Text(),
           comment="pending warnings, one per stop: JSON {rule: [warned_at, deadline]} (UTC)"),
    Index("ix_leases_state", "state"),
    Index("ix_leases_server", "user_name", "server_name"),
    Index("ix_leases_claimed_at", "claimed_at"),
    # Budgets read the leases released within their window at every claim and sweep.
    Index("ix_leases_released_at", "released_at"),
)

lease_slots = Table(
    "lease_slots",
    metadata,
    Column("host", String(255), primary_key=True),
    Column("gpu_uuid", String(64), primary_key=True),
    Column("memory_slice", Integer, primary_key=True),
    Column("lease_id", String(32), ForeignKey("leases.id"), nullable=False, index=True),
)

lease_servers = Table(
    "lease_servers",
    metadata,
    Column("user_name", NAME, primary_key=True),
    Column("server_name", NAME, primary_key=True),
    Column("lease_id", String(32), ForeignKey("leases.id"), nullable=False, unique=True),
)

#: Spawns that got no slice, for usage reports. Written outside any claim
#: transaction and never read by claims: a refusal changes no lease.
refusals = Table(
    "refusals",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", UtcDateTime(), nullable=False),
    Column("user_name", NAME, nullable=False),
    Column("server_name", NAME, nullable=False),
    Column("offer", String(64), nullable=False,
           comment="what was asked for: a profile or a slice class"),
    Column("profile", String(64), comment="the concrete profile, when known"),
    Column("reason", String(32), nullable=False,
           comment="stable refusal code: none_free, no_capacity, group_quota, ..."),
    Column("group_name", String(255), comment="group it would have been charged to"),
    Column("host", String(255)),
    Column("message", String(1000), nullable=False),
    Index("ix_refusals_at", "at"),
)

#: Warnings before a stop, and the user's answers (kept, extended, refused), per lease.
lease_events = Table(
    "lease_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("lease_id", String(32), ForeignKey("leases.id"), nullable=False, index=True),
    Column("at", UtcDateTime(), nullable=False),
    Column("kind", String(16), nullable=False, comment="warned | kept | extended | refused"),
    Column("rule", String(32), nullable=False),
    Column("detail", String(255), nullable=False),
)

#: One row (id 1). Claims lock it (``SELECT ... FOR UPDATE``) on databases
#: with row locks, so concurrent claims queue instead of failing on the keys.
ledger_lock = Table(
    "ledger_lock",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
)

#: The wait list (docs/ledger.md, "Wait list"): one row per waiting spawn, kept as
#: history once it ends. Joins, cancels and grants take the claim lock, so the grant
#: step sees every join and cancel that came before it and none that come after.
waits = Table(
    "waits",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True,
           comment="handed out in commit order: first come"),
    Column("user_name", String(255), nullable=False),
    Column("server_name", String(255), nullable=False),
    Column("group_name", String(255), nullable=False, comment="group it will be charged to"),
    Column("priority", Integer, nullable=False, comment="that group's priority at join"),
    Column("offer", String(64), nullable=False, comment="profile or slice class asked for"),
    Column("state", String(16), nullable=False,
           comment="waiting|granted|cancelled|expired|abandoned"),
    Column("joined_at", UtcDateTime(), nullable=False),
    Column("deadline", UtcDateTime(), comment="joined_at + max_wait; none: no limit"),
    Column("bypassed", Integer, nullable=False, comment="grants that passed it over"),
    Column("closed_at", UtcDateTime()),
    Column("lease_id", String(32), ForeignKey("leases.id"), comment="set when granted"),
    Column("reason", String(255), comment="why it ended, when not granted"),
    Index("ix_waits_state", "state"),
)

#: The slice's measured GPU use over a lease's life (docs/ledger.md, "Usage samples"):
#: one row per lease at most every ``usage_sample_interval`` of the slice service, for
#: peak, p95 and time active (``mig_spawner.core.rightsize``).
lease_samples = Table(
    "lease_samples",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("lease_id", String(32), ForeignKey("leases.id"), nullable=False),
    Column("at", UtcDateTime(), nullable=False),
    Column("memory_used_mib", Integer, nullable=False, comment="GPU memory the slice held"),
    Column("memory_total_mib", Integer, nullable=False, comment="the slice's memory"),
    Column("sm_active", Float, comment="share of SMs busy (None: not measurable)"),
    Column("processes", Integer, nullable=False),
    Index("ix_lease_samples_lease", "lease_id", "at"),
    Index("ix_lease_samples_at", "at"),
)

#: What a released lease's samples said, kept forever (docs/ledger.md, "Usage
#: samples"): written once, before its raw samples are pruned, so that right-sizing
#: and the report read the same figures after pruning as before.
lease_usage = Table(
    "lease_usage",
    metadata,
    Column("lease_id", String(32), ForeignKey("leases.id"), primary_key=True),
    Column("samples", Integer, nullable=False, comment="samples summarised"),
    Column("peak_mib", Integer, nullable=False, comment="most memory held"),
    Column("p95_mib", Integer, nullable=False, comment="95th percentile (nearest rank)"),
    Column("memory_total_mib", Integer, nullable=False, comment="the slice's memory"),
    Column("sampled_seconds", Float, nullable=False, comment="first to last sample"),
    Column("active_seconds", Float, nullable=False,
           comment="share of samples active times sampled_seconds"),
)

#: Extra hours an admin granted to a budget (docs/policies.md, "Budgets"): each adds
#: to the group's budget (``user_name`` NULL) or a member's own for one budget window
#: from ``granted_at``. Read by claims, grants and the slice service; never changed.
budget_grants = Table(
    "budget_grants",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("group_name", String(255), nullable=False),
    Column("user_name", String(255),
           comment="the member whose own budget it raises; none: the group's"),
    Column("slice_seconds", Float, nullable=False,
           comment="extra compute-slice-seconds, valid for one budget window"),
    Column("granted_at", UtcDateTime(), nullable=False),
    Column("granted_by", String(255), nullable=False),
    Column("note", String(255), nullable=False),
    Index("ix_budget_grants_granted_at", "granted_at"),
)

#: Layout changes (docs/layout.md): one row per GPU and change, kept as history once it
#: ends. While a row is pending, draining or applying, its ``held_slices`` are held from
#: new grants: claims and grant passes read them in their transaction.
layout_changes = Table(
    "layout_changes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("host", String(255), nullable=False),
    Column("gpu_uuid", String(64), nullable=False),
    Column("gpu_index", Integer, nullable=False),
    Column("target", String(1000), nullable=False,
           comment="the GPU's target as JSON: mig_enabled and instances per profile"),
    Column("state", String(16), nullable=False,
           comment="pending|draining|applying|done|failed"),
    Column("held_slices", BigInteger, nullable=False,
           comment="memory slices held from new grants, a bit per slice"),
    Column("whole_gpu", Integer, nullable=False, comment="1: every slice is held (drain)"),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    Column("notice_from", UtcDateTime(), comment="when the holders were warned"),
    Column("detail", String(255), comment="the last step done, or why it failed"),
    Column("stepper", String(255),
           comment="the process stepping the change now (host, pid, start); none: nobody"),
    Column("stepper_seen", UtcDateTime(), comment="when that stepper last took or checked a step"),
    Index("ix_layout_changes_state", "state"),
)

#: GPU faults (docs/health.md): one row per fault found on a GPU or one MIG device of
#: it, kept as history once cleared. While ``cleared_at`` is empty its ``held_slices``
#: (or the whole GPU) are held from new grants, like a layout change's.
gpu_faults = Table(
    "gpu_faults",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("host", String(255), nullable=False),
    Column("gpu_uuid", String(64), nullable=False),
    Column("gpu_index", Integer, nullable=False),
    Column("kind", String(32), nullable=False,
           comment="xid|ecc|row_remap|retired_pages|lost|missing_instance"),
    Column("detail", String(255), nullable=False, comment="what the driver said"),
    Column("xid", Integer, comment="the Xid of an Xid event"),
    Column("device_uuid", String(64), comment="the MIG device it concerns; none: the whole GPU"),
    Column("held_slices", BigInteger, nullable=False,
           comment="memory slices held from new grants, a bit per slice"),
    Column("whole_gpu", Integer, nullable=False, comment="1: every slice is held"),
    Column("seen_at", UtcDateTime(), nullable=False),
    Column("last_seen_at", UtcDateTime(), nullable=False),
    Column("cleared_at", UtcDateTime(), comment="when an admin cleared it; none: it holds"),
    Column("cleared_by", String(255)),
    Index("ix_gpu_faults_cleared_at", "cleared_at"),
)
