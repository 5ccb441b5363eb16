"""``mig-spawner layout``: plan a change of the MIG layout, and apply it one step at a time.

``layout plan TARGET`` reads the GPUs and the ledger and prints, per GPU, what goes,
what is created, who holds what must go (until when at the latest) and what each group
can still get meanwhile; it changes nothing. The plan itself is
:func:`mig_spawner.core.layout.plan_layout`; docs/layout.md tells the whole way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ..core.layout import (
    UNCHANGED,
    LayoutError,
    LayoutPlan,
    NoticeFor,
    PlanState,
    Target,
    latest_end,
    parse_mig_parted,
    parse_spec,
)

DESCRIPTION = """\
Change the MIG layout of this host's GPUs without stopping anyone.

TARGET is a mig-parted config (the file 'mig-spawner report --advise --write-config'
writes; --config picks one of its configs) or a spec string: '3g.71gb,2g.35gb*2' for
every GPU, '0=3g.71gb,1g.18gb*4;1=off' per GPU index.

  plan    what would change, who holds what must go, what stays available (read-only)
  apply   hold what changes from new grants, warn its holders, and apply every step
          that waits for nobody; the slice service carries on at each sweep (or --wait)
  status  each GPU's change: pending, draining, applying, done or failed, and why
  drain   hold a whole GPU from new grants and warn its holders (maintenance)
  end     end a drain (or give up a change): its GPU is granted from again
  node    Kubernetes: hold a node, drain it, label it for MIG Manager and wait
"""


def read_target(text: str, config: str | None = None) -> Target:
    """``text`` as a target: the path of a mig-parted YAML/JSON file, else a spec string."""
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise LayoutError(f"no file {text}") from None
        except (OSError, yaml.YAMLError) as e:
            raise LayoutError(f"cannot read {text}: {e}") from None
        return parse_mig_parted(data, config)
    return parse_spec(text)


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if moment else "no limit"


def render_text(plan: LayoutPlan, now: datetime, notice: NoticeFor | None,
                allowed: Mapping[str, list[str]]) -> str:
    """The plan for people: per GPU its steps, then what stays available."""
    lines = []
    for g in plan.gpus:
        head = f"GPU {g.index}" + (f" ({g.model_key})" if g.model_key else "")
        if g.problem is not None:
            lines.append(f"{head}: cannot change: {g.problem}")
            continue
        if not g.changes:
            lines.append(f"{head}: {g.target}" if g.target == UNCHANGED
                         else f"{head}: already {g.target}; nothing to do")
            continue
        lines.append(f"{head}: -> {g.target}")
        if g.keep:
            lines.append("  keeps:    " + ", ".join(i.describe() for i in g.keep))
        for i in g.destroy:
            if i.holder is not None:
                h = i.holder
                lines.append(f"  destroys: {i.describe()}: held by {h.server} (group "
                             f"{h.group}, {h.profile}) until {_when(latest_end(h, now, notice))}"
                             " at the latest")
            else:
                lines.append(f"  destroys: {i.describe()}: "
                             + ("processes run on it" if i.busy else "free"))
        for n in g.create:
            lines.append(f"  creates:  {n.describe()}")
        if g.needs_reset:
            lines.append("  MIG mode change: this GPU needs a reset (Ampere): --allow-reset")
        lines.append("  steps:")
        lines += [f"    {n}. {s.describe()}" for n, s in enumerate(g.steps, 1)]
    meanwhile = plan.meanwhile()
    what = ", ".join(f"{n}x {p}" for p, n in sorted(meanwhile.items())) or "nothing"
    lines.append(f"meanwhile free or made free on this host: {what}")
    for group, got in plan.meanwhile_by_group(allowed).items():
        items = ", ".join(f"{n}x {p}" for p, n in got.items()) or "nothing"
        lines.append(f"  group {group} can still get: {items}")
    return "\n".join(lines)


def render_json(plan: LayoutPlan, now: datetime, notice: NoticeFor | None,
                allowed: Mapping[str, list[str]]) -> dict[str, Any]:
    return {"gpus": [g.to_json(now, notice) for g in plan.gpus],
            "meanwhile": dict(sorted(plan.meanwhile().items())),
            "meanwhile_by_group": plan.meanwhile_by_group(allowed)}


def _groups(config_dir: str | None) -> dict[str, list[str]]:
    """Group -> the profiles its policy allows, from ``config_dir`` (empty without)."""

    groups: dict[str, list[str]] = {}
    from .settings import allowed_by

    for profile, names in allowed_by(config_dir).items():
        for group in names:
            groups.setdefault(group, []).append(profile)
    return groups


def _notice(config_dir: str | None) -> NoticeFor | None:
    """Each group's ``drain_notice`` from the policy in ``config_dir`` (None without)."""
    if config_dir is None:
        return None
    from ..config import MIGPolicyConfig, load_config_files

    policies = MIGPolicyConfig(config=load_config_files(config_dir)).build()
    return lambda group: notice_of(policies.group(group).drain_notice)


