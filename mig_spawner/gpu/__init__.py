"""GPU adapter: NVML through pynvml, and the simulated driver that stands in for it.

``connect()`` is the one entry point: it returns a :class:`GpuAdapter` on the real
driver, or on the simulator when a spec is given (argument or ``MIG_SPAWNER_SIMULATE``).
"""

from __future__ import annotations

import os

from . import errors
from .errors import GpuError, InstanceInUse
from .nvml import GpuAdapter, probe_mig_config_access

__all__ = ["GpuAdapter", "GpuError", "InstanceInUse", "connect", "errors"]

SIMULATE_ENV = "MIG_SPAWNER_SIMULATE"
STATE_ENV = "MIG_SPAWNER_SIM_STATE"


def connect(simulate: str | None = None, state_file: str | os.PathLike | None = None
            ) -> GpuAdapter:
    """Open the GPU adapter.

    ``simulate``: a simulator spec (``"h200x2"``, ``"a100-80gbx4:mig=off"``, a fleet file);
    ``state_file``: a JSON file that lets several processes share one simulated host (with
    an existing state file the spec may be omitted). Both fall back to the environment
    variables ``MIG_SPAWNER_SIMULATE`` and ``MIG_SPAWNER_SIM_STATE``. With neither, the
    real NVIDIA driver is used. Raises :class:`GpuError` subclasses with a ``hint``.
    """
    simulate = simulate or os.environ.get(SIMULATE_ENV) or None
    state_file = state_file or os.environ.get(STATE_ENV) or None
    if simulate is None and state_file is None:
        _drop_simulated_library()
        return GpuAdapter(privilege_probe=probe_mig_config_access)
    # Imported here so that a process on the real driver never loads the simulator.
    from .simulator import SimulatedHost, SimulatedNvmlLibrary

    host = SimulatedHost.from_spec(simulate, state_file)
    return GpuAdapter(library=SimulatedNvmlLibrary(host),
                      privilege_probe=lambda: host.refresh().caller_config)


def _drop_simulated_library() -> None:
    """A simulator left installed in this process must not pose as the real driver."""
    import pynvml

    if type(pynvml.nvmlLib).__module__.startswith(f"{__name__}.simulator"):
        with pynvml.libLoadLock:
            pynvml.nvmlLib = None
            pynvml._nvmlGetFunctionPointer_cache.clear()
