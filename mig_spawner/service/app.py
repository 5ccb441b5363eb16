"""``mig-spawner-service``: the slice service, run by JupyterHub as a managed service.

It sweeps every ``cull_every`` seconds: shuts down idle kernels, stops idle or
over-age servers through the hub API (per the limits of the group each slice
is charged to), releases ledger leases whose server the hub no longer runs,
and reports MIG devices used outside any lease. It serves ``/health``,
``/metrics`` (with per-slice gauges) and, for hub admins, the slice map
(``slices``; docs/operations.md). ``jupyterhub_config.d/30-slice-service.py``
registers it with the hub: the command, its scopes, and the slice map's scope and
role (docs/culling.md)::

    c.JupyterHub.services.append({
        "name": "mig-slices",
        "command": ["mig-spawner-service", "--config-dir=/etc/jupyterhub/jupyterhub_config.d"],
        "url": "http://127.0.0.1:10101",
        "oauth_client_allowed_scopes": ["custom:mig-spawner:slicemap"],
        "oauth_no_confirm": True,
    })
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from typing import Any
from urllib.parse import urlparse

from tornado.httpserver import HTTPServer
from tornado.log import LogFormatter
from traitlets import Bool, Float, Int, Unicode, Union, default, validate
from traitlets.config import Application, Config

from mig_spawner import __version__, gpu, holder
from mig_spawner.config import (
    Finite,
    MIGPolicyConfig,
    MIGSettings,
    RightsizeConfig,
    is_kube,
    load_config_files,
    misplaced_settings,
    misspelt_sections,
    section_problems,
)
from mig_spawner.core.durations import DurationError, parse_duration
from mig_spawner.core.policy import PolicyError, PolicySet
from mig_spawner.gpu.gpm import GpmSampler
from mig_spawner.health import FaultWatch
from mig_spawner.hub.client import HubClient, HubError
from mig_spawner.hub.groups import hub_db_url
from mig_spawner.kube.availability import ClusterAvailability
from mig_spawner.kube.cluster import ClusterSlices
from mig_spawner.kube.pods import connect_api
from mig_spawner.layout import LayoutApplier
from mig_spawner.ledger import Ledger
from mig_spawner.observe.gpu_metrics import SliceCollector
from mig_spawner.observe.slice_state import activity_resolution
from mig_spawner.observe.slicemap import ClusterRead, slicemap_routes
from mig_spawner.observe.source import SliceSource
from mig_spawner.service.handlers import make_web_app
from mig_spawner.service.lifeline import call_when_orphaned
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper, SweepReport

#: What the service's token needs, and why: list servers with their groups and
#: activity, stop them, and reach their kernels through the proxy.
REQUIRED_SCOPES = (
    "list:users", "read:users:groups", "read:users:activity", "read:servers",
    "delete:servers", "access:servers",
)


def missing_scopes(granted: set[str]) -> list[str]:
    """Required scopes the token lacks. A filtered grant (``read:servers!group=x``)
    counts as granted: the admin chose to limit the service to some users."""
    return [
        scope for scope in REQUIRED_SCOPES
        if scope not in granted and not any(g.startswith(scope + "!") for g in granted)
    ]


def _duration_trait(default_value: float, help: str) -> Union:
    """Seconds as a number, or a duration string such as ``"5m"`` (validated to seconds)."""
    return Union([Float(), Unicode()], default_value=default_value, help=help).tag(config=True)


def _environment_default(trait: str, variable: str, fallback: str = "") -> Any:
    """A traitlets dynamic default for ``trait``: environment variable ``variable``,
    else ``fallback``, read when the trait is first used (not at import)."""

    @default(trait)
    def from_environment(self: Any) -> str:
        return os.environ.get(variable, fallback)

    return from_environment


class SliceServiceApp(Application):
    """Cull idle kernels and servers per group policy, so MIG slices return to the pool."""

    name = "mig-spawner-service"
    version = __version__
    description = __doc__
    classes = [MIGSettings, MIGPolicyConfig]

    cull_every = _duration_trait(
        60.0,
        """How often to sweep, in seconds or as a duration ("1m").

        Culling is at most this late: a limit of 30 minutes with a sweep every
        minute stops a server between 30 and 31 minutes of idleness.""",
    )
    orphan_grace = _duration_trait(
        300.0,
        """How long a held lease may have no server running on the hub before the
        service releases it (seconds or a duration such as "5m").

        Covers a spawn the hub has not recorded yet and a hub restart; a lease
        is also never released within this time of its claim.""",
    )
    concurrency = Int(
        10,
        help="""Most requests in flight at once, to the hub and to servers together.

        The same meaning as jupyterhub-idle-culler's ``--concurrency``: higher sweeps
        faster, lower spares the hub.""",
    ).tag(config=True)
    request_timeout = Finite(
        60.0, positive=True,
        help="Seconds before one request to the hub or a server is given up and retried.",
    ).tag(config=True)
    retries = Int(
        4, min=0,
        help="""Retries of a request that got a 5xx answer or no connection, with
        exponential backoff (``retry_backoff`` doubling each time, at most 30 s).""",
    ).tag(config=True)
    retry_backoff = Finite(
        0.5, min=0.0,
        help="Seconds before the first retry of a failed request; doubles after each.",
    ).tag(config=True)
    page_size = Int(
        0, min=0, help="Users per page of ``GET /hub/api/users``; 0 uses the hub's default."
    ).tag(config=True)
    usage_sample_interval = Finite(
        60.0, positive=True,
        help="""Seconds between two usage samples of one leased slice (memory held, SM
        activity) in the ledger's ``lease_samples``, from which right-sizing reads each
        session's peak, p95 and time active. Sampled at the sweeps, so never finer than
        ``cull_every``; one row per held slice per interval.""",
    ).tag(config=True)
    usage_sample_retention = _duration_trait(
        30 * 86400.0,
        """How long raw usage samples are kept (seconds or a duration such as "30d";
        "never" keeps them all). Once an hour the service deletes the samples older
        than this of every released lease, keeping each lease's summary (peak, p95,
        samples, time active) forever in ``lease_usage`` first: right-sizing and the
        report read the same figures after. A held lease's samples are never deleted.""",
    )
    dry_run = Bool(
        False,
        help="Log and count what would be culled and released, but do nothing.",
    ).tag(config=True)
    probe_servers = Bool(
        True,
        help="""Look inside servers (``/api/kernels`` and ``/api/status`` with
        ``no_track_activity``) before stopping them for idleness, and to apply
        ``kernel_idle_timeout``. Needs the ``access:servers`` scope.

        False judges servers on the hub's activity data alone, like
        jupyterhub-idle-culler: cheaper, but a kernel busy in a long computation
        with no output then looks idle.""",
    ).tag(config=True)
    holder_stop_grace = Finite(
        holder.STOP_GRACE,
        help="""Seconds between SIGTERM and SIGKILL when the service stops a server
        process that the hub no longer tracks before releasing its orphan lease (as
        ``LocalProcessSpawner.term_timeout`` for the hub's own stops; set the two
        alike). Longer lets a server save its work; the slice stays held meanwhile.""",
    ).tag(config=True)
    apply_layouts = Bool(
        True,
        help="""Carry on the layout changes an admin began (``mig-spawner layout apply``,
        docs/layout.md) at each sweep: warn the holders of slices that must go, stop them
        at their group's ``drain_notice``, and apply every step that waits for nobody.
        False leaves them to ``mig-spawner layout apply --wait``.""",
    ).tag(config=True)
    layout_allow_reset = Bool(
        False,
        help="""A layout change that turns MIG on or off on an Ampere GPU (A100, A30)
        may reset that GPU once nothing runs on it. False: such a change fails, saying
        so.""",
    ).tag(config=True)
    release_orphans = Bool(
        True,
        help="""Release a lease whose server the hub has not run for ``orphan_grace``.
        False only reports such leases.""",
    ).tag(config=True)
    exit_with_hub = Bool(
        True,
        help="""When run by the hub as a managed service, exit once the hub process that
        started it is gone (killed outright, so it could not stop its services): the
        restarted hub starts a new one, and two services must not cull side by side.""",
    ).tag(config=True)
    config_dir = Unicode(
        "",
        help="""The hub's ``jupyterhub_config.d`` directory (or one config file).

        The service loads it to read the same ``c.MIGPolicyConfig`` group policies
        and ``c.MIGSettings`` (ledger, simulated GPUs) as the hub;
        ``c.SliceServiceApp.*`` settings there apply too (command-line options win).""",
    ).tag(config=True)
    hub_api_url = Unicode(
        help="The hub's REST API URL. Default: $JUPYTERHUB_API_URL, set by the hub."
    ).tag(config=True)
    api_token = Unicode(
        help="Token for the hub API. Default: $JUPYTERHUB_API_TOKEN, set by the hub."
    ).tag(config=True, secret=True)
    proxy_url = Unicode(
        help="""Origin of the hub's proxy (``http://127.0.0.1:8000``), to reach servers
        at ``/user/<name>/`` where the hub gives no ``full_url`` for them.

        Default: the origin of ``JupyterHub.public_url``, else of
        ``JupyterHub.bind_url``, from ``config_dir``.""",
    ).tag(config=True)
    service_url = Unicode(
        help="""Where to serve ``/health`` and ``/metrics``. Default:
        $JUPYTERHUB_SERVICE_URL (the ``url`` of the service in the hub config).
        Empty: no HTTP endpoints.""",
    ).tag(config=True)
    service_prefix = Unicode(
        help="URL prefix the proxy forwards (default: $JUPYTERHUB_SERVICE_PREFIX)."
    ).tag(config=True)
    slice_idle_after = _duration_trait(
        900.0,
        """A leased slice whose server shows no activity for this long is drawn as idle
        on the slice map and counted in ``mig_spawner_slices{state="idle"}``
        (seconds or a duration such as "15m").""",
    )
    slicemap = Bool(
        True,
        help="""Serve the admin slice map (``slices``, ``slices/table``, ``slices.json``)
        under the service prefix, to users whose token carries the
        ``custom:mig-spawner:slicemap`` scope (docs/operations.md). Needs the ledger
        and ``check_gpus``.""",
    ).tag(config=True)
    slicemap_refresh = Int(
        10, help="Seconds between redraws of an open slice map page (1 or more)."
    ).tag(config=True)
    check_gpus = Bool(
        True,
        help="""Read this host's MIG devices each sweep and report busy ones no lease
        holds (never killing anything). Turn off where the service runs off the GPU host.""",
    ).tag(config=True)
    aliases = {
        "config-dir": "SliceServiceApp.config_dir",
        "cull-every": "SliceServiceApp.cull_every",
        "concurrency": "SliceServiceApp.concurrency",
        "orphan-grace": "SliceServiceApp.orphan_grace",
        "ledger-url": "MIGSettings.ledger_url",
        "proxy-url": "SliceServiceApp.proxy_url",
        "url": "SliceServiceApp.hub_api_url",
        "simulate": "MIGSettings.simulate",
        "sim-state-file": "MIGSettings.sim_state_file",
        "log-level": "Application.log_level",
    }
    flags = {
        "dry-run": ({"SliceServiceApp": {"dry_run": True}}, "Decide and log, but cull nothing."),
        "no-probe": (
            {"SliceServiceApp": {"probe_servers": False}},
            "Judge servers on hub data alone; do not read kernels.",
        ),
    }

    # What JupyterHub tells a service it manages, through its environment.
    _default_hub_api_url = _environment_default("hub_api_url", "JUPYTERHUB_API_URL")
    _default_api_token = _environment_default("api_token", "JUPYTERHUB_API_TOKEN")
    _default_service_url = _environment_default("service_url", "JUPYTERHUB_SERVICE_URL")
    _default_service_prefix = _environment_default(
        "service_prefix", "JUPYTERHUB_SERVICE_PREFIX", "/")

    @default("proxy_url")
    def _default_proxy_url(self) -> str:
        hub = self.config.JupyterHub
        for url in (
            os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL"),
            hub.get("public_url"),
            hub.get("bind_url"),  # the proxy listens there when nothing is in front
        ):
            if url:
                return urlparse(str(url))._replace(path="", query="").geturl()
        return ""

    @property
    def shared(self) -> MIGSettings:
        """The ledger and GPU settings the hub's spawner reads too (``c.MIGSettings``,
        from ``config_dir`` and the command line)."""
        return MIGSettings(parent=self)

    @property
    def ledger_url(self) -> str:
        """The spawner's ledger: ``c.MIGSettings.ledger_url``, else the SQLite file
        beside the hub's SQLite database (``JupyterHub.db_url``), by the same rule."""
        return self.shared.ledger_location(hub_db_url(self.config))

    #: Durations that may be "never": an orphan grace (never release, only report),
    #: a sample retention (keep every sample).
    _MAY_BE_NEVER = ("orphan_grace", "usage_sample_retention")

    @validate("cull_every", "orphan_grace", "slice_idle_after", "usage_sample_retention")
    def _valid_duration(self, proposal: dict[str, Any]) -> float:
        name = proposal["trait"].name
        try:
            seconds = parse_duration(proposal["value"], unlimited_ok=name in self._MAY_BE_NEVER)
        except DurationError as e:
            raise ValueError(f"SliceServiceApp.{name}: {e}") from None
        return float("inf") if seconds is None else seconds

    # The least each number may be, and in what unit it is said.
    _MINIMUM = {"holder_stop_grace": "0 seconds", "concurrency": "1", "slicemap_refresh": "1"}

    @validate(*_MINIMUM)
    def _valid_minimum(self, proposal: dict[str, Any]) -> float:
        name = proposal["trait"].name
        least = self._MINIMUM[name]
        if proposal["value"] < float(least.split()[0]):
            raise ValueError(
                f"SliceServiceApp.{name} must be {least} or more, got {proposal['value']}"
            )
        return proposal["value"]

    # -- logging as jupyterhub-idle-culler does it --------------------------------

    _log_formatter_cls = LogFormatter

    @default("log_level")
    def _log_level_default(self) -> int:
        return logging.INFO

    @default("log_format")
    def _log_format_default(self) -> str:
        return (
            "%(color)s[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s]%(end_color)s"
            " %(message)s"
        )

    # -- wiring -------------------------------------------------------------------

    def initialize(self, argv: list[str] | None = None) -> None:
        """Parse the command line, then load ``config_dir`` under it; refuse (exit with
        one line per mistake) what the hub would refuse of these settings."""
        super().initialize(argv)
        if self.config_dir:
            self.update_config(load_config_files(self.config_dir))
            self.update_config(self.cli_config)  # the command line wins
        # Each right alone (update_config checked that), and together:
        if problems := RightsizeConfig(config=self.config).config_problems():
            raise SystemExit("mig-spawner-service: " + "; ".join(problems))

    #: The classes whose settings the service checks: its own, and those of the
    #: snippets it shares with the hub (the spawners' are the hub's to check).
    checked_classes = (MIGSettings, MIGPolicyConfig, RightsizeConfig)

    def update_config(self, config: Config) -> None:
        """Apply ``config`` (the command line's, ``config_dir``'s) once every setting in
        it for this service's classes is right, else exit naming each wrong one: the
        hub refuses such a config at start too. Never run on another ledger, nor with a
        limit whose misspelling left it at its default."""
        own = [type(self), *self.checked_classes]
        problems = (misplaced_settings(config)
                    + misspelt_sections(config, [cls.__name__ for cls in own])
                    + section_problems(config, own))
        if problems:
            raise SystemExit("mig-spawner-service: " + "; ".join(problems))
        super().update_config(config)

    def start_problems(self) -> list[str]:
        """What stops the service at start, one line each: a wrong group policy, a
        ledger that cannot be reached."""
        try:
            self.load_policy()
        except PolicyError as e:
            return e.problems
        return self.shared.unreachable_ledger(hub_db_url(self.config))

    def load_policy(self) -> PolicySet:
        """The group policies from the loaded config, checked as the hub checks them."""
        return MIGPolicyConfig(config=self.config, parent=self).build()

    def make_sweeper(self, metrics: ServiceMetrics) -> Sweeper:
        """Connect to the hub, the ledger and the GPUs as configured."""
        if not self.hub_api_url or not self.api_token:
            raise ValueError(
                "no hub API URL or token: run the service from JupyterHub "
                "(c.JupyterHub.services) or set JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN"
            )
        client = HubClient(
            self.hub_api_url, self.api_token, proxy_url=self.proxy_url or None,
            concurrency=self.concurrency, request_timeout=self.request_timeout,
            retries=self.retries, backoff_base=self.retry_backoff,
            page_size=self.page_size, log=self.log,
        )
        ledger = Ledger.open(self.ledger_url)
        policy = self.load_policy()
        gpus = self.connect_gpus()
        layout = None
        if self.apply_layouts and gpus is not None and not self.dry_run:
            layout = LayoutApplier(ledger, gpus, lambda group: policy.group(group).drain_notice,
                                   allow_reset=self.layout_allow_reset)
        notice = (lambda group: policy.group(group).drain_notice) if (
            self.apply_layouts and not self.dry_run) else None
        return Sweeper(
            client, policy, metrics, ledger=ledger, gpus=gpus, layout=layout,
            layout_notice=notice,
            dry_run=self.dry_run, probe_servers=self.probe_servers,
            orphan_grace=self.orphan_grace if self.release_orphans else float("inf"),
            holder_grace=self.holder_stop_grace, connect_kube=self.connect_kube,
            activity_resolution=activity_resolution(self.slice_idle_after),
            usage_interval=self.usage_sample_interval,
            faults=self.watch_faults(ledger, gpus),
            usage_retention=(None if self.usage_sample_retention == float("inf")
                             else self.usage_sample_retention),
            log=self.log,
        )

    def watch_faults(self, ledger: Ledger, gpus: gpu.GpuAdapter | None) -> FaultWatch | None:
        """This host's GPU faults, held in the ledger at each sweep (docs/health.md): the
        polled checks, and the driver's events read on one thread from now on (a GPU
        too old for events, or a driver that refuses them, leaves the polled checks)."""
        if gpus is None:
            return None
        watch = FaultWatch(lambda: ledger, gpus, self.shared.ignored_xids)
        try:
            gpus.watch_events(watch.on_event)
        except gpu.GpuError as e:
            self.log.warning("cannot read the GPUs' driver events (%s; %s); their health "
                             "is polled at each sweep only", e, e.hint)
        return watch

    async def check_token(self, client: HubClient) -> None:
        """Say at start-up, in the log and on ``/health``, which scopes the token lacks:
        without ``read:servers`` the hub lists no servers and the service would
        silently do nothing."""
        try:
            missing = missing_scopes(await client.token_scopes())
        except HubError as e:
            self.log.warning("cannot check the service token's scopes yet: %s", e)
            return
        if missing:
            self._token_problem = (
                f"the service token lacks the scopes {', '.join(missing)}: add them to "
                "the service's role in c.JupyterHub.load_roles (see docs/culling.md)"
            )
            self.log.error(self._token_problem)

    async def connect_kube(self) -> Any:
        """The Kubernetes API that orphan Kubernetes leases' pods are checked with and
        the map's nodes read from: as the hub's KubeSpawner connects (in-cluster, else
        kubeconfig; its ``k8s_api_host`` from ``config_dir`` wins). One client for the
        service, connected on first use (a failed try is tried again next time) and
        closed when the service stops."""
        if self._kube_lock is None:
            self._kube_lock = asyncio.Lock()
        async with self._kube_lock:
            if self._kube_api is None:
                host = next((str(section["k8s_api_host"]) for section in (
                    self.config.KubeMIGSpawner, self.config.KubeSpawner)
                    if section.get("k8s_api_host")), "")
                self._kube_api = await connect_api(host)
            return self._kube_api

    async def close_kube(self) -> None:
        """Close the Kubernetes client of :meth:`connect_kube`, if it connected."""
        if self._kube_api is not None:
            await self._kube_api.api_client.close()
            self._kube_api = None

    def cluster_nodes(self) -> ClusterRead | None:
        """For a Kubernetes hub (``JupyterHub.spawner_class``), the reader of its GPU
        nodes that the slice map draws, with the slices the cluster reports unhealthy:
        read as the hub's KubeMIGSpawner reads them (its ``mig_resource_api``,
        ``mig_strategy``, ``mig_node_label_selector``, ``mig_tolerations``,
        ``mig_product_models``), at most once per ``slicemap_refresh``. None: a local hub."""
        if not is_kube(self.config):
            return None
        spawner = self.config.KubeMIGSpawner
        strategy = spawner.get("mig_strategy", "auto")
        readers: list[ClusterAvailability] = []

        async def read() -> ClusterSlices:
            if not readers:  # connected on the first look: the service starts without it
                core = await self.connect_kube()
                from kubernetes_asyncio.client import ResourceV1Api

                dra = spawner.get("mig_resource_api", "device-plugin") == "dra"
                readers.append(ClusterAvailability(
                    core, ttl=self.slicemap_refresh,
                    resource_api=ResourceV1Api(core.api_client) if dra else None,
                    strategy=None if strategy == "auto" else strategy,
                    product_models=spawner.get("mig_product_models", {}),
                    tolerations=spawner.get("mig_tolerations", []),
                    node_selector=spawner.get("mig_node_label_selector", "")))
            return await readers[0].slices()

        return read

    def connect_gpus(self) -> gpu.GpuAdapter | None:
        """The GPU adapter for the unleased-device report; None when off or unavailable
        (culling and lease repair do not need it, so the service runs on without)."""
        if not self.check_gpus:
            return None
        try:
            shared = self.shared
            return gpu.connect(shared.simulate, shared.sim_state_file)
        except gpu.GpuError as e:
            self.log.error(
                "cannot read this host's GPUs (%s; %s); not reporting MIG devices used "
                "outside a lease. Set c.SliceServiceApp.check_gpus = False where the "
                "service runs off the GPU host.", e, e.hint,
            )
            return None

    def health(self) -> dict[str, Any]:
        """``ok`` once a sweep completed and the latest did; ``failing`` otherwise."""
        last = self._last_report
        ok = last is not None and last.complete and self._token_problem is None
        return {"status": "ok" if ok else ("starting" if last is None else "failing")}

    _last_report: SweepReport | None = None
    _token_problem: str | None = None
    _kube_api: Any = None  # the CoreV1Api of connect_kube, once connected
    _kube_lock: asyncio.Lock | None = None  # this service's own, made on first use

    async def run(self) -> None:
        """Serve the endpoints and sweep every ``cull_every`` seconds, forever."""
        metrics = ServiceMetrics()
        sweeper = self.make_sweeper(metrics)
        source = self.slice_source(sweeper)
        if source is not None:
            metrics.registry.register(SliceCollector(source.snapshot, gpm=GpmSampler()))
        server = self.serve(metrics, source)
        self.log.info(
            "%s %s: sweeping every %ss, %s%s", self.name, __version__, self.cull_every,
            f"{len(sweeper.policy.groups)} group policies", " (dry run)" if self.dry_run else "",
        )
        try:
            await self.check_token(sweeper.client)
            while True:
                began = time.monotonic()
                self._last_report = await sweeper.sweep()
                await asyncio.sleep(max(0.0, self.cull_every - (time.monotonic() - began)))
        finally:
            if server is not None:
                server.stop()
            await sweeper.close()
            await self.close_kube()

    def slice_source(self, sweeper: Sweeper) -> SliceSource | None:
        """What the slice map and the per-slice metrics show: this host's GPUs joined
        with the sweeper's ledger. None (and said why) without a ledger, or without GPUs
        for a local hub (a Kubernetes hub's map draws the cluster's nodes instead)."""
        if sweeper.ledger is None or (sweeper.gpus is None and not is_kube(self.config)):
            self.log.warning(
                "no slice map or per-slice metrics: they need the ledger "
                "and this host's GPUs (check_gpus)")
            return None
        return SliceSource(sweeper.gpus, sweeper.ledger, sweeper.policy,
                           idle_after=self.slice_idle_after)

    def serve(self, metrics: ServiceMetrics, source: SliceSource | None = None
              ) -> HTTPServer | None:
        """Start ``/health``, ``/metrics`` and (given a ``source``) the slice map on
        ``service_url``."""
        if not self.service_url:
            self.log.info("no service_url: not serving /health, /metrics, the slice map")
            return None
        routes = []
        if source is not None and self.slicemap:
            routes = slicemap_routes(self.service_prefix, source.snapshot,
                                     refresh_seconds=self.slicemap_refresh,
                                     cluster=self.cluster_nodes())
        # HubOAuth keeps an admin's token in a signed cookie. A new secret each start
        # only means admins pass through the hub's OAuth again (silently) after a restart.
        app = make_web_app(self.service_prefix, metrics, self.health, routes,
                           cookie_secret=secrets.token_bytes(32))
        where = urlparse(self.service_url)
        server = HTTPServer(app)
        server.listen(where.port or 80, where.hostname or "127.0.0.1")
        self.log.info("serving /health and /metrics%s on %s",
                      " and the slice map (slices)" if routes else "", self.service_url)
        return server

    def start(self) -> None:
        """Check the policy and the ledger (:meth:`start_problems`), then run until
        SIGINT or SIGTERM, and close the endpoints, ledger and GPUs."""
        if problems := self.start_problems():
            raise SystemExit("mig-spawner-service: " + "; ".join(problems))
        asyncio.run(self._run_until_signalled())

    async def _run_until_signalled(self) -> None:
        # JupyterHub stops a managed service with SIGINT, then SIGTERM: both end it
        # cleanly, even where SIGINT was ignored by whoever started the hub (nohup, &).
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, main.cancel)
        lifeline = None
        if self.exit_with_hub and os.environ.get("JUPYTERHUB_SERVICE_NAME"):
            def hub_gone() -> None:
                self.log.warning("the hub that started this service is gone; exiting "
                                 "(a restarted hub starts its own)")
                main.cancel()

            lifeline = asyncio.create_task(call_when_orphaned(hub_gone))
        try:
            await self.run()
        except asyncio.CancelledError:
            self.log.info("%s stopped", self.name)
        finally:
            if lifeline is not None:
                lifeline.cancel()


main = SliceServiceApp.launch_instance