def notice_of(seconds: float | None) -> timedelta | None:
    """A policy's ``drain_notice`` as a span (None: no limit)."""
    return None if seconds is None else timedelta(seconds=seconds)


def read_plan(args: argparse.Namespace) -> LayoutPlan:
    """The plan for ``args.target`` on this host, with the ledger's holders."""
    from ..core.layout import plan_layout
    from ..layout import holders_of
    from ..ledger import Ledger, LedgerMissing
    from .settings import ledger_url, read_inventory

    target = read_target(args.target, args.config)
    inventory = read_inventory(args)
    try:
        with Ledger.open_existing(ledger_url(args)) as ledger:
            held = ledger.leases.active()
    except LedgerMissing:
        held = []  # no hub has run here: nothing is held
    return plan_layout(inventory, target, holders_of(held))


def cmd_plan(args: argparse.Namespace, now: datetime | None = None) -> int:
    """Run ``mig-spawner layout plan``; returns the exit status."""
    from ..ledger import LedgerError

    now = now or datetime.now(UTC)
    why = _refuse_dynamic(args)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        plan = read_plan(args)
        allowed = _groups(args.config_dir)
        notice = _notice(args.config_dir)
    except (LayoutError, LedgerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(render_json(plan, now, notice, allowed), indent=2))
    else:
        print(render_text(plan, now, notice, allowed))
    return 1 if plan.problems else 0


def _refuse_dynamic(args: argparse.Namespace) -> str | None:
    """Why a target layout makes no sense here: dynamic mode has no fixed layout."""
    from ..config import configured_mode
    from ..core.kinds import mode_rules
    from .settings import hub_config

    if not mode_rules(configured_mode(hub_config(args))).fixed_layout:
        return ("this hub runs in dynamic mode: it creates an instance per server and has "
                "no layout to change. Use 'mig-spawner layout drain GPU' to empty a GPU "
                "for maintenance or a MIG mode change")
    return None


def _applier(args: argparse.Namespace, ledger: Any, gpus: Any) -> Any:
    from ..layout import LayoutApplier

    notices = _notice(args.config_dir)

    def notice_for(group: str) -> float | None:
        span = notices(group) if notices else timedelta(hours=1)
        return None if span is None else span.total_seconds()

    return LayoutApplier(ledger, gpus, notice_for, allow_reset=args.allow_reset)


def _print_pass(done: Any, ledger: Any) -> None:
    """What a pass did: per GPU its steps, who it warned and when each stops, and the
    servers whose drain notice has ended."""
    for g in done.gpus:
        steps = "; ".join(g.done) or "no step"
        print(f"GPU {g.gpu_index}: {g.state.value}: {steps}" + (f" ({g.why})" if g.why else ""))
        for lease in filter(None, map(ledger.leases.get, g.warned)):
            print(f"  warned {lease.server} (group {lease.group}): {_stops(lease)}")
    for lease in done.due:
        print(f"  {lease.server}: its drain notice has ended; the slice service stops it")


