"""Build a :class:`PolicySet` from plain dicts as an admin writes them in config.

Every mistake is collected and reported at once in one :class:`PolicyError`, each
problem naming where it is (group, class or offer) and which key, with a suggestion
for a misspelt key or name. Import through :mod:`mig_spawner.core.policy`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from mig_spawner.core.catalog import (
    MODELS,
    WHOLE_GPU,
    CatalogError,
    GpuModel,
    is_whole_gpu,
    model,
    parse_profile_name,
    profile_sort_key,
)
from mig_spawner.core.durations import DurationError, format_duration, parse_duration
from mig_spawner.core.purpose import MAX_PURPOSE_LENGTH, sanitise

from .model import (
    DEFAULT_GROUP,
    WHOLE_GPU_NAME,
    GroupPolicy,
    Offer,
    OfferKind,
    PolicyError,
    PolicySet,
    is_profile_name,
    offer_key,
)

OFFER_KEYS = ("display_name", "description")
CLASS_KEYS = ("display_name", "description", "profiles")
GROUP_KEYS = (
    "allowed",
    "max_slices_per_user",
    "quota_slices",
    "quota_compute_slices",
    "server_idle_timeout",
    "kernel_idle_timeout",
    "max_session_age",
    "cull_busy_kernels",
    "cull_connected_kernels",
    "gpu_activity_counts",
    "warn_before",
    "extend_by",
    "max_extensions",
    "priority",
    "queue",
    "max_wait",
    "max_waiting_per_user",
    "server_idle_timeout_when_waited",
    "server_idle_timeout_when_unwaited",
    "open_tab_counts",
    "default_offer",
    "purpose_choices",
    "purpose_free_text",
    "purpose_required",
    "budget",
    "user_budget",
    "budget_window",
    "budget_min_hold",
    "budget_action",
    "budget_warn_share",
    "drain_notice",
    "fault_grace",
    "fault_action",
)
BUDGET_ACTIONS = ("stop", "refuse_new")
FAULT_ACTIONS = ("stop", "finish")
DURATION_KEYS = (
    "server_idle_timeout",
    "kernel_idle_timeout",
    "max_session_age",
    "warn_before",
    "extend_by",
    "max_wait",
    "server_idle_timeout_when_waited",
    "server_idle_timeout_when_unwaited",
    "drain_notice",
    "fault_grace",
)
# The limits a warning comes ahead of: warn_before must be shorter than each.
WARNED_LIMITS = (
    "server_idle_timeout",
    "server_idle_timeout_when_unwaited",
    "server_idle_timeout_when_waited",
    "max_session_age",
)
# Durations whose default is a limit, not "none": a missing key keeps the default.
_DURATION_DEFAULTS = {"max_wait": 1800.0, "warn_before": 600.0, "drain_notice": 3600.0,
                      "fault_grace": 600.0}


def build_policy(
    offers: Mapping[str, Mapping] | None,
    classes: Mapping[str, Mapping] | None,
    groups: Mapping[str, Mapping] | None,
    default: Mapping | None = None,
    fleet_models: Iterable[GpuModel] | None = None,
) -> PolicySet:
    """Validate the admin's dicts and build the hub's :class:`PolicySet`.

    ``offers``: profile name -> ``{"display_name", "description"}`` (optional wording for
    profiles that groups list directly). ``classes``: class name -> ``{"display_name",
    "description", "profiles": {model key: profile}}``. ``groups``: JupyterHub group
    name -> settings (see ``GROUP_KEYS``). ``default``: settings for users in none of
    ``groups`` (``None``: no GPU for them). ``fleet_models``: the GPU models present;
    profiles must then exist on one of them (``None`` or empty: any well-formed profile
    name, so a hub whose GPUs are not visible yet still starts).

    Raises :class:`PolicyError` listing every problem found.
    """
    # An empty fleet (no MIG GPU seen yet) gives nothing to check against: like None.
    check = _Checker(tuple(fleet_models or ()) or None)
    class_offers = check.classes(_mapping(classes, "slice_classes", check.problems))
    described = check.offers(_mapping(offers, "offers", check.problems))
    group_policies: dict[str, GroupPolicy] = {}
    for name, spec in _mapping(groups, "group_policies", check.problems).items():
        where = f"group {name!r}"
        if not isinstance(name, str) or not name.strip():
            check.problems.append(f"{where}: a group name must be a non-empty string")
        elif name == DEFAULT_GROUP:
            check.problems.append(
                f"{where}: the name {DEFAULT_GROUP!r} is kept for users in no listed group; "
                "set default_policy for them, or rename the JupyterHub group"
            )
        else:
            group_policies[name] = check.group(name, spec, where, class_offers)
    default_policy = (
        GroupPolicy(DEFAULT_GROUP)
        if default is None
        else check.group(DEFAULT_GROUP, default, "default_policy", class_offers)
    )
    if check.problems:
        raise PolicyError(check.problems)

    referenced = {k for g in (*group_policies.values(), default_policy) for k in g.allowed}
    profile_offers = dict(described)
    for key in referenced - set(class_offers):
        profile_offers.setdefault(key, Offer(key=key, kind=OfferKind.WHOLE,
                                        display_name=WHOLE_GPU_NAME)
                                  if is_whole_gpu(key) else
                                  Offer(key=key, kind=OfferKind.PROFILE, display_name=key))
    # Classes in the admin's order (they are usually written small -> large), then
    # profiles from small to large, then the whole GPU.
    ordered = {**class_offers}
    for key in sorted(profile_offers, key=profile_sort_key):
        ordered[key] = profile_offers[key]
    return PolicySet(
        offers=MappingProxyType(ordered),
        groups=MappingProxyType(group_policies),
        default=default_policy,
    )


def _mapping(value: object, what: str, problems: list[str]) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        problems.append(f"{what} must be a dict, got {type(value).__name__} {value!r}")
        return {}
    return value


def _suggestion(word: object, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


class _Checker:
    """Validates the parts of a policy config and collects every problem found."""

    def __init__(self, fleet: tuple[GpuModel, ...] | None) -> None:
        self.fleet = fleet  # None: any well-formed profile name is accepted
        self.problems: list[str] = []

    # --- shared checks -------------------------------------------------------------

    def _spec(self, spec: object, where: str, known: tuple[str, ...]) -> Mapping:
        """The settings dict of one entry, with unknown keys reported."""
        if not isinstance(spec, Mapping):
            self.problems.append(
                f"{where}: settings must be a dict, got {type(spec).__name__} {spec!r}"
            )
            return {}
        for key in spec:
            if key not in known:
                hint = _suggestion(key, known) or f" (known keys: {', '.join(known)})"
                self.problems.append(f"{where}: unknown key {key!r}{hint}")
        return spec

    def _text(self, spec: Mapping, key: str, where: str, default: str) -> str:
        value = spec.get(key, default)
        if not isinstance(value, str):
            self.problems.append(
                f"{where}: {key} must be a string, got {type(value).__name__} {value!r}"
            )
            return default
        return value

    def _whole(
        self, spec: Mapping, key: str, where: str, default: int | None, minimum: int | None
    ) -> int | None:
        """An integer setting; ``None`` allowed (no limit) where the default is ``None``."""
        value = spec.get(key, default)
        if value is None and default is None:
            return None
        wanted = "a whole number" if minimum is None else f"a whole number, {minimum} or more"
        if default is None:
            wanted += " (or None for no limit)"
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(
                f"{where}: {key} must be {wanted}, got {type(value).__name__} {value!r}"
            )
            return default
        if minimum is not None and value < minimum:
            self.problems.append(f"{where}: {key} must be {wanted}, got {value}")
            return default
        return value

    def _count(self, spec: Mapping, key: str, where: str, default: int, minimum: int | None) -> int:
        """An integer setting that cannot be None; ``default`` when missing or wrong."""
        value = self._whole(spec, key, where, default, minimum)
        return default if value is None else value

    def _fleet_profile(self, name: str, where: str) -> None:
        """Report a well-formed profile name that no GPU model of the fleet has."""
        if self.fleet is None or any(m.has_profile(name) for m in self.fleet):
            return
        models = ", ".join(m.display_name for m in self.fleet)
        valid = dict.fromkeys(p for m in self.fleet for p in m.profile_names)
        self.problems.append(
            f"{where}: profile {name!r} exists on no GPU in this fleet ({models}); "
            f"valid: {', '.join(valid)}"
        )

    # --- offers and classes --------------------------------------------------------

    def offers(self, offers: Mapping) -> dict[str, Offer]:
        """Wording for concrete profiles: profile name -> Offer."""
        built = {}
        for raw, spec in offers.items():
            where = f"offer {raw!r}"
            whole = isinstance(raw, str) and is_whole_gpu(offer_key(raw))
            if not isinstance(raw, str) or not (whole or is_profile_name(raw)):
                self.problems.append(
                    f"{where}: offers are keyed by MIG profile name (e.g. '1g.18gb'); "
                    "put named sizes such as 'small' in slice_classes "
                    f"({WHOLE_GPU!r} words the whole GPU)"
                )
                continue
            key = offer_key(raw)
            settings = self._spec(spec, where, OFFER_KEYS)
            if not whole:
                self._fleet_profile(key, where)
            built[key] = Offer(
                key=key,
                kind=OfferKind.WHOLE if whole else OfferKind.PROFILE,
                display_name=self._text(settings, "display_name", where,
                                        WHOLE_GPU_NAME if whole else key),
                description=self._text(settings, "description", where, ""),
            )
        return built

    def classes(self, classes: Mapping) -> dict[str, Offer]:
        """Slice classes: class name -> Offer with one profile per GPU model key."""
        built = {}
        for name, spec in classes.items():
            where = f"class {name!r}"
            if not isinstance(name, str) or not name.strip():
                self.problems.append(f"{where}: a class name must be a non-empty string")
                continue
            if is_profile_name(name) or is_whole_gpu(offer_key(name)):
                self.problems.append(
                    f"{where}: a class name must not look like a MIG profile or be "
                    f"{WHOLE_GPU!r} (a whole GPU); list profiles directly in a group's "
                    "'allowed', or pick a name like 'small'"
                )
                continue
            settings = self._spec(spec, where, CLASS_KEYS)
            if "profiles" not in settings and isinstance(spec, Mapping):
                self.problems.append(
                    f"{where}: missing key 'profiles' (GPU model key -> profile, "
                    "e.g. {'h200': '1g.18gb', 'a100-80gb': '1g.10gb'})"
                )
            key = offer_key(name)
            built[key] = Offer(
                key=key,
                kind=OfferKind.CLASS,
                display_name=self._text(settings, "display_name", where, key),
                description=self._text(settings, "description", where, ""),
                profiles=MappingProxyType(self._class_profiles(settings, where)),
            )
        return built

    def _class_profiles(self, settings: Mapping, where: str) -> dict[str, str]:
        raw = settings.get("profiles", {})
        if not isinstance(raw, Mapping) or ("profiles" in settings and not raw):
            self.problems.append(
                f"{where}: profiles must be a non-empty dict of GPU model key -> profile, "
                f"got {raw!r}"
            )
            return {}
        profiles = {}
        for model_key, profile_name in raw.items():
            try:
                gpu = model(str(model_key))
            except CatalogError as exc:
                hint = _suggestion(model_key, (m.key for m in MODELS))
                self.problems.append(f"{where}: profiles: {exc}{hint}")
                continue
            if is_whole_gpu(offer_key(str(profile_name))):
                self.problems.append(
                    f"{where}: profiles[{model_key!r}]: a class names MIG slices; a whole "
                    f"GPU is the offer {WHOLE_GPU!r}, listed in a group's 'allowed'")
                continue
            try:
                profiles[gpu.key] = gpu.profile(str(profile_name)).name
            except CatalogError as exc:
                self.problems.append(f"{where}: profiles[{model_key!r}]: {exc}")
        if self.fleet and profiles and not any(m.key in profiles for m in self.fleet):
            fleet_keys = ", ".join(m.key for m in self.fleet)
            self.problems.append(
                f"{where}: no profile for any GPU in this fleet ({fleet_keys}); "
                f"add one, e.g. profiles[{self.fleet[0].key!r}]"
            )
        return profiles

    # --- groups --------------------------------------------------------------------

    def group(
        self, name: str, spec: object, where: str, classes: Mapping[str, Offer]
    ) -> GroupPolicy:
        """One group's policy (also used for the default policy)."""
        found_before = len(self.problems)
        settings = self._spec(spec, where, GROUP_KEYS)
        # Checked in GROUP_KEYS order so that the report reads like the config.
        allowed = self._allowed(settings.get("allowed", []), where, classes)
        max_slices = self._count(settings, "max_slices_per_user", where, 1, 1)
        quota_slices = self._whole(settings, "quota_slices", where, None, 0)
        quota_compute = self._whole(settings, "quota_compute_slices", where, None, 0)
        durations = {}
        for key in DURATION_KEYS:
            default = _DURATION_DEFAULTS.get(key)
            try:
                durations[key] = (
                    parse_duration(settings[key]) if key in settings else default
                )
            except DurationError as exc:
                self.problems.append(f"{where}: {key}: {exc}")
                durations[key] = default
        self._warning_fits(durations, where)
        gpu_counts = self._flag(settings, "gpu_activity_counts", where, True)
        policy = GroupPolicy(
            name=name,
            allowed=allowed,
            max_slices_per_user=max_slices,
            quota_slices=quota_slices,
            quota_compute_slices=quota_compute,
            cull_busy_kernels=self._flag(settings, "cull_busy_kernels", where),
            cull_connected_kernels=self._flag(settings, "cull_connected_kernels", where, True),
            gpu_activity_counts=gpu_counts,
            max_extensions=self._count(settings, "max_extensions", where, 0, 0),
            priority=self._count(settings, "priority", where, 0, None),
            queue=self._flag(settings, "queue", where),
            max_waiting_per_user=self._count(settings, "max_waiting_per_user", where, 1, 1),
            open_tab_counts=self._flag(settings, "open_tab_counts", where),
            default_offer=self._default_offer(settings, where, allowed),
            purpose_choices=self._purpose_choices(settings, where),
            purpose_free_text=self._flag(settings, "purpose_free_text", where, True),
            purpose_required=self._flag(settings, "purpose_required", where),
            fault_action=self._choice(settings, "fault_action", where, FAULT_ACTIONS),
            **durations,
            **self._budget(settings, where),
        )
        if len(self.problems) == found_before:  # each setting is right on its own
            self._contradictions(policy, where, classes)
            self._budget_contradictions(policy, where, classes)
        return policy

    def _choice(self, settings: Mapping, key: str, where: str, choices: tuple[str, ...]
                ) -> str:
        """One of ``choices`` (the first by default), or a problem naming ``key``."""
        value = settings.get(key, choices[0])
        if value not in choices:
            self.problems.append(f"{where}: {key} must be one of "
                                 f"{', '.join(map(repr, choices))}, got {value!r}"
                                 f"{_suggestion(value, choices)}")
            return choices[0]
        return value

    def _budget(self, settings: Mapping, where: str) -> dict[str, object]:
        """The budget settings of a group (docs/policies.md, "Budgets")."""
        out: dict[str, object] = {}
        for key, default, unlimited in (("budget", None, True), ("user_budget", None, True),
                                        ("budget_window", 7 * 86400.0, False),
                                        ("budget_min_hold", 1800.0, False)):
            if key not in settings:
                continue
            try:
                out[key] = parse_duration(settings[key], unlimited_ok=unlimited)
            except DurationError as exc:
                self.problems.append(f"{where}: {key}: {exc} (budgets are compute-slice-"
                                     "hours, e.g. '40h')" if key.endswith("budget") else
                                     f"{where}: {key}: {exc}")
                out[key] = default
        out["budget_action"] = self._choice(settings, "budget_action", where, BUDGET_ACTIONS)
        share = settings.get("budget_warn_share", 0.8)
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            self.problems.append(f"{where}: budget_warn_share must be a number above 0 and "
                                 f"at most 1 (the share used when members are warned), or "
                                 f"None, got {share!r}")
            share = 0.8
        out["budget_warn_share"] = None if share is None else float(share)
        return out

    def _budget_contradictions(self, policy: GroupPolicy, where: str,
                               classes: Mapping[str, Offer]) -> None:
        """Budget settings that cannot all hold: a member budget above the group's, a
        minimum hold no shorter than the window, a size no budget can ever pay for."""
        if not policy.has_budget:
            return
        group, member = policy.budget, policy.user_budget
        if group is not None and member is not None and member > group:
            self.problems.append(
                f"{where}: user_budget {format_duration(member)} is more than the group's "
                f"budget {format_duration(group)}: a member's own budget is spent within the "
                "group's; lower user_budget or raise budget")
        window, hold = policy.budget_window, policy.budget_min_hold
        if hold >= window:
            self.problems.append(
                f"{where}: budget_min_hold {format_duration(hold)} is not shorter than "
                f"budget_window {format_duration(window)}; make it shorter (e.g. '30m')")
            return
        smallest = min(b for b in (group, member) if b is not None)
        too_big = [key for key in policy.allowed
                   if (need := self._compute_slices(key, classes)) and need * hold > smallest]
        if too_big:
            self.problems.append(
                f"{where}: allowed: {', '.join(map(repr, too_big))} cannot be paid for by "
                f"a budget of {format_duration(smallest)} compute-slice-hours (budget_min_hold "
                f"{format_duration(hold)} per compute slice); raise the budget, shorten "
                "budget_min_hold or remove it from allowed")

    def _contradictions(self, policy: GroupPolicy, where: str,
                        classes: Mapping[str, Offer]) -> None:
        """Settings that are each valid but cannot all hold: one of them could never
        take effect (docs/policies.md, "Settings that contradict each other")."""
        most, quota = policy.max_slices_per_user, policy.quota_slices
        if quota and quota < most:
            self.problems.append(
                f"{where}: max_slices_per_user {most} can never be reached, the whole "
                f"group's quota_slices is {quota}; lower max_slices_per_user to {quota} "
                "or raise quota_slices"
            )
        compute_quota = policy.quota_compute_slices
        needs = {key: need for key in policy.allowed
                 if (need := self._compute_slices(key, classes))}
        if compute_quota and needs:
            too_big = [key for key, need in needs.items() if need > compute_quota]
            if too_big:
                self.problems.append(
                    f"{where}: allowed: {', '.join(map(repr, too_big))} "
                    f"{'needs' if len(too_big) == 1 else 'need'} more compute slices than "
                    f"the group's quota_compute_slices {compute_quota}, so nobody can get "
                    "one; raise quota_compute_slices or remove it from allowed"
                )
            elif not quota or quota >= most:
                fits = compute_quota // min(needs.values())
                if fits < most:
                    self.problems.append(
                        f"{where}: max_slices_per_user {most} can never be reached, the "
                        f"group's quota_compute_slices {compute_quota} holds at most {fits} "
                        f"of its smallest offer; lower max_slices_per_user to {fits} or "
                        "raise quota_compute_slices"
                    )
        extend, times = policy.extend_by, policy.max_extensions
        if times and extend is None:
            self.problems.append(
                f"{where}: max_extensions {times} without extend_by: Keep could never extend "
                "a session; set extend_by (what one Keep adds, e.g. '1h') or remove "
                "max_extensions")
        elif extend is not None and not times:
            self.problems.append(
                f"{where}: extend_by {format_duration(extend)} with max_extensions 0: Keep "
                "could never extend a session; set max_extensions (how many times, e.g. 2) "
                "or remove extend_by")
        idle, when_waited = policy.server_idle_timeout, policy.server_idle_timeout_when_waited
        if idle is not None and when_waited is not None and when_waited >= idle:
            self.problems.append(
                f"{where}: server_idle_timeout_when_waited ({format_duration(when_waited)}) "
                f"must be shorter than server_idle_timeout ({format_duration(idle)}): it is "
                "the shorter idle limit used while someone waits"
            )

    def _default_offer(self, settings: Mapping, where: str,
                       allowed: tuple[str, ...]) -> str | None:
        """The group's ``default_offer``: one of its ``allowed`` offers, or None."""
        value = settings.get("default_offer")
        if value is None:
            return None
        key = offer_key(value) if isinstance(value, str) else None
        if key is None or key not in allowed:
            choices = ", ".join(map(repr, allowed)) or "none: allowed is empty"
            self.problems.append(
                f"{where}: default_offer {value!r} is not one of the group's allowed "
                f"offers{_suggestion(value, allowed)} (allowed: {choices})"
            )
            return None
        return key

    def _purpose_choices(self, settings: Mapping, where: str) -> tuple[str, ...]:
        """The purposes members pick from: short one-line texts, each once."""
        raw = settings.get("purpose_choices", ())
        if isinstance(raw, str) or not isinstance(raw, (list, tuple)):
            self.problems.append(
                f"{where}: purpose_choices must be a list of short texts (e.g. ['teaching', "
                f"'thesis']), got {type(raw).__name__} {raw!r}"
            )
            return ()
        choices: dict[str, None] = {}
        for entry in raw:
            if not isinstance(entry, str) or not sanitise(entry) or sanitise(entry) != entry:
                self.problems.append(
                    f"{where}: purpose_choices: {entry!r} must be a non-empty one-line text "
                    "without control characters or surrounding spaces"
                )
            elif len(entry) > MAX_PURPOSE_LENGTH:
                self.problems.append(
                    f"{where}: purpose_choices: {entry!r} is longer than "
                    f"{MAX_PURPOSE_LENGTH} characters"
                )
            else:
                choices[entry] = None
        if settings.get("purpose_required") is True and not choices and \
                settings.get("purpose_free_text") is False:
            self.problems.append(
                f"{where}: purpose_required is True but members can give no purpose "
                "(no purpose_choices and purpose_free_text False); add choices or allow text"
            )
        return tuple(choices)

    def _compute_slices(self, key: str, classes: Mapping[str, Offer]) -> int:
        """The fewest compute slices that offer ``key`` takes on a GPU of the fleet (on
        any GPU model that it names, without a fleet); 0 for a class without profiles
        (reported on its own)."""
        if is_whole_gpu(key):
            fleet = self.fleet or MODELS
            return min(m.compute_slices for m in fleet)
        if key not in classes:
            return parse_profile_name(key)[0]
        profiles = classes[key].profiles
        here = [p for m, p in profiles.items()
                if self.fleet is None or any(f.key == m for f in self.fleet)]
        return min((parse_profile_name(p)[0] for p in here or profiles.values()), default=0)

    def _warning_fits(self, durations: Mapping[str, float | None], where: str) -> None:
        """``warn_before`` must be shorter than every limit it warns of: a warning as
        long as the limit comes the moment a server starts (or is kept)."""
        warn = durations.get("warn_before")
        if warn is None:
            return
        for key in WARNED_LIMITS:
            limit = durations.get(key)
            if limit is not None and warn >= limit:
                self.problems.append(
                    f"{where}: warn_before {format_duration(warn)} is not shorter than "
                    f"{key} {format_duration(limit)}: every server would be warned as soon "
                    f"as it starts; make warn_before shorter than {format_duration(limit)} "
                    "(or None: no warning)"
                )

    def _flag(self, settings: Mapping, key: str, where: str, default: bool = False) -> bool:
        """A True/False setting: ``default`` when missing or wrong."""
        value = settings.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{where}: {key} must be True or False, got {value!r}")
            return default
        return value

    def _allowed(self, raw: object, where: str, classes: Mapping[str, Offer]) -> tuple[str, ...]:
        if isinstance(raw, str) or not isinstance(raw, (list, tuple, set, frozenset)):
            self.problems.append(
                f"{where}: allowed must be a list of profile or class names "
                f"(e.g. ['small', '2g.35gb']), got {type(raw).__name__} {raw!r}"
            )
            return ()
        allowed: dict[str, None] = {}  # ordered, without repeats
        for entry in raw:
            if not isinstance(entry, str):
                self.problems.append(
                    f"{where}: allowed: entries must be strings, got {type(entry).__name__} "
                    f"{entry!r}"
                )
                continue
            key = offer_key(entry)
            if is_whole_gpu(key):
                pass  # a whole GPU: any model, offered where one has MIG off
            elif is_profile_name(key):
                self._fleet_profile(key, f"{where}: allowed")
            elif key not in classes:
                known = f"classes: {', '.join(classes)}" if classes else "no classes are defined"
                self.problems.append(
                    f"{where}: allowed: unknown class {entry!r}{_suggestion(key, classes)} "
                    f"({known}; MIG profiles such as '1g.18gb' may be listed directly)"
                )
                continue
            allowed[key] = None
        return tuple(allowed)
