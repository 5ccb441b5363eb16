"""A simulated NVIDIA driver for mig-spawner, installed at pynvml's ``nvmlLib`` seam.

``install(host)`` makes every ``pynvml`` call answer from a :class:`SimulatedHost`, so the
GPU adapter runs exactly the code it runs on a real driver. See docs/simulator.md.
"""

from __future__ import annotations

import pynvml

from .host import DeviceRef, SimulatedHost
from .library import SimulatedNvmlLibrary
from .spec import GroupSpec, HostSpec, SpecError, parse_spec
from .state import mig_device_uuid

__all__ = [
    "DeviceRef",
    "GroupSpec",
    "HostSpec",
    "SimulatedHost",
    "SimulatedNvmlLibrary",
    "SpecError",
    "activate",
    "install",
    "installed",
    "mig_device_uuid",
    "parse_spec",
    "uninstall",
]


def install(host: SimulatedHost) -> SimulatedNvmlLibrary:
    """Put a simulated library for ``host`` at ``pynvml.nvmlLib`` and return it."""
    lib = SimulatedNvmlLibrary(host)
    activate(lib)
    return lib


def activate(lib: SimulatedNvmlLibrary) -> None:
    """Make ``lib`` the library pynvml calls (again), dropping pynvml's symbol cache."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()


def installed() -> SimulatedNvmlLibrary | None:
    """The simulated library pynvml currently uses, if any."""
    lib = pynvml.nvmlLib
    return lib if isinstance(lib, SimulatedNvmlLibrary) else None


def uninstall() -> None:
    """Remove a simulated library, so that pynvml loads the real one on its next init."""
    with pynvml.libLoadLock:
        if isinstance(pynvml.nvmlLib, SimulatedNvmlLibrary):
            pynvml.nvmlLib = None
            pynvml._nvmlGetFunctionPointer_cache.clear()
