"""Group policy config, read by the hub-side spawner and by the slice service alike.

Both processes load the same ``jupyterhub_config.d/*.py`` files, so the policy lives in
one plain :class:`~traitlets.config.Configurable`, not in a Spawner or an Application::

    c.MIGPolicyConfig.group_policies = {
        "analysts": {"allowed": ["1g.18gb", "2g.35gb"], "max_slices_per_user": 1,
                     "quota_slices": 6, "server_idle_timeout": "30m"},
    }

The traits only hold the admin's dicts; :meth:`MIGPolicyConfig.build` checks them all
together (classes are referenced from groups, so no single trait can be checked alone)
and returns the pure :class:`~mig_spawner.core.policy.PolicySet`.

Every setting of mig-spawner's classes is checked when the hub, the slice service or
``mig-spawner doctor`` starts, one line per mistake naming it (:func:`section_problems`):
a name the class does not have, a value its trait refuses (the traits here say what is
in range: :class:`Finite`, :class:`Share`), and what a class's settings refuse together
(a class's ``config_problems()``, e.g. :meth:`RightsizeConfig.config_problems`).

What the hub's spawner, the slice service and the ``mig-spawner`` command must agree on
(the ledger, the simulated GPUs) lives in one more Configurable, :class:`MIGSettings`::

    c.MIGSettings.ledger_url = "postgresql+psycopg2://mig:secret@db.internal/mig_ledger"
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from traitlets import Dict, Float, Integer, List, TraitError, TraitType, Unicode, validate
from traitlets.config import Config, Configurable, LazyConfigValue, PyFileConfigLoader

from mig_spawner.core.catalog import GpuModel
from mig_spawner.core.health import APPLICATION_XIDS, check_xids
from mig_spawner.core.kinds import DEFAULT_MIG_MODE
from mig_spawner.core.policy import PolicySet, build_policy
from mig_spawner.core.rightsize import RightsizeRule

PathLike = str | os.PathLike[str]


class Finite(Float):
    """A number setting that must be finite (and, with ``positive``, above 0).

    traitlets' Float takes NaN and infinity, and NaN passes its ``min`` and ``max``: a
    timeout or an interval of either breaks whatever waits or divides by it, later."""

    def __init__(self, default_value: float, *, positive: bool = False, **kwargs: Any):
        self.positive = positive
        super().__init__(default_value, **kwargs)

    def validate(self, obj: Any, value: Any) -> float:
        value = super().validate(obj, value)
        if not math.isfinite(value):
            raise TraitError(f"must be a finite number, got {value!r}")
        if self.positive and value <= 0:
            raise TraitError(f"must be more than 0, got {value!r}")
        return value


class Share(Float):
    """A share of something, above 0 and at most 1 (0.75 is 75 %)."""

    def validate(self, obj: Any, value: Any) -> float:
        value = super().validate(obj, value)
        if not 0 < value <= 1:  # NaN fails this too
            raise TraitError("must be a share above 0 and at most 1 (0.75 is 75 %)")
        return value


class MIGPolicyConfig(Configurable):
    """Which MIG slices each JupyterHub group may use, how many, and for how long."""

    offers = Dict(
        help="""Wording on the spawn form for MIG profiles that groups list directly.

        Keys are profile names; values are dicts with ``display_name`` and
        ``description``. Describe the need a size serves, not only its memory, e.g.
        ``{"2g.35gb": {"display_name": "Medium (32.2 GiB)",
        "description": "inference of a mid-size model"}}``. Profiles listed in
        ``group_policies`` without an entry here are shown by their name.
        """,
    ).tag(config=True)

    slice_classes = Dict(
        help="""Named slice sizes that mean one profile per GPU model, for mixed fleets.

        Class name -> dict with ``profiles`` (GPU model key -> profile name, e.g.
        ``{"h200": "1g.18gb", "a100-80gb": "1g.10gb"}``), ``display_name`` and
        ``description``. Groups then allow ``"small"`` instead of one profile per GPU
        model. Model keys: a100-40gb, a100-80gb, a30, h100, h100-nvl, gh200, h200, b200.
        """,
    ).tag(config=True)

    group_policies = Dict(
        help="""Policy per JupyterHub group name. Keys of each policy:

        ``allowed`` (list of profile or class names), ``max_slices_per_user`` (default 1),
        ``quota_slices`` and ``quota_compute_slices`` (whole group, None = unlimited),
        ``server_idle_timeout``, ``kernel_idle_timeout``, ``max_session_age`` (durations
        such as "30m", "8h", "1h30m"; None or "never" = no limit), ``cull_busy_kernels``
        (bool, default False), ``cull_connected_kernels`` (bool, default True: the kernel
        limit applies to kernels a tab is connected to, after a warning), ``priority``
        (int, default 0: which group a lease is charged to first, and whose waiters go
        first), and for the wait list ``queue``
        (bool, default False: members may wait when nothing is free), ``max_wait``
        (duration, default "30m"), ``max_waiting_per_user`` (default 1) and
        ``server_idle_timeout_when_waited`` (a shorter idle limit while anyone waits for
        the size), ``server_idle_timeout_when_unwaited`` (a longer one while nobody does),
        ``open_tab_counts`` (bool, default False: an open tab's polling is not activity)
        and ``warn_before`` (default "10m", shorter than each limit it warns of),
        ``drain_notice`` (default "1h": how long a server on a GPU whose layout changes
        runs on after its warning; None: the change waits for it, docs/layout.md),
        ``fault_grace`` (default "10m": how long a server whose GPU reported a hardware
        fault runs on after its user is warned; None: no grace, stopped at once) and
        ``fault_action`` ("stop", the default, or "finish": warned, never stopped;
        docs/health.md).
        A user in several groups gets the union of their offers; see docs/policies.md.
        """,
    ).tag(config=True)

    default_policy = Dict(
        default_value=None,
        allow_none=True,
        help="""Policy for users in none of ``group_policies``, with the same keys.

        None (the default) gives them no GPU slice at all.
        """,
    ).tag(config=True)

    def build(self, fleet_models: Iterable[GpuModel] | None = None) -> PolicySet:
        """Check the whole policy config and return it as a :class:`PolicySet`.

        ``fleet_models``: the GPU models the hub hands out, so that profiles that exist on
        none of them are reported; ``None`` accepts any well-formed profile name.
        Raises :class:`~mig_spawner.core.policy.PolicyError` listing every problem.
        """
        return build_policy(
            offers=self.offers,
            classes=self.slice_classes,
            groups=self.group_policies,
            default=self.default_policy,
            fleet_models=fleet_models,
        )


class RightsizeConfig(Configurable):
    """The thresholds of right-sizing (docs/analyst-guide.md, "Right-sizing"), shared by
    the spawn form's hint and ``mig-spawner report --rightsize``."""

    min_sessions = Integer(
        3, min=1, help="Measured sessions on one size needed before any verdict on it (1 "
        "or more).",
    ).tag(config=True)
    min_samples = Integer(
        5, min=1, help="""Usage samples a session needs to count as measured, 1 or more
        (the slice service takes one per ``usage_sample_interval``, 60 s by default).""",
    ).tag(config=True)
    recent = Integer(
        5, min=1, help="""How many of the latest measured sessions on a size are judged;
        at least ``min_sessions``.""",
    ).tag(config=True)
    fits_below = Share(
        0.75, help="""Over-sized when every judged session's peak memory stayed below
        this share of the next smaller size's memory (the rest is room to grow); above 0
        and at most 1.""",
    ).tag(config=True)
    full_above = Share(
        0.95, help="""Under-sized when a judged session's peak memory reached this share
        of its own slice's memory; above 0 and at most 1.""",
    ).tag(config=True)

    def config_problems(self) -> list[str]:
        """What these settings refuse together, one line each (each is right alone)."""
        if self.recent >= self.min_sessions:
            return []
        return [f"c.RightsizeConfig.recent = {self.recent} is less than "
                f"c.RightsizeConfig.min_sessions = {self.min_sessions}: no size could ever "
                "have enough judged sessions for a verdict; raise recent or lower "
                "min_sessions"]

    def rule(self) -> RightsizeRule:
        """The pure rule; raises ``TraitError`` naming the setting that is out of range."""
        try:
            return RightsizeRule(self.min_sessions, self.min_samples, self.recent,
                                 self.fits_below, self.full_above)
        except ValueError as e:
            raise TraitError(f"c.RightsizeConfig: {e}") from None


def load_config_files(paths_or_dir: PathLike | Iterable[PathLike]) -> Config:
    """Load config files the way ``jupyterhub_config.py`` loads ``jupyterhub_config.d``.

    ``paths_or_dir``: a directory (its ``*.py`` files, in sorted name order), one file, or
    a list of both, taken in the order given. Each file runs with ``c`` and
    ``get_config`` and is merged like traitlets' ``load_subconfig``, so a later file can
    replace a setting (``c.X.y = ...``) or extend it (``c.X.y.update({...})``).

    Raises FileNotFoundError for a path that does not exist; errors raised by a config
    file itself propagate with that file's traceback.
    """
    config = Config()
    for path in _config_files(paths_or_dir):
        loader = PyFileConfigLoader(path.name, path=str(path.parent))
        config.merge(loader.load_config())
    return config


class MIGSettings(Configurable):
    """What the hub's spawner, the slice service and ``mig-spawner`` share: the lease
    ledger, the (simulated) GPUs and which of the GPUs' Xids are faults. Set once, as
    ``c.MIGSettings.<name>``; the hub refuses to start when these are set anywhere else
    (``c.LocalMIGSpawner.ledger_url``), so that no process can use another ledger than
    the rest."""

    ledger_url = Unicode(
        "",
        help="""SQLAlchemy URL of the lease ledger, for the spawner, the slice service
        and ``mig-spawner report`` alike.

        Empty (default): a SQLite file ``mig_spawner_ledger.sqlite`` beside the hub's
        own SQLite database (``JupyterHub.db_url``), or in the hub's working directory
        when the hub's database is not a SQLite file. Use a PostgreSQL URL for a hub
        with many users (docs/ledger.md). The hub, the slice service and ``mig-spawner
        doctor`` refuse to start when it cannot be reached.
        """,
    ).tag(config=True, secret=True)  # may hold a password: never echoed in a refusal

    simulate = Unicode(
        None,
        allow_none=True,
        help="""Use the NVML simulator instead of the real driver (demos and tests).

        A spec such as ``h200x2:layout=1g.18gb*4,2g.35gb,1g.35gb`` (docs/simulator.md).
        None (default): the real driver through NVML (or $MIG_SPAWNER_SIMULATE).
        """,
    ).tag(config=True)

    sim_state_file = Unicode(
        None,
        allow_none=True,
        help="""JSON file holding the simulated GPUs' state, so that the hub, the slice
        service and the CLI see one simulated host. Only used with ``simulate``.""",
    ).tag(config=True)

    ignored_xids = List(
        Integer(),
        default_value=list(APPLICATION_XIDS),
        help="""Xids that applications cause, which leave the GPU healthy: the driver's
        reports of these are not hardware faults.

        The default is NVIDIA's device plugin's list: 13 (graphics engine exception),
        31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive
        cleanup), 68 (video processor exception), 109 (context switch timeout). Any
        other critical Xid (79: the GPU has fallen off the bus, 48: a double-bit ECC
        error, ...) is a fault of the GPU, or of the one MIG device the driver names.
        Add to it with ``c.MIGSettings.ignored_xids.append(...)``; an empty list makes
        every Xid a fault (docs/health.md).
        """,
    ).tag(config=True)

    @validate("ledger_url")
    def _check_ledger_url(self, proposal: dict) -> str:
        url = proposal["value"].strip()
        if url:
            from sqlalchemy.engine import make_url  # not at import: the CLI starts faster

            try:
                make_url(url)
            except Exception:
                # Not the parser's words: they repeat the URL, password and all.
                raise TraitError(
                    "ledger_url: not a SQLAlchemy URL; use e.g. "
                    "'sqlite:////srv/jupyterhub/mig_ledger.sqlite' or "
                    "'postgresql://user@db/mig'"
                ) from None
        return url

    @validate("simulate")
    def _check_simulate(self, proposal: dict) -> str | None:
        spec = proposal["value"]
        if spec is None or not spec.strip():
            return None
        from mig_spawner.gpu.simulator.spec import SpecError, parse_spec

        try:
            parse_spec(spec)
        except SpecError as e:
            raise TraitError(f"simulate: {e}") from None
        return spec.strip()

    @validate("ignored_xids")
    def _check_ignored_xids(self, proposal: dict) -> list[int]:
        try:
            return list(check_xids(proposal["value"]))
        except ValueError as e:
            raise TraitError(f"ignored_xids: {e}") from None

    @validate("sim_state_file")
    def _check_sim_state_file(self, proposal: dict) -> str | None:
        path = proposal["value"]
        folder = Path(path or ".").expanduser().resolve().parent
        if path and not folder.is_dir():
            raise TraitError(
                f"sim_state_file: the folder {folder} does not exist; create it or pick a "
                "file in an existing folder"
            )
        return path or None

    def ledger_location(self, hub_db_url: str | None) -> str:
        """The ledger every process uses: ``ledger_url``, else the one rule that puts
        it beside the hub's SQLite database (``hub_db_url``: ``JupyterHub.db_url``)."""
        from mig_spawner.ledger import url_beside_hub_db

        return self.ledger_url or url_beside_hub_db(hub_db_url)

    def state_file(self) -> str | None:
        """The simulator's state file, when the GPUs are simulated at all."""
        return self.sim_state_file if self.simulate else None

    def unreachable_ledger(self, hub_db_url: str | None) -> list[str]:
        """The ledger (:meth:`ledger_location`) cannot be used from here now: one line
        naming ``c.MIGSettings.ledger_url``, or none. Nothing is created or changed. The
        line names no URL, host or path: the database's own answer goes to stderr (the
        hub's and the service's log)."""
        from mig_spawner.ledger import LedgerConfigError, LedgerError, probe

        try:
            probe(self.ledger_location(hub_db_url))
        except LedgerError as e:
            print(f"mig-spawner: {e}", file=sys.stderr)
            setting = "c.MIGSettings.ledger_url" + (
                "" if self.ledger_url else " (unset: a SQLite file beside the hub's database)")
            why = ("no such folder or database driver, or no permission"
                   if isinstance(e, LedgerConfigError) else
                   "the database does not answer, refuses this connection, or is no database")
            return [f"{setting}: the ledger cannot be used from here ({why}; the details are "
                    "on stderr)"]
        return []


#: The names :class:`MIGSettings` owns; set on any other class they are refused.
SHARED_SETTINGS = ("ledger_url", "simulate", "sim_state_file")


def misplaced_settings(config: Config) -> list[str]:
    """Shared settings set somewhere other than ``c.MIGSettings`` (where v1 put them,
    e.g. ``c.LocalMIGSpawner.ledger_url``), each with where it goes now."""
    return [
        f"c.{section_name}.{name} is not read any more; set c.MIGSettings.{name} instead"
        for section_name, section in config.items()
        if isinstance(section, Config) and section_name != MIGSettings.__name__
        for name in SHARED_SETTINGS
        if name in section
    ]


def unknown_setting(section_name: str, key: str, names: Iterable[str]) -> str:
    """The line that refuses ``c.<section_name>.<key>``, which is none of ``names`` (the
    settings the section has), with the nearest of them as a suggestion."""
    match = difflib.get_close_matches(key, list(names), n=1)
    hint = f"; did you mean {match[0]!r}?" if match else ""
    return f"c.{section_name}.{key} is not a setting of {section_name}{hint}"


def section_problems(config: Config, classes: Iterable[type[Configurable]]) -> list[str]:
    """Settings in ``config`` of the sections of ``classes`` that the class does not
    have (traitlets itself only logs them and starts: a misspelt limit would silently
    keep its default), or whose value the class refuses, one line each naming the
    setting (``c.RightsizeConfig.fits_below = 75: must be a share ...``)."""
    classes = list(classes)
    problems = []
    for cls in classes:
        name = cls.__name__
        section = config.get(name)
        if not isinstance(section, Config):
            continue
        traits = _section_traits(cls, classes)
        for key, value in section.items():
            if isinstance(value, Config):
                continue  # a nested section (c.LocalMIGSpawner.MIGSettings...)
            if key not in traits:
                if key not in SHARED_SETTINGS:  # those are reported by misplaced_settings
                    problems.append(unknown_setting(name, key, sorted(traits)))
                continue
            trait, owner = traits[key]
            if isinstance(value, LazyConfigValue):  # extended: c.X.y.update({...})
                value = value.get_value(trait.default())
            problem = _refused(trait, owner, value)
            if problem is not None:
                shown = "" if trait.metadata.get("secret") else f" = {value!r}"
                problems.append(f"c.{name}.{key}{shown}: {problem}")
    return problems


def _section_traits(cls: type[Configurable], classes: Iterable[type[Configurable]]
                    ) -> dict[str, tuple[TraitType, type[Configurable]]]:
    """The settings ``c.<cls>`` can hold, each with the class that has it: its own
    traits and, for a base class such as ``MIGSpawnerMixin``, those of the classes below
    it (traitlets hands a base's section to every subclass; a backend's own traits live
    on that backend only)."""
    traits: dict[str, tuple[TraitType, type[Configurable]]] = {}
    for sub in classes:
        if issubclass(sub, cls):
            found = {key: (trait, sub) for key, trait in sub.class_traits(config=True).items()}
            traits = {**found, **traits}
    return traits


def _refused(trait: TraitType, owner: type[Configurable], value: Any) -> str | None:
    """Why ``owner`` refuses ``value`` for ``trait``, or None. Validated as setting it
    would (traitlets' ``_validate``: the trait's type and bounds, then the class's own
    ``@validate``), on an instance made without ``__init__``: KubeSpawner's needs a user,
    and nothing else of the instance is wanted."""
    try:
        trait._validate(owner.__new__(owner), value)
    except (TraitError, ValueError) as e:  # our validators raise ValueError too
        return _in_words(str(e), trait.name)
    return None


#: traitlets' words for a number out of ``min`` / ``max``.
_BOUND = re.compile(r"should not be (less|greater) than (\S+), but a value of .* was specified")


def _in_words(text: str, name: str) -> str:
    """An error of a setting's trait or validator as the reason alone: the refusal's
    line names the setting and its value already."""
    bound = _BOUND.search(text)
    if bound:
        return f"must be {bound[2]} or {'more' if bound[1] == 'less' else 'less'}"
    # traitlets: "The 'mig_mode' trait of a LocalMIGSpawner instance expected any of ..."
    text = re.sub(r"^The '\w+' trait of an? \w+ instance ", "", text)
    # ours: "SliceServiceApp.cull_every: ...", "simulate: ...", "... concurrency must be"
    return re.sub(rf"^(\w+\.)?{re.escape(name)}:?\s+", "", text)


def where_set(config: Config, cls: type[Configurable], name: str) -> str:
    """``c.<Section>.<name>`` as an admin wrote it for an instance of ``cls``: the
    section of the most derived class in ``cls``'s hierarchy that sets ``name`` (the
    one traitlets applies), else that of the class that has the setting."""
    for klass in cls.__mro__:
        section = config.get(klass.__name__)
        if isinstance(section, Config) and name in section:
            return f"c.{klass.__name__}.{name}"
    return f"c.{cls.class_traits()[name].this_class.__name__}.{name}"


def misspelt_sections(config: Config, class_names: Iterable[str]) -> list[str]:
    """Sections of ``config`` that name no class but nearly name one of ``class_names``
    (``c.MIGPolicyConfg``, ``c.LocalMIGSpawnr``): nothing reads them, so everything set
    there would be ignored. Near: the same but for case, or at most two letters
    added, dropped or changed; a section that names any class loaded in this process
    (``c.KubeSpawner``, three letters from ``KubeMIGSpawner``) is never one."""
    ours = list(class_names)
    loaded = _configurable_names()
    problems = []
    for section_name, section in config.items():
        if not isinstance(section, Config) or section_name in ours or section_name in loaded:
            continue
        near = [name for name in ours if _near(section_name, name)]
        if near:
            problems.append(
                f"c.{section_name} is not a mig-spawner class, so nothing reads its "
                f"settings; did you mean c.{near[0]}?"
            )
    return problems


def _near(written: str, name: str) -> bool:
    """Whether ``written`` is ``name`` mistyped: at most two edits apart, or equal but
    for case."""
    a, b = written.lower(), name.lower()
    if abs(len(a) - len(b)) > 2:
        return False
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):  # Levenshtein distance, row by row
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1] <= 2


