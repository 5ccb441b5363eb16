"""Entry point of the ``mig-spawner`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from ..core.kinds import MIG_MODE_KINDS
from . import budget, catalog, demo, doctor, health, layout, report, status
from .settings import connect_gpus, hub_config, read_inventory

SIMULATE_HELP = (
    "use the NVML simulator instead of the real driver, e.g. 'h200x2', "
    "'a100-80gbx1:mig=off', 'h100x1:layout=1g.10gb*2,2g.20gb,3g.40gb' (docs/simulator.md)"
)


#: The options every subcommand that reads the hub's config, GPUs or ledger takes, before
#: or after its name (``mig-spawner -f CFG budget grant ...`` as ``mig-spawner budget grant
#: -f CFG ...``): argparse reads an option only at the level it is given, so each level
#: has them, and below the top their default is to set nothing, so that a value given
#: higher up is kept.
GLOBAL_OPTIONS = ("config_dir", "simulate", "sim_state", "ledger_url")


def add_global_options(p: argparse.ArgumentParser, top: bool = False) -> None:
    """The :data:`GLOBAL_OPTIONS` on ``p``: with their defaults on the top parser
    (``top``), setting nothing unless given on a subcommand's."""
    default = None if top else argparse.SUPPRESS
    p.add_argument(
        "-f", "--config-dir",
        metavar="DIR", default=default,
        help="the hub's jupyterhub_config.d (or a config file): its c.MIGSettings (ledger, "
             "simulated GPUs); for doctor, its policies and mode; for report --advise, the "
             "groups that lose a profile the proposal drops. Options win over it",
    )
    p.add_argument("--simulate", metavar="SPEC", default=default, help=SIMULATE_HELP)
    p.add_argument(
        "--sim-state",
        metavar="FILE", default=default,
        help="simulator state file shared with a running hub (see docs/simulator.md)",
    )
    p.add_argument("--ledger-url", metavar="URL", default=default,
                   help="SQLAlchemy URL of the lease ledger (default: c.MIGSettings.ledger_url "
                        "of --config-dir, else mig_spawner_ledger.sqlite beside the hub's "
                        "database, else in this directory)")


def cmd_status(args: argparse.Namespace) -> int:
    inv = read_inventory(args)
    holders, changes, note = _from_ledger(args, inv)
    if args.json:
        data = status.to_json(inv, holders)
        data["layout_changes"] = [
            {"gpu": c.gpu_index, "uuid": c.gpu_uuid, "state": c.state.value,
             "held_slices": sorted(c.held_slices), "whole_gpu": c.whole_gpu,
             "detail": c.detail} for c in changes]
        print(json.dumps(data, indent=2))
        return 0
    print(status.render_text(inv, holders, note))
    for c in changes:
        from ..observe.slice_state import change_words

        print(f"GPU {c.gpu_index}: {change_words(c)}; no new server is given its slices "
              f"{', '.join(map(str, sorted(c.held_slices))) if not c.whole_gpu else '(all)'}")
    return 0


def _from_ledger(args: argparse.Namespace, inv):
    """What the ledger adds to ``inv``: the slice map joined with the held leases (who
    holds each slice, for which server and purpose, since when; with the hub's config,
    the limit in force, the next stop and the pending warnings of each, and the wait
    list in served order, the GPU faults that withhold slices), the layout changes under
    way on this host (docs/layout.md), and a note when the ledger cannot be read:
    ``(None, [], why)``; status then shows the GPUs alone."""
    from datetime import UTC, datetime, timedelta

    from ..ledger import Ledger, LedgerError, LedgerMissing
    from ..observe.slice_state import slice_map
    from .budget import hub_policies
    from .settings import ledger_url

    now = datetime.now(UTC)
    policy = hub_policies(args) if args.config_dir else None
    horizon = policy.budget_horizon if policy is not None else None
    try:
        with Ledger.open_existing(ledger_url(args)) as ledger:
            held = ledger.leases.active()
            changes = ledger.holds.changes(inv.host)
            faults = ledger.holds.faults(inv.host)
            waits = ledger.waits.waiting()
            budgets = (ledger.usage.budget(now - timedelta(seconds=horizon))
                       if horizon is not None else None)
    except LedgerMissing:
        return None, [], ("holders not shown: no ledger found (give --config-dir or "
                          "--ledger-url of the hub's ledger)")
    except LedgerError as e:
        return None, [], f"holders not shown: the ledger cannot be read ({e})"
    view = slice_map(inv, held, now, policy, waits=waits, budgets=budgets, changes=changes,
                     faults=faults)
    return view, changes, ""


def cmd_catalog(args: argparse.Namespace) -> int:
    from ..core.catalog import CatalogError

    inv = None
    if args.from_driver:
        inv = read_inventory(args)
    try:
        print(catalog.render(inv, args.model, args.json))
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _kube_checks(args: argparse.Namespace) -> list[doctor.Check]:
    """``doctor --kube``: the cluster as the hub's account reads it (in-cluster service
    account or the kubeconfig): the API, how it serves MIG against the hub's setting,
    the GPU nodes and their slices (or DRA devices), the DeviceClass, and whether the
    account may do what the hub needs. Read-only."""
    import asyncio

    from ..kube import ClusterReadError
    from ..kube.pods import connect_api
    from ..kube.survey import survey

    config = hub_config(args) if args.config_dir else None
    spawner = config.KubeMIGSpawner if config is not None else {}
    kube_spawner = config.KubeSpawner if config is not None else {}
    configured = spawner.get("mig_resource_api", "device-plugin")
    strategy = spawner.get("mig_strategy", "auto")
    namespace = spawner.get("namespace") or kube_spawner.get("namespace") or _namespace()

    async def read():
        from kubernetes_asyncio.client import AuthorizationV1Api, ResourceV1Api, VersionApi

        core = await connect_api()
        async with core.api_client as client:
            return await survey(
                core, ResourceV1Api(client), AuthorizationV1Api(client), VersionApi(client),
                namespace=namespace, resource_api=configured,
                strategy=None if strategy == "auto" else strategy,
                node_selector=spawner.get("mig_node_label_selector", ""),
                tolerations=spawner.get("mig_tolerations", []))

    try:
        found = asyncio.run(read())
    except ClusterReadError as e:
        return [doctor.Check("Kubernetes API", doctor.Status.FAIL, str(e), e.hint)]
    return doctor.kube_checks(found, configured, strategy)