def _stops(lease: Any) -> str:
    """When a warned holder stops: its drain notice's end at the latest, or a stop it is
    warned of that comes sooner (its idle limit, its session's end)."""
    from ..core.lifecycle import StopRule

    drain = lease.pending_stop(StopRule.DRAIN)
    first = lease.stops[0] if lease.stops else None
    words = f"stops at {_when(drain.deadline)} at the latest" if drain else "not stopped"
    if first is not None and first.rule is not StopRule.DRAIN:
        words += f" ({first.rule.value} sooner, at {_when(first.deadline)})"
    return words


def cmd_apply(args: argparse.Namespace) -> int:
    """Run ``mig-spawner layout apply``: open the changes, then one pass (or until done)."""
    import time

    from ..core.layout import plan_layout
    from ..gpu import connect
    from ..layout import begin, holders_of
    from ..ledger import Ledger, LedgerError
    from .settings import hub_config, ledger_url

    why = _refuse_dynamic(args)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from ..config import MIGSettings

    shared = MIGSettings(config=hub_config(args))
    gpus = connect(simulate=shared.simulate, state_file=shared.sim_state_file)
    try:
        with Ledger.open(ledger_url(args)) as ledger:
            target = read_target(args.target, args.config)
            inventory = gpus.inventory()
            plan = plan_layout(inventory, target, holders_of(ledger.leases.active(inventory.host)))
            for g in plan.problems:
                print(f"GPU {g.index}: cannot change: {g.problem}", file=sys.stderr)
            if plan.problems and not args.partial:
                print("error: nothing was changed; fix the target or pass --partial to "
                      "change the other GPUs", file=sys.stderr)
                return 1
            opened = begin(ledger, inventory.host, plan, target)
            if not opened:
                print("nothing to change")
                return 0
            applier = _applier(args, ledger, gpus)
            while True:
                done = applier.step()
                _print_pass(done, ledger)
                left = ledger.holds.changes(inventory.host)
                if not args.wait or not left:
                    break
                time.sleep(args.interval)
            failed = [c for c in ledger.holds.changes(inventory.host, open_only=False)
                      if c.id in {o.id for o in opened} and c.state is PlanState.FAILED]
            return 1 if failed else 0
    except (LayoutError, LedgerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        gpus.close()


def cmd_status(args: argparse.Namespace) -> int:
    """Run ``mig-spawner layout status``: the open changes (``--all``: history too)."""
    from ..ledger import Ledger
    from .settings import ledger_url

    with Ledger.open_existing(ledger_url(args)) as ledger:
        changes = ledger.holds.changes(open_only=not args.all)
    if args.json:
        print(json.dumps([{"id": c.id, "host": c.host, "gpu": c.gpu_index, "uuid": c.gpu_uuid,
                           "state": c.state.value, "target": c.target,
                           "held_slices": sorted(c.held_slices), "whole_gpu": c.whole_gpu,
                           "since": c.created_at.isoformat(), "detail": c.detail,
                           "stepper": c.stepper}
                          for c in changes], indent=2))
        return 0
    if not changes:
        print("no layout change under way")
    for c in changes:
        what = "drain" if c.target.get("drain") else "re-cut"
        print(f"{c.host} GPU {c.gpu_index}: {what} {c.state.value} since "
              f"{_when(c.created_at)}" + (f": {c.detail}" if c.detail else ""))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Run ``mig-spawner layout drain GPU``."""
    from ..layout import drain
    from ..ledger import Ledger
    from .settings import ledger_url, read_inventory

    inventory = read_inventory(args)
    gpu = next((g for g in inventory.gpus if g.index == args.gpu), None)
    if gpu is None:
        print(f"error: this host has no GPU {args.gpu}", file=sys.stderr)
        return 2
    with Ledger.open(ledger_url(args)) as ledger:
        change = drain(ledger, inventory.host, gpu)
    print(f"GPU {gpu.index}: draining: no new server gets a slice on it; its servers are "
          "warned by the slice service and stopped at their group's drain_notice "
          f"(change {change.id}; 'mig-spawner layout end {gpu.index}' ends it)")
    return 0


def cmd_end(args: argparse.Namespace) -> int:
    """Run ``mig-spawner layout end GPU|NODE``: the open change of that GPU of this host
    (or of that Kubernetes node) ends ``done``."""
    from ..holder import this_host
    from ..layout import end_change
    from ..ledger import KUBE_NODE, Ledger
    from .settings import ledger_url

    gpu = args.gpu.isdigit()
    with Ledger.open(ledger_url(args)) as ledger:
        ended = [c for c in ledger.holds.changes()
                 if (gpu and c.host == this_host() and c.gpu_index == int(args.gpu)
                     and c.gpu_uuid != KUBE_NODE)
                 or (not gpu and c.host == args.gpu and c.gpu_uuid == KUBE_NODE)]
        for c in ended:
            end_change(ledger, c, PlanState.DONE, "ended by an admin")
    what = f"GPU {args.gpu}" if gpu else f"node {args.gpu}"
    if not ended:
        print(f"error: {what} has no layout change under way", file=sys.stderr)
        return 1
    print(f"{what}: ended; it is granted from again")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Run ``mig-spawner layout node NODE CONFIG`` (Kubernetes): hold the node and let
    the slice service drain it, label it and wait for MIG Manager."""
    from ..layout import begin_kube
    from ..ledger import Ledger
    from .settings import ledger_url

    with Ledger.open(ledger_url(args)) as ledger:
        change = begin_kube(ledger, args.node, args.mig_config)
    print(f"node {args.node}: held from new servers (change {change.id}). The slice "
          "service warns the servers whose pods hold its slices, stops them at their "
          "group's drain_notice, then sets nvidia.com/mig.config="
          f"{args.mig_config} and waits for MIG Manager ('mig-spawner layout status')")
    return 0


def add_parser(sub: argparse._SubParsersAction, add_global_options: Callable) -> None:
    """Register ``layout`` on the ``mig-spawner`` parser."""
    p = sub.add_parser("layout", help="plan and apply a change of the MIG layout",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_options(p)
    steps = p.add_subparsers(dest="layout_command", required=True, metavar="ACTION")
    plan = steps.add_parser("plan", help="what would change and who holds it (read-only)")
    _common(plan, add_global_options)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)
    apply = steps.add_parser("apply", help="drain what changes and apply, one instance at "
                                           "a time")
    _common(apply, add_global_options)
    apply.add_argument("--allow-reset", action="store_true",
                       help="a MIG mode change on an Ampere GPU (A100, A30) resets it")
    apply.add_argument("--partial", action="store_true",
                       help="change the GPUs that can be, when the target does not fit others")
    apply.add_argument("--wait", action="store_true",
                       help="keep applying until every change is done or failed (else the "
                            "slice service carries on at each sweep)")
    apply.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                       help="with --wait: seconds between passes (default 10)")
    apply.set_defaults(func=cmd_apply)
    for name, func, text, kind, what in (
            ("drain", cmd_drain, "hold a whole GPU from new grants and drain it", int,
             "the GPU's index"),
            ("end", cmd_end, "end a GPU's (or a node's) drain or change: it is granted from "
             "again", str, "the GPU's index, or a Kubernetes node's name")):
        p = steps.add_parser(name, help=text)
        add_global_options(p)
        p.add_argument("gpu", type=kind, metavar="GPU", help=what)
        p.set_defaults(func=func)
    p = steps.add_parser("node", help="Kubernetes: re-cut a node to a mig-parted config "
                                      "through MIG Manager, once its slices are free")
    add_global_options(p)
    p.add_argument("node", metavar="NODE", help="the node's name")
    p.add_argument("mig_config", metavar="CONFIG",
                   help="a config name of the GPU Operator's mig-parted ConfigMap")
    p.set_defaults(func=cmd_node)
    p = steps.add_parser("status", help="each GPU's change and where it stands")
    add_global_options(p)
    p.add_argument("--all", action="store_true", help="also changes that ended")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)


def _common(p: argparse.ArgumentParser, add_global_options: Callable) -> None:
    add_global_options(p)
    p.add_argument("target", metavar="TARGET",
                   help="a mig-parted config file or a spec string ('3g.71gb,2g.35gb*2')")
    p.add_argument("--config", metavar="NAME",
                   help="which config of the file (default: mig-spawner-advised, or the "
                        "file's only one)")