def _configurable_names() -> set[str]:
    """The names of every Configurable class loaded in this process."""
    seen: set[type] = set()
    todo: list[type] = [Configurable]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return {cls.__name__ for cls in seen}


def setting_value(section: Config, name: str, empty: Any) -> Any:
    """``section.name`` as the application would see it, ``empty`` when unset: a setting
    that snippets extended (``c.JupyterHub.services.append(...)``) is held lazily."""
    value = section.get(name, empty)
    return value.get_value(empty) if isinstance(value, LazyConfigValue) else value


def offered_profiles_from_config(
    config_dir: PathLike, fleet_models: Iterable[GpuModel] | None = None
) -> tuple[list[str], str]:
    """What ``mig-spawner doctor --config-dir`` checks a host against.

    Returns the profiles the group policies can hand out (see
    :meth:`PolicySet.profile_names`) on ``fleet_models`` (``None``: on any GPU model, so
    a class lists its profile for every model it names), and the spawner's ``mig_mode``
    as set for any spawner class in the config (``core.kinds.DEFAULT_MIG_MODE``, the
    spawner's default, when unset). Raises :class:`PolicyError` for a wrong policy and
    ``ValueError`` when two classes set different modes.
    """
    config = load_config_files(config_dir)
    fleet = None if fleet_models is None else tuple(fleet_models)
    policies = MIGPolicyConfig(config=config).build(fleet)
    profiles = list(policies.profile_names(None if fleet is None else [m.key for m in fleet]))
    return profiles, configured_mode(config)


