"""Plain, immutable views of what the JupyterHub REST API and a Jupyter server report.

The client turns JSON into these so that the sweep logic above it never touches
raw API models, and so that it can be tested with hand-made values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


def parse_timestamp(value: str | None) -> datetime | None:
    """Parse an ISO 8601 timestamp as JupyterHub and Jupyter Server write it.

    Both write UTC with a trailing ``Z``; a naive value is taken as UTC, as
    JupyterHub itself does. ``None`` (a server that never reported activity)
    stays ``None``.
    """
    if not value:
        return None
    when = datetime.fromisoformat(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when


@dataclass(frozen=True)
class HubServer:
    """One (default or named) server of a user, as the hub lists it."""

    user: str
    name: str
    url: str
    full_url: str | None
    ready: bool
    pending: str | None
    started: datetime | None
    last_activity: datetime | None

    @property
    def key(self) -> tuple[str, str]:
        """``(user, server_name)``: how the ledger and the hub both identify a server."""
        return (self.user, self.name)

    @property
    def label(self) -> str:
        """``user`` or ``user/name``, for logs."""
        return f"{self.user}/{self.name}" if self.name else self.user


@dataclass(frozen=True)
class HubUser:
    """A hub user with the groups they belong to and their servers."""

    name: str
    groups: tuple[str, ...]
    servers: tuple[HubServer, ...]


@dataclass(frozen=True)
class Kernel:
    """A kernel as ``GET /api/kernels`` on a Jupyter server reports it."""

    id: str
    name: str
    execution_state: str
    last_activity: datetime | None
    connections: int


@dataclass(frozen=True)
class ServerStatus:
    """``GET /api/status`` of a Jupyter server: its own view of its activity."""

    started: datetime | None
    last_activity: datetime | None
    connections: int
    kernels: int


def user_from_model(model: Mapping[str, Any]) -> HubUser:
    """Build a :class:`HubUser` from a user model of ``GET /hub/api/users``.

    Servers appear only when the token has ``read:servers``; without it the
    user has no servers here, which the service reports at start-up.
    """
    name = model["name"]
    servers = tuple(
        HubServer(
            user=name,
            name=server_name,
            url=server.get("url") or "",
            full_url=server.get("full_url"),
            ready=bool(server.get("ready")),
            pending=server.get("pending"),
            started=parse_timestamp(server.get("started")),
            last_activity=parse_timestamp(server.get("last_activity")),
        )
        for server_name, server in (model.get("servers") or {}).items()
    )
    return HubUser(
        name=name,
        groups=tuple(model.get("groups") or ()),
        servers=servers,
    )


def kernel_from_model(model: Mapping[str, Any]) -> Kernel:
    """Build a :class:`Kernel` from one item of ``GET /api/kernels``."""
    return Kernel(
        id=model["id"],
        name=model.get("name", ""),
        execution_state=model.get("execution_state", "unknown"),
        last_activity=parse_timestamp(model.get("last_activity")),
        connections=int(model.get("connections") or 0),
    )


def status_from_model(model: Mapping[str, Any]) -> ServerStatus:
    """Build a :class:`ServerStatus` from ``GET /api/status``."""
    return ServerStatus(
        started=parse_timestamp(model.get("started")),
        last_activity=parse_timestamp(model.get("last_activity")),
        connections=int(model.get("connections") or 0),
        kernels=int(model.get("kernels") or 0),
    )


@dataclass(frozen=True)
class PeopleActivity:
    """What mig-spawner's single-user extension saw of the people using a server
    (the ``people`` of ``GET <server>/mig-spawner/probe``; see :mod:`mig_spawner.singleuser`)."""

    #: When a JupyterLab page of this server last reported; ``None``: none ever did.
    page_seen: datetime | None
    #: The latest typing, click or scroll in such a page (opening it counts).
    interaction: datetime | None
    #: The latest terminal input or output.
    terminal: datetime | None


def people_activity_from_model(model: Mapping[str, Any]) -> PeopleActivity:
    """Build a :class:`PeopleActivity` from the ``people`` of ``GET
    <server>/mig-spawner/probe``."""
    return PeopleActivity(
        page_seen=parse_timestamp(model.get("page_seen")),
        interaction=parse_timestamp(model.get("interaction")),
        terminal=parse_timestamp(model.get("terminal")),
    )


@dataclass(frozen=True)
class ServerLook:
    """Everything the slice service reads of a server with mig-spawner's single-user
    extension, in one answer (``GET <server>/mig-spawner/probe``)."""

    kernels: tuple[Kernel, ...]
    status: ServerStatus
    people: PeopleActivity


def look_from_model(model: Mapping[str, Any]) -> ServerLook:
    """Build a :class:`ServerLook` from ``GET <server>/mig-spawner/probe``."""
    return ServerLook(
        kernels=tuple(kernel_from_model(k) for k in model["kernels"]),
        status=status_from_model(model["status"]),
        people=people_activity_from_model(model["people"]),
    )


@dataclass(frozen=True)
class KernelsShutDown:
    """What a server did with the kernels the service asked it to shut down
    (``POST <server>/mig-spawner/cull``), by kernel id."""

    #: Shut down.
    shut_down: tuple[str, ...] = ()
    #: Left running: in use since the service looked (activity, busy, a client).
    kept: tuple[str, ...] = ()
    #: No such kernel here: gone since the look, or never this server's.
    unknown: tuple[str, ...] = ()
    #: The shutdown failed (the server logged why).
    failed: tuple[str, ...] = ()


def shut_down_from_model(model: Mapping[str, Any]) -> KernelsShutDown:
    """Build a :class:`KernelsShutDown` from ``POST <server>/mig-spawner/cull``."""
    return KernelsShutDown(**{field: tuple(str(k) for k in model.get(field) or ())
                              for field in ("shut_down", "kept", "unknown", "failed")})
