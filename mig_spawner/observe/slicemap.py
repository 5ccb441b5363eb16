"""The admin slice map: every GPU drawn as its memory slices, the instances laid on them.

Three views of one :class:`~mig_spawner.observe.slice_state.SliceMap`, all for hub
admins only (JupyterHub OAuth, custom scope ``custom:mig-spawner:slicemap``):

``<prefix>slices``
    the map page: one bar per GPU, instances coloured by state (free, leased, idle,
    orphan) with user, profile, age and idle time; it refreshes itself from the JSON;
``<prefix>slices/table``
    the same as plain HTML tables (no JavaScript; reloads itself);
``<prefix>slices.json``
    the data, for scripts and for the map page.

For a Kubernetes hub the three views add one section per GPU node of the cluster: its
MIG profiles, how many are free, and how many the cluster reports unhealthy and why (the
device plugin left them out of ``allocatable``; the DRA driver tainted them or took them
out of its ResourceSlice). Node and profile names only: who holds a node's slices is in
the pods, not shown here.

The slice service mounts them with :func:`slicemap_routes`; the hub grants the scope
to admins (see docs/operations.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import template, web
from tornado.log import app_log

from mig_spawner.kube.availability import ClusterReadError
from mig_spawner.kube.cluster import ClusterSlices, unhealthy_reason, unhealthy_words
from mig_spawner.observe.slice_state import SLICE_STATES, SliceMap, SliceRow

#: The custom scope a user's OAuth token must carry to see the slice map.
SLICEMAP_SCOPE = "custom:mig-spawner:slicemap"
SLICEMAP_SCOPE_DESCRIPTION = "See every MIG slice, who holds it, its age and idle time."
TEMPLATES = Path(__file__).with_name("templates")
_LOADER = template.Loader(str(TEMPLATES))

Snapshot = Callable[[], SliceMap]
#: The cluster's GPU nodes as the hub reads them (a Kubernetes hub's map only);
#: raises :class:`~mig_spawner.kube.availability.ClusterReadError`.
ClusterRead = Callable[[], Awaitable[ClusterSlices]]


def cluster_nodes_json(slices: ClusterSlices) -> list[dict[str, Any]]:
    """Each offered GPU node of a cluster: per MIG profile, how many it has, how many
    are free, and how many the cluster reports unhealthy; ``unhealthy`` says why in
    words (None: none is)."""
    return [
        {
            "name": node.name,
            "model": node.model_key,
            "strategy": node.strategy,
            "profiles": [
                {"profile": p, "slices": node.allocatable.get(p, 0), "free": node.free(p),
                 "unhealthy": node.unhealthy.get(p, 0)}
                for p in sorted({*node.allocatable, *node.unhealthy})
            ],
            "unhealthy": (f"{unhealthy_words(node)}: {unhealthy_reason(node)}"
                          if node.unhealthy else None),
        }
        for node in slices.nodes
    ]


def nodes_json(cluster: ClusterSlices | str) -> dict[str, Any]:
    """``nodes`` (:func:`cluster_nodes_json`) and ``nodes_error`` (why the cluster
    could not be read, or None) of a Kubernetes hub's map."""
    if isinstance(cluster, str):
        return {"nodes": [], "nodes_error": cluster}
    return {"nodes": cluster_nodes_json(cluster), "nodes_error": None}


def slicemap_json(view: SliceMap, cluster: ClusterSlices | str | None = None
                  ) -> dict[str, Any]:
    """The slice map as JSON-ready data (what ``slices.json`` returns). ``cluster``: a
    Kubernetes hub's GPU nodes (``nodes``), or why they could not be read
    (``nodes_error``); None: no ``nodes`` key (a local hub)."""
    nodes = nodes_json(cluster) if cluster is not None else {}
    return {
        "host": view.host,
        "taken_at": view.taken_at.isoformat(),
        "idle_after": view.idle_after,
        "states": list(SLICE_STATES),
        "counts": {state: view.count(state) for state in SLICE_STATES},
        "gpus": [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "product": gpu.product,
                "model": gpu.model_key,
                "memory_slices": gpu.memory_slices,
                "mig_enabled": gpu.mig_enabled,
                "free_memory_slices": list(gpu.free_memory_slices),
                "change": gpu.change,
                "held_slices": list(gpu.held_slices),
                "fault": gpu.fault,
                "faulty_slices": list(gpu.faulty_slices),
                "slices": [_row_json(row) for row in gpu.slices],
            }
            for gpu in view.gpus
        ],
        "groups": [asdict(group) for group in view.groups],
        "lost": [_row_json(row) for row in view.lost],
        "waiting": [{**asdict(w), "since": w.since.isoformat(), "next": w.next}
                    for w in view.waiting],
        **nodes,
    }


#: A slice row's fields, copied as they are (``asdict``'s deep copy of each value was
#: half the map's time at 3,000 running servers); its warnings are converted apart.
_ROW_FIELDS = tuple(f.name for f in fields(SliceRow))


