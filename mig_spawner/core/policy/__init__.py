"""Group policies: who may have which MIG slice, how many, and for how long.

This package's face is what callers import; the code lives in four modules:

* :mod:`.model`: the values (:class:`Offer`, :class:`GroupPolicy`,
  :class:`UserPolicy`, :class:`PolicySet`) and multi-group resolution;
* :mod:`.build`: :func:`build_policy`, validation of the admin's dicts;
* :mod:`.quota`: :func:`check_claim`, the quota check a claim runs;
* :mod:`.checks`: warnings on a valid policy that misleads (memory wording, offers
  no MIG device serves, a setting another one keeps from acting).

Pure: no I/O and no traitlets or JupyterHub import (``mig_spawner.config`` wraps this
in a traitlets Configurable). Admin documentation: docs/policies.md.
"""

from .build import CLASS_KEYS, GROUP_KEYS, OFFER_KEYS, build_policy
from .checks import (
    contradiction_warnings,
    memory_wording_warnings,
    unserved_offers,
    unserved_whole_gpus,
)
from .model import (
    DEFAULT_GROUP,
    GroupPolicy,
    Offer,
    OfferKind,
    PolicyError,
    PolicySet,
    UserPolicy,
    is_profile_name,
    offer_key,
)
from .quota import GroupTally, Holding, check_claim, tally

__all__ = [
    "CLASS_KEYS",
    "DEFAULT_GROUP",
    "GROUP_KEYS",
    "OFFER_KEYS",
    "GroupPolicy",
    "GroupTally",
    "Holding",
    "Offer",
    "OfferKind",
    "PolicyError",
    "PolicySet",
    "UserPolicy",
    "build_policy",
    "check_claim",
    "contradiction_warnings",
    "is_profile_name",
    "memory_wording_warnings",
    "offer_key",
    "tally",
    "unserved_offers",
    "unserved_whole_gpus",
]
