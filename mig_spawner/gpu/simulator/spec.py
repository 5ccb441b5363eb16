"""Parse the simulator's spec: a one-line fleet (``h200x2+a100-80gbx4:mig=off``) or a file.

Grammar of a spec string::

    spec   := group ("+" group)*
    group  := model ["x" count] (":" option)*
    option := "mig=on" | "mig=off" | "mig=pending"
            | "layout=" profile ["*" n] ("," profile ["*" n])*
            | "ids=forward" | "ids=reverse" | "ids=sequential"   (GI ID numbering)
            | "driver=" version            (host-wide)
            | "perm=root" | "perm=config" | "perm=none" | "perm=uid"   (host-wide: who
                                            the caller is; uid: whoever runs the process)
            | "unprivileged"               (host-wide: the same as perm=none)
            | "monitor=world" | "monitor=root"   (host-wide: who may read the MIG
                                            monitor capability; NVIDIA's default: world)
            | "procs=v3" | "procs=v2" | "procs=v1"   (host-wide: newest process-list
                                            call the library has)

A spec that names an existing file, or ends in ``.json``/``.yaml``/``.yml``, is read
as a fleet file with the same fields (see docs/simulator.md).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from mig_spawner.core import catalog

from ..errors import GpuError

DEFAULT_DRIVER = "570.133.20"
PERMISSIONS = ("root", "config", "none", "uid")
MONITOR_ACCESS = ("world", "root")  # mode of /dev/nvidia-caps/nvidia-cap2: 0444 or 0400
MIG_MODES = ("on", "off", "pending")
ID_SCHEMES = ("forward", "reverse", "sequential")  # see rules.gi_id_for
PROCESS_APIS = ("v3", "v2", "v1")

# GPUs without MIG, so that NOT_SUPPORTED paths can be exercised: key -> (product, MiB).
NON_MIG_MODELS = {
    "t4": ("Tesla T4", 15360),
    "l4": ("NVIDIA L4", 23034),
    "a10": ("NVIDIA A10", 23028),
}

_GROUP_RE = re.compile(r"^(?P<model>[a-z0-9][a-z0-9-]*?)(?:x(?P<count>\d+))?$")
_DRIVER_RE = re.compile(r"^\d{3}\.\d{1,3}(?:\.\d{1,3})?$")
_FILE_SUFFIXES = (".json", ".yaml", ".yml")
# Groups are joined by "+", but "+me", "+me.all" and "+gfx" belong to profile names.
_GROUP_SEP = re.compile(r"\+(?!me\b|gfx\b)", re.IGNORECASE)


class SpecError(GpuError, ValueError):
    """A simulator spec that cannot be understood; the message says what and how to fix it."""

    default_hint = "see docs/simulator.md for the spec syntax, e.g. 'h200x2' or 'h100x1:mig=off'"


@dataclass(frozen=True)
class GroupSpec:
    """``count`` identical GPUs: model, MIG mode and the instances to lay out on each."""

    model_key: str
    count: int = 1
    mig: str = "on"
    layout: tuple[str, ...] = ()
    ids: str = "forward"


@dataclass(frozen=True)
class HostSpec:
    """The whole simulated host."""

    groups: tuple[GroupSpec, ...]
    driver_version: str = DEFAULT_DRIVER
    # The caller: root, config (holds the MIG config capability), none, or uid (root
    # exactly when the calling process's euid is 0).
    permission: str = "root"
    unprivileged: bool = False  # the spec said 'unprivileged' (perm=none)
    process_api: str = "v3"
    monitor: str = "world"  # who may read the MIG monitor capability (list instances)


def is_fleet_file(spec: str) -> bool:
    """True when ``spec`` names a fleet file rather than a one-line spec."""
    return spec.lower().endswith(_FILE_SUFFIXES) or os.path.isfile(spec)


def parse_spec(spec: str) -> HostSpec:
    """Parse a spec string or fleet-file path into a :class:`HostSpec`, or raise SpecError."""
    text = (spec or "").strip()
    if not text:
        raise SpecError(
            "empty simulator spec; give e.g. 'h200x2', 'a100-80gbx4:mig=off' "
            "or the path of a fleet file"
        )
    if is_fleet_file(text):
        return _parse_fleet_file(text)
    groups = []
    host_opts: dict[str, str] = {}
    for part in _GROUP_SEP.split(text):
        group, opts = _parse_group_text(part.strip(), text)
        groups.append(group)
        for key, value in opts.items():
            if key in host_opts and host_opts[key] != value:
                raise SpecError(
                    f"simulator spec {text!r} sets {key} twice ({host_opts[key]} and {value}); "
                    f"{key} applies to the whole host, so give it once"
                )
            host_opts[key] = value
    return _host(tuple(groups), host_opts.get("driver"), host_opts.get("perm"), text,
                 unprivileged="unprivileged" in host_opts, process_api=host_opts.get("procs"),
                 monitor=host_opts.get("monitor"))


def _parse_group_text(part: str, whole: str) -> tuple[GroupSpec, dict[str, str]]:
    head, *options = part.split(":")
    m = _GROUP_RE.match(head.strip().lower())
    if not m:
        raise SpecError(
            f"{head!r} in simulator spec {whole!r} is not '<model>x<count>'; "
            f"e.g. 'h200x2'. Models: {', '.join(_model_keys())}"
        )
    fields: dict[str, object] = {}
    host_opts: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key == "unprivileged" and not sep:
            host_opts[key] = "yes"
            continue
        if not sep or not value:
            raise SpecError(f"option {option!r} in {whole!r} must look like key=value")
        if key == "mig":
            fields["mig"] = value.lower()
        elif key == "layout":
            fields["layout"] = _expand_layout(value.split(","), whole)
        elif key == "ids":
            fields["ids"] = value.lower()
        elif key in ("driver", "perm", "procs", "monitor"):
            host_opts[key] = value.lower()
        else:
            raise SpecError(
                f"unknown option {key!r} in simulator spec {whole!r}; known: "
                "mig=on|off|pending, layout=..., ids=forward|reverse|sequential, driver=..., "
                "perm=root|config|none|uid, unprivileged, procs=v3|v2|v1, monitor=world|root"
            )
    count = int(m["count"]) if m["count"] else 1
    return _group(m["model"], count, whole, **fields), host_opts


def _expand_layout(items: list, where: str) -> tuple[str, ...]:
    """``["1g.10gb*2", "3g.40gb"]`` -> ``("1g.10gb", "1g.10gb", "3g.40gb")``."""
    out: list[str] = []
    for item in items:
        name, star, times = str(item).strip().partition("*")
        if not name.strip():
            raise SpecError(f"empty profile in the layout of {where!r}")
        if star and not times.strip().isdigit():
            raise SpecError(f"{item!r} in {where!r}: the repeat after '*' must be a number")
        out.extend([catalog.normalize_profile_name(name)] * (int(times) if star else 1))
    return tuple(out)


def _group(model_key: str, count: int, where: str, mig: str = "on",
           layout: tuple[str, ...] = (), ids: str = "forward") -> GroupSpec:
    key = model_key.strip().lower()
    if key not in _model_keys():
        raise SpecError(
            f"unknown GPU model {model_key!r} in {where!r}; known: {', '.join(_model_keys())}"
        )
    if count < 1:
        raise SpecError(f"{where!r}: the GPU count must be at least 1")
    if mig not in MIG_MODES:
        raise SpecError(f"{where!r}: mig={mig} is not one of {', '.join(MIG_MODES)}")
    if ids not in ID_SCHEMES:
        raise SpecError(f"{where!r}: ids={ids} is not one of {', '.join(ID_SCHEMES)}")
    if key in NON_MIG_MODELS and (mig != "on" or layout):
        raise SpecError(f"{where!r}: {key} has no MIG, so it takes no mig= or layout= option")
    if key in NON_MIG_MODELS:
        mig = "off"
    if layout and mig != "on":
        raise SpecError(f"{where!r}: a layout needs mig=on (it is mig={mig})")
    if layout:
        gpu_model = catalog.model(key)
        for name in layout:
            try:
                gpu_model.profile(name)
            except catalog.CatalogError as exc:
                raise SpecError(f"layout in {where!r}: {exc}") from None
    return GroupSpec(key, count, mig, layout, ids)


def _host(groups: tuple[GroupSpec, ...], driver: str | None, perm: str | None,
          where: str, *, unprivileged: bool = False, process_api: str | None = None,
          monitor: str | None = None) -> HostSpec:
    driver = driver or DEFAULT_DRIVER
    if unprivileged and perm not in (None, "none"):
        raise SpecError(f"{where!r}: 'unprivileged' already means perm=none; drop perm={perm}")
    perm = perm or ("none" if unprivileged else "root")
    process_api = process_api or "v3"
    if process_api not in PROCESS_APIS:
        raise SpecError(f"procs={process_api} in {where!r} is not one of "
                        f"{', '.join(PROCESS_APIS)}")
    if not _DRIVER_RE.match(driver):
        raise SpecError(f"driver={driver} in {where!r} is not a driver version like 550.54.15")
    if perm not in PERMISSIONS:
        raise SpecError(f"perm={perm} in {where!r} is not one of {', '.join(PERMISSIONS)}")
    monitor = monitor or "world"
    if monitor not in MONITOR_ACCESS:
        raise SpecError(f"monitor={monitor} in {where!r} is not one of "
                        f"{', '.join(MONITOR_ACCESS)}")
    # A driver older than a model needs is allowed on purpose: `mig-spawner doctor`
    # must be able to show that problem on a simulated host.
    return HostSpec(groups, driver, perm, unprivileged, process_api, monitor)


def _parse_fleet_file(path: str) -> HostSpec:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise SpecError(f"cannot read simulator fleet file {path!r}: {exc.strerror}") from None
    try:
        if path.lower().endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # only fleet files need YAML

            data = yaml.safe_load(text)
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError's parse errors
        raise SpecError(f"fleet file {path!r} is not valid: {exc}") from None
    except Exception as exc:  # yaml.YAMLError does not derive from ValueError
        raise SpecError(f"fleet file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list) or not data["gpus"]:
        raise SpecError(
            f"fleet file {path!r} needs a 'gpus' list, e.g. gpus: [{{model: h200, count: 2}}]"
        )
    unknown = set(data) - {"gpus", "driver", "perm", "unprivileged", "procs", "monitor"}
    if unknown:
        raise SpecError(f"fleet file {path!r}: unknown keys {sorted(unknown)}; "
                        "known: gpus, driver, perm, unprivileged, procs, monitor")
    groups = []
    for i, entry in enumerate(data["gpus"]):
        where = f"{path} gpus[{i}]"
        if not isinstance(entry, dict) or "model" not in entry:
            raise SpecError(f"{where}: each entry needs at least 'model'")
        extra = set(entry) - {"model", "count", "mig", "layout", "ids"}
        if extra:
            raise SpecError(f"{where}: unknown keys {sorted(extra)}; "
                            "known: model, count, mig, layout, ids")
        layout = entry.get("layout") or ()
        if isinstance(layout, str):
            layout = layout.split(",")
        mig = entry.get("mig", "on")
        if isinstance(mig, bool):  # YAML reads a bare on/off as a boolean
            mig = "on" if mig else "off"
        groups.append(
            _group(str(entry["model"]), int(entry.get("count", 1)), where, str(mig).lower(),
                   _expand_layout(list(layout), where), str(entry.get("ids", "forward")))
        )
    driver = data.get("driver")
    procs = data.get("procs")
    monitor = data.get("monitor")
    return _host(tuple(groups), str(driver) if driver else None, data.get("perm"), path,
                 unprivileged=bool(data.get("unprivileged")),
                 process_api=str(procs) if procs else None,
                 monitor=str(monitor) if monitor else None)


def _model_keys() -> tuple[str, ...]:
    return tuple(m.key for m in catalog.MODELS) + tuple(NON_MIG_MODELS)
