"""What the Kubernetes API server refuses before it stores an object, for the stand-in.

Two layers, as in the API server:

* the schema: the API's own OpenAPI schemas, shipped by ``kubernetes-validate`` (types,
  required fields, enums);
* the validation code no schema holds (``k8s.io/apimachinery/pkg/util/validation`` and
  ``pkg/apis/core/validation``): names, label keys and values (at most 63 characters,
  alphanumeric at both ends), resource names, and for extended resources (a domain other
  than ``kubernetes.io``) whole numbers with a limit that the request equals.

Answers are the API server's: a ``422 Invalid`` Status whose message is
``Pod "name" is invalid: <field>: <why>, ...``. And RBAC: the rules of the Roles
documented in docs/kubernetes.md, a request they do not allow answered with the
API server's 403 body.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

#: The Kubernetes minor whose schemas are used (DRA's resource.k8s.io/v1 is GA in 1.34).
SCHEMA_VERSION = "1.34"

_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_NAME_PART_RE = re.compile(f"^{_NAME_PART}$")
_LABEL_VALUE_RE = re.compile(f"^({_NAME_PART})?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_QUALIFIED_NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', "
    f"regex used for validation is '{_NAME_PART}')"
)
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', "
    "'_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  "
    f"or 'my_value',  or '12345', regex used for validation is '({_NAME_PART})?')"
)
_STANDARD = ("cpu", "memory", "ephemeral-storage", "pods", "storage")

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(e[+-]?[0-9]+|[KMGTPE]i|[numkMGTPE]|)$")


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity (``"500m"``, ``"16Gi"``, ``2``) as a number; ValueError
    when it is not one."""
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {value!r}")
    number, suffix = match.groups()
    if suffix.startswith("e"):
        return Decimal(number) * Decimal(10) ** int(suffix[1:])
    return Decimal(number) * Decimal(_SUFFIXES[suffix])


@dataclass(frozen=True)
class Invalid(Exception):
    """A refusal: ``kind``/``name`` of the object and the field errors."""

    kind: str
    name: str
    causes: tuple[tuple[str, str], ...]  # (field, message)

    @property
    def message(self) -> str:
        return f'{self.kind} "{self.name}" is invalid: ' + ", ".join(
            f"{path}: {why}" for path, why in self.causes)

    def status(self) -> dict:
        return {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": "Invalid", "code": 422,
            "details": {"name": self.name, "kind": self.kind.lower() + "s", "causes": [
                {"reason": "FieldValueInvalid", "message": why, "field": path}
                for path, why in self.causes]},
        }


def _qualified_name(name: str) -> str | None:
    """Why ``name`` is no qualified name (``[prefix/]name``), or None."""
    prefix, _, part = name.rpartition("/")
    if prefix and not _DNS1123_SUBDOMAIN.match(prefix):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not part or len(part) > 63:
        return "name part must be no more than 63 characters" if part else (
            "name part must be non-empty")
    return None if _NAME_PART_RE.match(part) else _QUALIFIED_NAME_MSG


def _labels(labels: Mapping[str, Any] | None, path: str) -> list[tuple[str, str]]:
    errors = []
    for key, value in (labels or {}).items():
        if (why := _qualified_name(key)) is not None:
            errors.append((path, f'Invalid value: "{key}": {why}'))
        value = str(value)
        if len(value) > 63:
            errors.append((path, f'Invalid value: "{value}": must be no more than 63 '
                                 "characters"))
        elif not _LABEL_VALUE_RE.match(value):
            errors.append((path, f'Invalid value: "{value}": {_LABEL_VALUE_MSG}'))
    return errors


def _extended(name: str) -> bool:
    """Extended resources: a domain-prefixed name outside ``kubernetes.io``."""
    domain = name.partition("/")[0] if "/" in name else ""
    return bool(domain) and not (domain == "kubernetes.io" or domain.endswith(
        ".kubernetes.io"))