def _namespace() -> str:
    """The hub's namespace as KubeSpawner finds it: the pod's own, else 'default'."""
    from pathlib import Path

    own = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return own.read_text().strip() if own.exists() else "default"


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.kube:
        checks = _kube_checks(args)
        print(doctor.render_json(checks) if args.json else doctor.render(checks))
        return 1 if any(c.status is doctor.Status.FAIL for c in checks) else 0
    offered_for = None
    if args.config_dir:
        from ..config import offered_profiles_from_config

        def offered_for(models):
            return offered_profiles_from_config(args.config_dir, models)

    from traitlets import TraitError

    from ..config import MIGSettings
    from ..device_cgroup import host_support

    config = hub_config(args) if args.config_dir else None
    settings = [] if config is None else [*doctor.config_checks(config),
                                           doctor.check_start_timeouts(config)]
    try:
        simulated = bool(MIGSettings(config=hub_config(args)).simulate)
    except TraitError:
        if not settings:
            raise  # main says it in one line
        # The GPUs cannot be reached as set: the hub settings check names the setting.
        checks = settings
    else:
        setting = None if config is None else doctor.configured_isolation(config)
        support = host_support()
        checks = doctor.run_checks(lambda: connect_gpus(args), offered_for, mode=args.mode,
                                   isolation=doctor.confines(setting, simulated, support),
                                   held_faults=lambda host: _held_faults(args, host))
        checks.append(doctor.check_device_isolation(setting, simulated, support))
        checks += settings
    print(doctor.render_json(checks) if args.json else doctor.render(checks))
    return 1 if any(c.status is doctor.Status.FAIL for c in checks) else 0


def _held_faults(args: argparse.Namespace, host: str):
    """The GPU faults the ledger holds on ``host``; None where there is no ledger or it
    cannot be read (doctor then reports the driver's view alone)."""
    from ..ledger import Ledger, LedgerError
    from .settings import ledger_url

    try:
        with Ledger.open_existing(ledger_url(args)) as ledger:
            return ledger.holds.faults(host)
    except LedgerError:
        return None


def _read_only_command(
    sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int],
    help_text: str, json_help: str,
) -> argparse.ArgumentParser:
    """A subcommand that only reads the GPUs (and the hub's config): GPU options, --json."""
    p = sub.add_parser(name, help=help_text)
    add_global_options(p)
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mig-spawner",
        description="Share NVIDIA MIG slices between JupyterHub users.",
    )
    add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _read_only_command(sub, "status", cmd_status,
                           "show each GPU's MIG layout and its MIG devices, with who holds "
                           "each (user, server, purpose, age) and the layout changes under way "
                           "from the ledger",
                           "print the inventory (and the holders) as JSON")
    p = _read_only_command(
        sub, "doctor", cmd_doctor,
        "check that this host is ready for mig-spawner (read-only; exits 1 on failure)",
        "print the checks as JSON",
    )
    p.add_argument("--mode", choices=tuple(MIG_MODE_KINDS), help="override the configured mode")
    p.add_argument("--kube", action="store_true",
                   help="check the Kubernetes cluster instead of this host's GPUs, as the "
                        "hub's account sees it (read-only): the API, the GPU nodes and "
                        "their MIG slices or DRA devices, the MIG strategy, whether "
                        "KubeMIGSpawner.mig_resource_api matches, the DeviceClass, and "
                        "the hub's RBAC")
    p = _read_only_command(
        sub, "catalog", cmd_catalog,
        "print the MIG profile table: the catalog's, or the live driver's (read-only)",
        "print JSON",
    )
    p.add_argument("--from-driver", action="store_true",
                   help="read each GPU's profiles from the driver and show where the "
                        "catalog differs (never changes anything)")
    p.add_argument("--model", metavar="KEY", help="only this catalog model (e.g. h200)")

    report.add_parser(sub, add_global_options)
    budget.add_parser(sub, add_global_options)
    layout.add_parser(sub, add_global_options)
    health.add_parser(sub, add_global_options)
    demo.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a mistake in what it was given is one ``error:`` line, exit 2.

    The mistakes are the hub's own config (a file that does not parse, a setting of the
    wrong type or value, a config path that is not there) and the command line's
    settings over it (``--simulate``, ``--sim-state``, ``--ledger-url``): the admin who
    typed them reads the line, so it names the file or the setting.
    """
    from traitlets import TraitError

    from ..gpu.errors import GpuError
    from ..ledger import LedgerConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SyntaxError as e:  # a config file that is not Python
        print(f"error: {e.filename}, line {e.lineno}: {e.msg}", file=sys.stderr)
    except (TraitError, LedgerConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
    except GpuError as e:  # no driver, MIG off, ...: the error and what to do, exit 1
        print(f"error: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
