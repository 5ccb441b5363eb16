"""Group policies: who may have which MIG slice, how many, and for how long.

The public face of the policy layer; the code lives in three small modules:

* :mod:`.policy_model`: the values (:class:`Offer`, :class:`GroupPolicy`,
  :class:`UserPolicy`, :class:`PolicySet`) and multi-group resolution;
* :mod:`.policy_build`: :func:`build_policy`, validation of the admin's dicts;
* :mod:`.policy_quota`: :func:`check_claim`, the quota check a claim runs.

Pure: no I/O and no traitlets or JupyterHub import (``mig_spawner.config`` wraps this
in a traitlets Configurable). Admin documentation: docs/policies.md.
"""

from mig_spawner.core.policy_build import CLASS_KEYS, GROUP_KEYS, OFFER_KEYS, build_policy
from mig_spawner.core.policy_model import (
    DEFAULT_GROUP,
    GroupPolicy,
    Offer,
    PolicyError,
    PolicySet,
    UserPolicy,
    offer_key,
)
from mig_spawner.core.policy_quota import (
    GROUP_QUOTA,
    NO_GPU_ACCESS,
    NOT_ALLOWED,
    USER_LIMIT,
    GroupUsage,
    Holding,
    QuotaRefusal,
    check_claim,
    tally,
)

__all__ = [
    "CLASS_KEYS",
    "DEFAULT_GROUP",
    "GROUP_KEYS",
    "GROUP_QUOTA",
    "NOT_ALLOWED",
    "NO_GPU_ACCESS",
    "OFFER_KEYS",
    "USER_LIMIT",
    "GroupPolicy",
    "GroupUsage",
    "Holding",
    "Offer",
    "PolicyError",
    "PolicySet",
    "QuotaRefusal",
    "UserPolicy",
    "build_policy",
    "check_claim",
    "offer_key",
    "tally",
]