def _resources(resources: Mapping[str, Any], path: str) -> list[tuple[str, str]]:
    errors = []
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            where = f"{path}.{kind}[{name}]"
            if name not in _STANDARD and "/" not in name:
                errors.append((where, f'Invalid value: "{name}": must be a standard '
                                      "resource type or fully qualified"))
                continue
            if (why := _qualified_name(name)) is not None:
                errors.append((where, f'Invalid value: "{name}": {why}'))
                continue
            try:
                amount = quantity(value)
            except ValueError as e:
                errors.append((where, f'Invalid value: "{value}": {e}'))
                continue
            if _extended(name) and amount != amount.to_integral_value():
                errors.append((where, f'Invalid value: "{value}": must be an integer'))
    for name, value in requests.items():
        if not _extended(name):
            continue
        where = f"{path}.requests[{name}]"
        if name not in limits:
            errors.append((f"{path}.limits", "Required value: Limit must be set for non "
                                             "overcommitable resources"))
        elif quantity(limits[name]) != quantity(value):
            errors.append((where, f'Invalid value: "{value}": must be equal to {name} '
                                  f"limit of {limits[name]}"))
    return errors


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    errors = []
    for group in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(group) or []):
            errors += _resources(container.get("resources") or {},
                                 f"spec.{group}[{i}].resources")
    claims = {c.get("name") for c in spec.get("resourceClaims") or []}
    for i, container in enumerate(spec.get("containers") or []):
        for j, claim in enumerate((container.get("resources") or {}).get("claims") or []):
            if claim.get("name") not in claims:
                errors.append((f"spec.containers[{i}].resources.claims[{j}].name",
                               f'Unsupported value: "{claim.get("name")}": must be one of '
                               "the pod's resource claims"))
    return errors


def validate(body: Mapping[str, Any], api_version: str, kind: str) -> None:
    """Raise :class:`Invalid` when the API server would refuse ``body`` (a new object of
    ``kind``); the schema first, then the rules no schema holds."""
    obj = {"apiVersion": api_version, "kind": kind, **body}
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or meta.get("generateName") or "")
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=False)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "<root>"
        raise Invalid(kind, name, ((where, e.message),)) from None
    errors: list[tuple[str, str]] = []
    if not _DNS1123_SUBDOMAIN.match(str(meta.get("name", ""))) or len(name) > 253:
        errors.append(("metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 '
                                        "subdomain must consist of lower case alphanumeric "
                                        "characters, '-' or '.'"))
    errors += _labels(meta.get("labels"), "metadata.labels")
    if kind == "Pod":
        spec = obj.get("spec") or {}
        errors += _labels(spec.get("nodeSelector"), "spec.nodeSelector")
        errors += _containers(spec)
    if errors:
        raise Invalid(kind, name, tuple(errors))


# --- RBAC ---------------------------------------------------------------------------

HUB_USER = "system:serviceaccount:jhub:hub"


@dataclass(frozen=True)
class Rule:
    """One PolicyRule, in a namespace (a Role) or cluster-wide (a ClusterRole)."""

    groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    namespace: str | None  # None: every namespace and the cluster scope

    def allows(self, verb: str, group: str, resource: str, namespace: str | None) -> bool:
        return (
            (group in self.groups or "*" in self.groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
            and (self.namespace is None or self.namespace == namespace)
        )


def roles_from(documents: Iterable[Mapping[str, Any]], namespace: str) -> list[Rule]:
    """The rules of every Role (bound in ``namespace``) and ClusterRole among
    ``documents`` (Kubernetes objects)."""
    rules = []
    for doc in documents:
        if not isinstance(doc, Mapping) or doc.get("kind") not in ("Role", "ClusterRole"):
            continue
        scope = namespace if doc["kind"] == "Role" else None
        for rule in doc.get("rules") or []:
            rules.append(Rule(frozenset(rule.get("apiGroups") or []),
                              frozenset(rule.get("resources") or []),
                              frozenset(rule.get("verbs") or []), scope))
    return rules


def documented_roles(doc: Path, namespace: str = "jupyterhub") -> list[Rule]:
    """The Roles and ClusterRoles in the YAML blocks of ``doc`` (docs/kubernetes.md)."""
    blocks = re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.DOTALL)
    return roles_from((d for b in blocks for d in yaml.safe_load_all(b)), namespace)


def forbidden(verb: str, group: str, resource: str, namespace: str | None,
              name: str = "", user: str = HUB_USER) -> dict:
    """The API server's 403 Status for a request RBAC does not allow."""
    what = f'{resource} "{name}"' if name else resource
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'{what} is forbidden: User "{user}" cannot {verb} resource '
                   f'"{resource}" in API group "{group}" {where}',
        "reason": "Forbidden",
        "details": {"name": name, "group": group, "kind": resource} if name
        else {"group": group, "kind": resource},
        "code": 403,
    }