def _row_json(row: SliceRow) -> dict[str, Any]:
    # Memory is formatted here, once, so the page shows what every other screen shows.
    # Plain fields are copied as they are; the pending warnings are rows of their own.
    return {**{name: getattr(row, name) for name in _ROW_FIELDS},
            "warnings": [asdict(w) for w in row.warnings], "server": row.server,
            "memory_text": row.memory_text, "memory_total_text": row.memory_total_text,
            "next_text": row.next_text, "warnings_text": row.warnings_text}


def _script_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>`` break-out)."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace(
        "&", "\\u0026")


def human_seconds(seconds: float | None) -> str:
    """``"3d 4h"``, ``"2h 05m"``, ``"7m"``, ``"40s"``; ``"-"`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d {s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m"
    return f"{s}s"


class SliceMapHandler(HubOAuthenticated, web.RequestHandler):
    """Base of the three views: admin check through the hub, and the snapshot."""

    def initialize(self, snapshot: Snapshot, refresh_seconds: int = 10,
                   cluster: ClusterRead | None = None) -> None:
        self._snapshot = snapshot
        self._refresh = refresh_seconds
        self._cluster = cluster

    @property
    def hub_scopes(self) -> set[str]:
        """Only tokens with the slice map scope pass, whatever the service's defaults."""
        return {SLICEMAP_SCOPE}

    def set_default_headers(self) -> None:
        # Who holds which slice is not for caches or other sites' frames.
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Frame-Options", "DENY")

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if status_code == 403:
            self.finish(
                "403: the MIG slice map is for hub admins. Ask an admin to grant you the "
                f"'{SLICEMAP_SCOPE}' scope (a role in c.JupyterHub.load_roles), then log in "
                "again.")
            return
        super().write_error(status_code, **kwargs)

    async def snapshot(self) -> SliceMap:
        """The slice map, read off the event loop (NVML and the ledger block)."""
        return await asyncio.get_running_loop().run_in_executor(None, self._snapshot)

    async def cluster_view(self) -> ClusterSlices | str | None:
        """The cluster's GPU nodes where the hub spawns on Kubernetes, or why they
        cannot be read now (in words: the details go to the log); None: a local hub."""
        if self._cluster is None:
            return None
        try:
            return await self._cluster()
        except ClusterReadError as e:
            app_log.warning("slice map: cannot read the cluster's nodes: %s", e)
            return "cannot read the cluster's GPU nodes now"

    async def data(self) -> dict[str, Any]:
        """:func:`slicemap_json` of the snapshot, with the cluster's nodes where the hub
        spawns on Kubernetes (a cluster that cannot be read: said, the rest drawn)."""
        view = await self.snapshot()
        return slicemap_json(view, await self.cluster_view())


class SliceMapPage(SliceMapHandler):
    """The drawn map; its script redraws from ``slices.json`` every ``refresh_seconds``."""

    @web.authenticated
    async def get(self) -> None:
        data = await self.data()
        # The page's fetch() is a CORS-mode request: JupyterHub accepts its auth cookie
        # only with the XSRF token (plain navigations need none).
        self.finish(_LOADER.load("slicemap.html").generate(
            data_json=_script_json(data), refresh=self._refresh, user=self.current_user,
            json_url="slices.json", table_url="slices/table", states=SLICE_STATES,
            xsrf=self.xsrf_token.decode(),
        ))


class SliceTablePage(SliceMapHandler):
    """The map as a table, rendered on the server; reloads every ``refresh_seconds``."""

    @web.authenticated
    async def get(self) -> None:
        view = await self.snapshot()
        cluster = await self.cluster_view()
        self.finish(_LOADER.load("slicetable.html").generate(
            view=view, refresh=self._refresh, human=human_seconds, user=self.current_user,
            map_url="../slices", nodes=None if cluster is None else nodes_json(cluster),
        ))


class SliceMapJson(SliceMapHandler):
    """The slice map as JSON."""

    @web.authenticated
    async def get(self) -> None:
        data = await self.data()
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))


def slicemap_routes(prefix: str, snapshot: Snapshot, *, refresh_seconds: int = 10,
                    oauth_callback: bool = True, cluster: ClusterRead | None = None
                    ) -> list[Any]:
    """Tornado routes of the three views under ``prefix`` (the service prefix, e.g.
    ``/services/mig-slices/``), a redirect from ``prefix`` itself to the map, plus the
    OAuth callback at ``prefix + "oauth_callback"`` unless the application already has one.

    Authentication uses ``HubOAuth.instance()``, configured from the ``JUPYTERHUB_*``
    environment the hub gives a managed service (client ID, callback URL, API token).
    ``cluster``: a Kubernetes hub's reader of its GPU nodes (the map and the JSON add
    them).
    """
    if refresh_seconds < 1:
        raise ValueError(f"refresh_seconds must be 1 or more, got {refresh_seconds}")
    root = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    args = {"snapshot": snapshot, "refresh_seconds": refresh_seconds}
    map_args = {**args, "cluster": cluster}
    routes: list[Any] = [
        (root + "slices", SliceMapPage, map_args),
        (root + "slices/table", SliceTablePage, map_args),
        (root + "slices.json", SliceMapJson, map_args),
        # The hub's "Services" menu links to the service's root: show the map there.
        (root, web.RedirectHandler, {"url": root + "slices"}),
    ]
    if oauth_callback:
        routes.append((root + "oauth_callback", HubOAuthCallbackHandler))
    return routes