def is_kube(config: Config) -> bool:
    """Whether ``config`` runs the Kubernetes spawner (the hub, and the slice service
    that reads the hub's config)."""
    spawner = str(config.get("JupyterHub", {}).get("spawner_class", ""))
    return spawner == "mig-kube" or "Kube" in spawner


def configured_mode(config: Config) -> str:
    """The spawner's ``mig_mode`` as set for any spawner class in ``config``
    (``core.kinds.DEFAULT_MIG_MODE``, the spawner's default, when unset); ``ValueError``
    when two classes differ."""
    # Read from the raw config: this module sits below the spawner and must not import it.
    modes = {
        f"c.{name}.mig_mode": section["mig_mode"]
        for name, section in config.items()
        if isinstance(section, Config) and "mig_mode" in section
    }
    if len(set(modes.values())) > 1:
        raise ValueError(
            "mig_mode is set differently: "
            + ", ".join(f"{where} = {mode!r}" for where, mode in modes.items())
        )
    return next(iter(modes.values()), DEFAULT_MIG_MODE)


def _config_files(paths_or_dir: PathLike | Iterable[PathLike]) -> list[Path]:
    if isinstance(paths_or_dir, (str, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    files = []
    for entry in paths_or_dir:
        path = Path(entry)
        if path.is_dir():
            files.extend(sorted(p for p in path.glob("*.py") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(
                f"config path {str(path)!r} does not exist; give a jupyterhub_config.d "
                "directory or a .py config file"
            )
    return files
