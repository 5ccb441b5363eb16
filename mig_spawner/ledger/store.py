"""The lease ledger: the one place that says which server holds which slice.

Every public method runs in its own short transaction on its own pooled
connection, so one ``Ledger`` may be shared by the hub's executor threads.
Callers get frozen ``Lease`` records back, never live ORM rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from types import TracebackType
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, func, or_, select

from mig_spawner.core.clock import utcnow
from mig_spawner.core.layout import PlanState
from mig_spawner.core.lifecycle import WaitState

from . import migrate
from .changes import ChangeWatch, MarkChanges, PostgresChanges, SqliteChanges
from .engine import DEFAULT_URL, create_ledger_engine, lock_claims
from .errors import InvalidDecision, LeaseNotFound, LeaseStateError, LedgerMissing, ServerHasLease
from .holds import Holds, read_holds
from .models import layout_changes, leases, waits
from .readonly import readonly_engine
from .records import (
    HELD_STATES,
    Grant,
    Lease,
    LeaseRequest,
    LeaseState,
    LedgerView,
    ReleaseCode,
    require_aware,
)
from .refusal_log import RefusalLog
from .rows import (
    HELD,
    SERVER_LEASE,
    clean_text,
    first_why,
    free_slots,
    insert_lease,
    lock_lease,
    move,
    new_lease,
    release_code,
    select_leases,
    to_lease,
    update,
)
from .transactions import Transactions
from .usage import Usage
from .view import ClaimView
from .waitlist import Waits
from .warnings import Warnings

Clock = Callable[[], datetime]
#: The pure callback a claim runs inside its transaction: policy check plus allocator.
Decide = Callable[[LedgerView], Grant]

log = logging.getLogger(__name__)


class Ledger:
    """Durable leases in a SQL database (SQLite file by default, or any SQLAlchemy URL).

    ``Ledger(url)`` only connects; ``Ledger.open(url)`` also migrates the
    schema to the version this package ships, which is what the hub and the
    slice service should call at start-up. ``clock`` gives the timestamps the
    ledger writes (aware UTC; tests pass a fake); ``echo`` logs every SQL statement.
    """

    def __init__(self, url: str = DEFAULT_URL, *, clock: Clock = utcnow, echo: bool = False,
                 readonly: bool = False):
        self._engine = (readonly_engine if readonly else create_ledger_engine)(url, echo=echo)
        self._tx = Transactions(self._engine, clock)
        self._origin = self._tx.origin
        #: Refused spawns (``record``, ``between``, ``request_counts``).
        self.refusals = RefusalLog(self._tx)
        #: Activity, GPU work, usage samples and budgets.
        self.usage = Usage(self._tx)
        #: Capacity held from new grants: layout changes.
        self.holds = Holds(self._tx)
        #: Warnings before a stop, and the users' answers ("Keep my server").
        self.warnings = Warnings(self._tx)
        self._view = ClaimView(self.usage)
        #: Spawns waiting for a slice, and the grant pass.
        self.waits = Waits(self._tx, self._view)

    @classmethod
    def open(cls, url: str = DEFAULT_URL, **kwargs: Any) -> Ledger:
        """Connect to ``url`` and bring its schema up to date."""
        ledger = cls(url, **kwargs)
        try:
            ledger.upgrade()
        except BaseException:
            ledger.close()
            raise
        return ledger

    @classmethod
    def open_existing(cls, url: str = DEFAULT_URL, **kwargs: Any) -> Ledger:
        """Open the ledger at ``url`` for reading only; never creates or migrates anything.

        For commands that only read (``mig-spawner report``). Raises
        :class:`LedgerMissing` when there is no ledger there (no SQLite file, or a
        database without its tables) and :class:`SchemaError` when its schema is not the
        one this package ships (the hub migrates it when it next opens it). A SQLite
        ledger is opened ``mode=ro``: any write fails in the driver.
        """
        ledger = cls(url, readonly=True, **kwargs)
        try:
            with ledger._tx.database():
                if ledger.revision() is None:
                    raise LedgerMissing(
                        f"the database {ledger.url} has no ledger tables: nothing was ever "
                        "recorded there (the hub creates them when it first opens it)")
                ledger._tx.check_schema()
        except BaseException:
            ledger.close()
            raise
        return ledger

    @property
    def url(self) -> str:
        """The database URL, password hidden (safe for logs)."""
        return self._tx.url

    @property
    def dialect(self) -> str:
        """``sqlite``, ``postgresql``, ..."""
        return self._engine.dialect.name

    def upgrade(self) -> str:
        """Run pending migrations (safe to call from several processes at once)."""
        with self._tx.database():
            revision = migrate.upgrade(self._engine)
        self._tx.schema_checked()
        return revision

    def revision(self) -> str | None:
        """The schema revision of the database (``None``: no ledger schema yet)."""
        return migrate.current_revision(self._engine)

    def close(self) -> None:
        """Close pooled connections. The data stays; a new ``Ledger`` sees it all."""
        self._engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"

    # -- the shared transactions (the wait list's and the layout changes' bases use them)

    def _read(self) -> AbstractContextManager[Connection]:
        return self._tx.read()

    def _write(self) -> AbstractContextManager[Connection]:
        return self._tx.write()

    def _now(self) -> datetime:
        return self._tx.now()

    def _held(self, connection: Connection) -> list[Lease]:
        return self._view.held(connection)

    # -- claiming ---------------------------------------------------------------

    def claim(self, request: LeaseRequest, decide: Decide) -> Lease:
        """Grant ``request`` the slice that ``decide`` picks, atomically.

        In ONE transaction: wait for any other claim to finish, read the held
        leases, call ``decide(view)`` and store its ``Grant`` with its slot
        rows. ``decide`` must be pure and quick (it runs while other claims
        wait); whatever it raises (a policy or allocator refusal) propagates
        unchanged and nothing is written. Raises ``ServerHasLease`` if the
        server already holds a lease, ``DoubleGrant`` if the decision overlaps
        a held lease's memory slices.
        """
        with self._write() as connection:
            lock_claims(connection)
            decision, now = self._decide(connection, request, decide)
            lease = new_lease(request, decision, now)
            insert_lease(connection, lease)
        return lease

    def would_claim(self, request: LeaseRequest, decide: Decide) -> Grant:
        """What :meth:`claim` would grant ``request`` now, or what it would raise, from
        the same view of the ledger (the budgets' past leases and extra hours
        included); writes nothing. For a spawn that joins the wait list rather than
        claim before others: whether waiting can serve it at all."""
        with self._read() as connection:
            return self._decide(connection, request, decide)[0]

    def _decide(self, connection: Connection, request: LeaseRequest, decide: Decide
                ) -> tuple[Grant, datetime]:
        """``decide``'s grant for ``request`` on what ``connection`` reads, and the time
        it was decided at."""
        held = self._held(connection)
        # Read after the held leases: a release they show committed, and so read its
        # time, before this one; the history never shows one slot held twice.
        now = self._now()
        for lease in held:
            if (lease.user, lease.server_name) == (request.user, request.server_name):
                raise ServerHasLease(lease)
        past, extras = self.usage.book(connection, now)
        decision = decide(LedgerView(request=request, leases=tuple(held), now=now,
                                     past=past, extras=extras, holds=read_holds(connection)))
        if not isinstance(decision, Grant):
            raise InvalidDecision(
                f"decide() must return a Grant, it returned {type(decision).__name__}"
            )
        return decision, now

    # -- lifecycle --------------------------------------------------------------

    def record_instance(self, lease_id: str, *, mig_uuid: str, gi_id: int, ci_id: int) -> Lease:
        """Store the instance just created for a dynamic lease, before the server starts.

        Call it right after creating the GPU/compute instance: if the start then
        fails or the hub dies, whoever releases the lease (the spawner, or the
        slice service's reconciler) knows which instance to destroy. Raises
        ``LeaseStateError`` if the lease was released meanwhile: destroy the
        instance you hold, nobody else will.
        """
        learnt = {"mig_uuid": mig_uuid, "gi_id": gi_id, "ci_id": ci_id}
        with self._write() as connection:
            lease = self._lock_startable(connection, lease_id, "record an instance")
            return update(connection, lease, **self._new_facts(lease, learnt))

    def activate(
        self,
        lease_id: str,
        *,
        mig_uuid: str | None = None,
        gi_id: int | None = None,
        ci_id: int | None = None,
        node: str | None = None,
        pod: str | None = None,
        server_url: str | None = None,
        pod_uid: str | None = None,
        holder_host: str | None = None,
        holder_pid: int | None = None,
        holder_start: int | None = None,
    ) -> Lease:
        """Mark the lease's server as started, recording what the start learnt.

        Dynamic mode passes the created instance (``mig_uuid``, ``gi_id``,
        ``ci_id``) unless ``record_instance`` did; Kubernetes passes
        ``node``/``pod`` and ``pod_uid`` (the holder, see docs/ledger.md); every
        spawner passes the server's internal ``server_url``. A local server's process
        is its holder (``holder_host``, ``holder_pid`` and ``holder_start``, its start
        time in clock ticks since boot, given together): whoever later releases the
        lease (a restarted hub, the slice service) stops that process first. It is
        recorded even when the other facts are refused, since it runs either way.
        Calling it again on an active lease is harmless.
        Raises ``LeaseStateError`` if the lease is being or has been released
        (the server must then be stopped), and ``LeaseNotFound`` for an unknown id.
        """
        holder = {"holder_host": holder_host, "holder_pid": holder_pid,
                  "holder_start": holder_start}
        if None in holder.values():
            if any(value is not None for value in holder.values()):
                raise ValueError("holder_host, holder_pid and holder_start go together")
            holder = {}
        now = self._now()
        learnt = {"mig_uuid": mig_uuid, "gi_id": gi_id, "ci_id": ci_id, "node": node, "pod": pod,
                  "server_url": server_url, "holder_pod_uid": pod_uid}
        with self._write() as connection:
            lease = self._lock_startable(connection, lease_id, "become active")
            try:
                facts = self._new_facts(lease, learnt)
            except LeaseStateError as e:
                refused = e
                update(connection, lease, **holder)
            else:
                return move(
                    connection,
                    lease,
                    LeaseState.ACTIVE,
                    started_at=lease.started_at or now,
                    last_activity_at=lease.last_activity_at or now,
                    **holder,
                    **facts,
                )
        raise refused

    def _lock_startable(self, connection: Connection, lease_id: str, doing: str) -> Lease:
        lease = lock_lease(connection, lease_id)
        if lease is None:
            raise LeaseNotFound(lease_id)
        if lease.state not in (LeaseState.CLAIMED, LeaseState.ACTIVE):
            raise LeaseStateError(
                f"lease {lease.id} of server {lease.server} is {lease.state} "
                f"({lease.release_code}); it cannot {doing}. Stop the server: "
                "its slice is being or has been given back.",
                lease,
            )
        return lease

    @staticmethod
    def _new_facts(lease: Lease, learnt: dict[str, Any]) -> dict[str, Any]:
        """The given (non-None) facts; refuses to overwrite a different recorded value."""
        given = {key: value for key, value in learnt.items() if value is not None}
        changed = [key for key, value in given.items() if getattr(lease, key) not in (None, value)]
        if changed:
            raise LeaseStateError(
                f"lease {lease.id} already records "
                + ", ".join(f"{key}={getattr(lease, key)!r}" for key in changed)
                + f"; refusing to overwrite with {', '.join(repr(given[k]) for k in changed)}",
                lease,
            )
        return given

    def record_purpose(self, lease_id: str, purpose: str | None) -> Lease | None:
        """Record what the server is for (already checked and cleaned by
        :func:`mig_spawner.core.purpose.clean_purpose`). ``None`` if released or unknown."""
        with self._write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            return update(connection, lease, purpose=purpose)

    def end_for(self, lease_id: str, code: ReleaseCode | str,
                detail: str | None = None) -> Lease | None:
        """Record why a held lease is about to end, before its server is stopped by
        someone else (the slice service stops a server whose budget is spent through
        the hub): the release that follows keeps this code, as it keeps the first one
        given. The lease stays as it is otherwise. ``None`` if released or unknown."""
        code, detail = release_code(code), clean_text(detail)
        with self._write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            if lease.release_code is not None:
                return lease
            return update(connection, lease, release_code=code, release_detail=detail)

    def begin_release(
        self, lease_id: str, code: ReleaseCode | str, detail: str | None = None, *,
        held_by: str | None = None,
    ) -> Lease | None:
        """Mark a lease ``releasing``: it keeps its slice until ``release`` (e.g. while a
        dynamic instance is destroyed, or a holder is in the way and the give-back is
        retried).

        ``code`` (and the free-text ``detail``) say why it ends; the first code given is
        kept. ``held_by`` says in plain words what still holds the slice (for the user
        who starts that server again); a lease already releasing gets the newer one.
        ``None`` if released or unknown.
        """
        code, detail, held_by = release_code(code), clean_text(detail), clean_text(held_by)
        with self._write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            why = first_why(lease, code, detail)
            if (lease.state, lease.held_by) == (LeaseState.RELEASING, held_by) and why == {
                    "release_code": lease.release_code, "release_detail": lease.release_detail}:
                return lease
            return move(connection, lease, LeaseState.RELEASING, held_by=held_by, **why)

    def release(self, lease_id: str, code: ReleaseCode | str,
                detail: str | None = None) -> Lease | None:
        """Free the lease's slice; the row stays as history.

        Returns the released lease, or ``None`` when there was nothing to do
        (already released, or an id this ledger never issued), so stop paths
        and reconcilers can call it without checking first. The first code given
        (here or to ``begin_release``) and its detail are the ones recorded.
        """
        code, detail = release_code(code), clean_text(detail)
        now = self._now()
        with self._write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            free_slots(connection, lease)
            self._tx.announce(connection)  # for the grant loops (ledger/changes.py)
            return move(connection, lease, LeaseState.RELEASED, released_at=now,
                              held_by=None, **first_why(lease, code, detail))

    # -- change notes for the grant loops (ledger/changes.py) ---------------------

    def change_mark(self) -> tuple[int, ...]:
        """Numbers that move when a slice is released or the wait list changes: leases
        no longer held, the newest wait entry, entries waiting (indexed counts)."""
        query = select(
            select(func.count()).select_from(leases)
            .where(leases.c.state.not_in(HELD_STATES)).scalar_subquery(),
            select(func.coalesce(func.max(waits.c.id), 0)).scalar_subquery(),
            select(func.count()).select_from(waits)
            .where(waits.c.state == WaitState.WAITING).scalar_subquery(),
            # A layout change that ends gives its held slices back.
            select(func.count()).select_from(layout_changes)
            .where(layout_changes.c.state.in_((PlanState.DONE, PlanState.FAILED)))
            .scalar_subquery(),
        )
        with self._read() as connection:
            return tuple(connection.execute(query).one())

    def watch_changes(self) -> ChangeWatch:
        """A watch on releases and line changes made by other processes: PostgreSQL
        ``LISTEN`` (psycopg2), SQLite's data version, else the :meth:`change_mark`."""
        with self._tx.database():
            if self.dialect == "postgresql" and self._engine.dialect.driver == "psycopg2":
                return PostgresChanges(self._engine, self._origin)
            if self.dialect == "sqlite":
                return SqliteChanges(self._engine, self.change_mark)
            return MarkChanges(self.change_mark)

    # -- queries ------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        """One lease by id, held or not."""
        with self._read() as connection:
            found = select_leases(connection, leases.c.id == lease_id)
        return found[0] if found else None

    def active(self, host: str | None = None) -> list[Lease]:
        """Leases that hold a slice now (claimed, active or releasing), oldest first."""
        with self._read() as connection:
            if host is None:
                return self._held(connection)
            return select_leases(connection, HELD, leases.c.host == host)

    def active_for_server(self, user: str, server_name: str = "") -> Lease | None:
        """The lease a server holds now, if any (at most one, by construction)."""
        with self._read() as connection:
            row = connection.execute(
                SERVER_LEASE, {"user": user, "server_name": server_name}).first()
        return None if row is None else to_lease(row)

    def expired(self, now: datetime | None = None) -> list[Lease]:
        """Held leases whose ``expires_at`` (max session age) has passed."""
        now = now or self._now()
        require_aware("now", now)
        with self._read() as connection:
            return select_leases(
                connection,
                leases.c.state.in_(HELD_STATES),
                leases.c.expires_at.is_not(None),
                leases.c.expires_at <= now,
            )

    def history(
        self,
        since: datetime | None = None,
        *,
        user: str | None = None,
        group: str | None = None,
    ) -> list[Lease]:
        """Every lease, held or released, oldest claim first.

        ``since`` keeps the leases that held a slice at any moment from then on
        (still held, or released at or after it): the set a usage report over
        ``[since, now]`` needs.
        """
        where: list[ColumnElement[bool]] = []
        if since is not None:
            require_aware("since", since)
            where.append(or_(leases.c.released_at.is_(None), leases.c.released_at >= since))
        if user is not None:
            where.append(leases.c.user_name == user)
        if group is not None:
            where.append(leases.c.group_name == group)
        with self._read() as connection:
            return select_leases(connection, and_(True, *where))
