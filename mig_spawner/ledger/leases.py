"""The leases store: claims, a lease's life to its release, and what held what when.

``ledger.leases``. A claim runs ONE transaction under the claim lock: it reads every
held lease and what the view adds (:class:`~mig_spawner.ledger.view.ClaimView`: the
budgets' past, every hold), calls the caller's pure ``decide`` and writes its grant
with one slot row per memory slice, whose keys are the backstop against a double grant
(docs/ledger.md, "Why a slice can never be granted twice"). A lease's state is written
in one guarded place, :func:`~mig_spawner.ledger.rows.move`. Code outside the ledger
ends a lease through :class:`mig_spawner.release.Releaser`, never by calling
:meth:`Leases.release` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, and_, or_

from mig_spawner.core.refusal import Refused

from .errors import LeaseNotFound, LeaseStateError, ServerHasLease
from .models import leases
from .records import (
    Grant,
    Lease,
    LeaseRequest,
    LeaseState,
    LedgerView,
    ReleaseCode,
    check_grant,
    require_aware,
)
from .rows import (
    HELD,
    SERVER_LEASE,
    clean_text,
    first_why,
    free_slots,
    insert_lease,
    lock_lease,
    move,
    new_facts,
    new_lease,
    release_code,
    select_leases,
    to_lease,
    update,
)
from .transactions import Transactions
from .view import ClaimView

#: The pure callback a claim runs inside its transaction: policy check plus allocator.
Decide = Callable[[LedgerView], Grant]


class Leases:
    """The ledger's leases store (see the module docstring)."""

    def __init__(self, tx: Transactions, view: ClaimView) -> None:
        self._tx = tx
        self._view = view

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
        with self._tx.claims() as connection:
            decision, now = self._decide(connection, request, decide)
            lease = new_lease(request, decision, now)
            insert_lease(connection, lease)
        return lease

    def claim_many(self, claims: Sequence[tuple[LeaseRequest, Decide]]
                   ) -> list[Lease | Refused | ServerHasLease]:
        """Claim for each ``(request, decide)`` in turn, in ONE transaction under the
        claim lock (a claim pass: the claims that arrived together): the held leases,
        the budgets' past and the holds are read once, and each decision sees the leases
        the ones before it granted as held, as the grant pass counts its grants
        (nothing is read again that this pass just wrote). Returns each claim's lease,
        or what refused it (``decide``'s :class:`Refused`, :class:`ServerHasLease`);
        anything else (the database, a double grant the keys caught) rolls the whole
        pass back and is raised: nothing was written."""
        with self._tx.claims() as connection:
            held = list(self._view.held(connection))  # a copy: this pass adds to it
            now = self._tx.now()  # after the held leases, as a single claim reads it
            books = self._view.books(connection, now)
            holding = {(lease.user, lease.server_name): lease for lease in held}
            found: list[Lease | Refused | ServerHasLease] = []
            for request, decide in claims:
                if (had := holding.get((request.user, request.server_name))) is not None:
                    found.append(ServerHasLease(had))
                    continue
                try:
                    decision = check_grant(decide(LedgerView(
                        request=request, leases=tuple(held), now=now, **books)))
                except Refused as refusal:
                    found.append(refusal)
                    continue
                lease = new_lease(request, decision, now)
                insert_lease(connection, lease)
                held.append(lease)
                holding[request.user, request.server_name] = lease
                found.append(lease)
        return found

    def would_claim(self, request: LeaseRequest, decide: Decide) -> Grant:
        """What :meth:`claim` would grant ``request`` now, or what it would raise, from
        the same view of the ledger (the budgets' past leases and extra hours
        included); writes nothing. For a spawn that joins the wait list rather than
        claim before others: whether waiting can serve it at all."""
        with self._tx.read() as connection:
            return self._decide(connection, request, decide)[0]

    def _decide(self, connection: Connection, request: LeaseRequest, decide: Decide
                ) -> tuple[Grant, datetime]:
        """``decide``'s grant for ``request`` on what ``connection`` reads, and the time
        it was decided at."""
        held = self._view.held(connection)
        # Read after the held leases: a release they show committed, and so read its
        # time, before this one; the history never shows one slot held twice.
        now = self._tx.now()
        for lease in held:
            if (lease.user, lease.server_name) == (request.user, request.server_name):
                raise ServerHasLease(lease)
        view = LedgerView(request=request, leases=tuple(held), now=now,
                          **self._view.books(connection, now))
        return check_grant(decide(view)), now

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
        with self._tx.write() as connection:
            lease = self._lock_startable(connection, lease_id, "record an instance")
            return update(connection, lease, **new_facts(lease, learnt))

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
        now = self._tx.now()
        learnt = {"mig_uuid": mig_uuid, "gi_id": gi_id, "ci_id": ci_id, "node": node, "pod": pod,
                  "server_url": server_url, "holder_pod_uid": pod_uid}
        with self._tx.write() as connection:
            lease = self._lock_startable(connection, lease_id, "become active")
            try:
                facts = new_facts(lease, learnt)
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

    def record_purpose(self, lease_id: str, purpose: str | None) -> Lease | None:
        """Record what the server is for (already checked and cleaned by
        :func:`mig_spawner.core.purpose.clean_purpose`). ``None`` if released or unknown."""
        with self._tx.write() as connection:
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
        with self._tx.write() as connection:
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
        with self._tx.write() as connection:
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
        now = self._tx.now()
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            free_slots(connection, lease)
            self._tx.announce(connection)  # for the grant loops (ledger/changes.py)
            return move(connection, lease, LeaseState.RELEASED, released_at=now,
                        held_by=None, **first_why(lease, code, detail))

    # -- queries ------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        """One lease by id, held or not."""
        with self._tx.read() as connection:
            found = select_leases(connection, leases.c.id == lease_id)
        return found[0] if found else None

    def active(self, host: str | None = None) -> list[Lease]:
        """Leases that hold a slice now (claimed, active or releasing), oldest first."""
        with self._tx.read() as connection:
            if host is None:
                return self._view.held(connection)
            return select_leases(connection, HELD, leases.c.host == host)

    def active_for_server(self, user: str, server_name: str = "") -> Lease | None:
        """The lease a server holds now, if any (at most one, by construction)."""
        with self._tx.read() as connection:
            row = connection.execute(
                SERVER_LEASE, {"user": user, "server_name": server_name}).first()
        return None if row is None else to_lease(row)

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
        with self._tx.read() as connection:
            return select_leases(connection, and_(True, *where))
