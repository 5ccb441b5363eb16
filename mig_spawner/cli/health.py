"""``mig-spawner health``: the GPU faults the ledger holds, and clearing one GPU's.

``mig-spawner health`` lists every fault that holds slices from new servers (and, with
``--all``, those cleared): the GPU, what the driver reported, since when, what it
holds. ``mig-spawner health clear GPU`` (after a reset or a repair) reads the GPU's
health from the driver first and lifts its holds only when the driver lists it and reads
it healthy: a GPU back after a reset is re-checked before any slice of it is offered.
docs/health.md.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .settings import connect_gpus, ledger_url

if TYPE_CHECKING:
    from ..gpu import GpuAdapter
    from ..ledger import GpuFault


def add_parser(sub: argparse._SubParsersAction, add_global_options: Callable) -> None:
    """Register ``health`` (and ``health clear``) on the ``mig-spawner`` parser."""
    p = sub.add_parser("health", help="GPU faults held from new servers; 'clear' lifts a "
                                      "GPU's once the driver reads it healthy",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_options(p)
    p.add_argument("--json", action="store_true", help="print the faults as JSON")
    p.add_argument("--all", action="store_true", help="cleared faults too (history)")
    p.set_defaults(func=cmd_health)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    clear = actions.add_parser("clear", help="lift a GPU's fault holds once the driver "
                                             "reads it healthy again")
    add_global_options(clear)
    clear.add_argument("gpu", help="the GPU: its index on this host, or its UUID")
    clear.set_defaults(func=lambda args: cmd_clear(args, connect_gpus(args)))


def fault_line(fault: GpuFault) -> str:
    """One fault in words: where, what, since when, what it holds."""
    held = "all its slices" if fault.whole_gpu else \
        f"memory slices {', '.join(map(str, sorted(fault.held_slices)))}"
    line = (f"GPU {fault.gpu_index} ({fault.gpu_uuid}) on {fault.host}: {fault.kind.value}: "
            f"{fault.detail}; seen {fault.seen_at:%Y-%m-%d %H:%M:%S} UTC, last "
            f"{fault.last_seen_at:%H:%M:%S}; holds {held}")
    if fault.cleared_at is not None:
        line += f"; cleared {fault.cleared_at:%Y-%m-%d %H:%M:%S} UTC by {fault.cleared_by}"
    return line


def fault_json(fault: GpuFault) -> dict[str, object]:
    """One fault as JSON."""
    return {"host": fault.host, "gpu": fault.gpu_index, "uuid": fault.gpu_uuid,
            "kind": fault.kind.value, "detail": fault.detail, "xid": fault.xid,
            "device_uuid": fault.device_uuid, "whole_gpu": fault.whole_gpu,
            "held_slices": sorted(fault.held_slices), "seen_at": fault.seen_at.isoformat(),
            "last_seen_at": fault.last_seen_at.isoformat(),
            "cleared_at": fault.cleared_at.isoformat() if fault.cleared_at else None,
            "cleared_by": fault.cleared_by}


def cmd_health(args: argparse.Namespace) -> int:
    """Run ``mig-spawner health``; returns the exit status (1 while a fault holds)."""
    from ..ledger import Ledger, LedgerError

    try:
        with Ledger.open_existing(ledger_url(args)) as ledger:
            faults = ledger.holds.faults(open_only=not args.all)
    except LedgerError as e:
        print(f"error: the ledger cannot be read: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([fault_json(f) for f in faults], indent=2))
    elif not faults:
        print("no GPU fault holds any slice")
    else:
        print("\n".join(map(fault_line, faults)))
    return 1 if any(f.open for f in faults) else 0


def cmd_clear(args: argparse.Namespace, gpus: GpuAdapter) -> int:
    """Run ``mig-spawner health clear GPU``: lift the GPU's holds only once the driver
    lists it and reads it healthy; returns the exit status."""
    from ..health import healthy_now
    from ..ledger import Ledger, LedgerError

    try:
        inventory = gpus.inventory()
        url = ledger_url(args)
        Ledger.open_existing(url).close()  # there, and at this package's schema
        with Ledger(url) as ledger:
            held = ledger.holds.faults(inventory.host)
            uuid = next((f.gpu_uuid for f in held if args.gpu in (str(f.gpu_index),
                                                                   f.gpu_uuid)), None)
            if uuid is None:
                print(f"GPU {args.gpu} has no fault held on {inventory.host}")
                return 0
            healthy, still = healthy_now(gpus, uuid)
            if not healthy:
                why = "; ".join(map(str, still)) or "the driver does not list it"
                print(f"error: GPU {args.gpu} is not healthy yet ({why}): reset or repair "
                      "it first (docs/health.md)", file=sys.stderr)
                return 1
            cleared = ledger.holds.clear_faults(inventory.host, uuid, getpass.getuser())
    except LedgerError as e:
        print(f"error: the ledger cannot be written: {e}", file=sys.stderr)
        return 2
    finally:
        gpus.close()
    print(f"GPU {args.gpu} reads healthy: {len(cleared)} fault hold(s) lifted; its "
          "slices are offered again")
    return 0
