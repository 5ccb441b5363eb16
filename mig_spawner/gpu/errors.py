"""Typed GPU errors: each says what went wrong and, in ``hint``, what to do about it.

The adapter turns pynvml's ``NVMLError_*`` into these, adding what it was doing (which
GPU, which profile, which instance) so that a CLI or a spawn page can show them as is.
"""

from __future__ import annotations

import pynvml

MIG_CONFIG_DEVICE = "/dev/nvidia-caps/nvidia-cap1"
MIG_CONFIG_PROC = "/proc/driver/nvidia/capabilities/mig/config"
MIG_MONITOR_DEVICE = "/dev/nvidia-caps/nvidia-cap2"
MIG_MONITOR_PROC = "/proc/driver/nvidia/capabilities/mig/monitor"


class GpuError(Exception):
    """Base of every GPU adapter error: ``str()`` is the message, ``hint`` what to do."""

    default_hint = "see the NVIDIA driver logs (dmesg, nvidia-smi -q) for details"

    def __init__(self, message: str, hint: str | None = None, *, code: int | None = None
                 ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint
        self.code = code  # the NVML return code behind this error, when there is one


class NvmlLibraryNotFound(GpuError):
    default_hint = (
        "install the NVIDIA driver, which ships libnvidia-ml.so.1, and check that the loader "
        "finds it (ldconfig -p | grep nvidia-ml); to try mig-spawner without a GPU, set "
        "MIG_SPAWNER_SIMULATE=h200x2"
    )


class DriverNotLoaded(GpuError):
    default_hint = (
        "load the NVIDIA kernel module (modprobe nvidia) or reboot after installing the "
        "driver, then check that nvidia-smi works"
    )


class NoSuchGpu(GpuError):
    default_hint = "list the GPUs with 'nvidia-smi -L' or 'mig-spawner status' and use one of them"


class MigNotSupported(GpuError):
    default_hint = (
        "MIG needs an A100, A30, H100, H200, GH200 or B200-class GPU; use one of those, "
        "or serve this GPU without MIG"
    )


class MigDisabled(GpuError):
    default_hint = "enable MIG as root: nvidia-smi -i <gpu> -mig 1 (reset the GPU if asked)"


class MigPending(GpuError):
    default_hint = (
        "a MIG mode change waits for a GPU reset: stop the processes on that GPU and run "
        "'nvidia-smi -i <gpu> -r' as root, or reboot"
    )


class NoPermission(GpuError):
    default_hint = (
        f"run as root, or give this user read access to the MIG config capability "
        f"{MIG_CONFIG_DEVICE} (see {MIG_CONFIG_PROC}); pool mode, which uses instances an "
        "admin made beforehand, needs no privilege"
    )


class MonitorCapabilityMissing(NoPermission):
    """The MIG monitor capability is not readable: GPU and compute instances cannot be
    listed, so no slice can be seen, offered or spawned on."""

    default_hint = (
        f"run as root, or give this user read access to the MIG monitor capability "
        f"{MIG_MONITOR_DEVICE} (see {MIG_MONITOR_PROC}); NVIDIA makes it world-readable "
        "(0444), so something on this host restricted it; in a container set "
        "NVIDIA_MIG_MONITOR_DEVICES=all"
    )


class UnknownProfile(GpuError):
    default_hint = "use one of the profiles this GPU lists (nvidia-smi mig -lgip)"


class InvalidPlacement(GpuError):
    default_hint = "use a start this profile allows (nvidia-smi mig -lgipp)"


class InsufficientResources(GpuError):
    default_hint = (
        "the memory slices are taken or the profile's instance limit is reached: choose "
        "another placement, a smaller profile, or free an idle instance"
    )


class InstanceNotFound(GpuError):
    default_hint = "list the instances with 'nvidia-smi mig -lgi' or 'mig-spawner status'"


class InstanceInUse(GpuError):
    """Processes still run on the instance; ``pids`` lists them (may be empty if hidden)."""

    def __init__(self, message: str, pids: tuple[int, ...] = (), hint: str | None = None,
                 *, code: int | None = pynvml.NVML_ERROR_IN_USE) -> None:
        if hint is None:
            hint = (
                f"stop the processes using it first (PIDs {', '.join(map(str, pids))})"
                if pids else "stop the processes using it first (nvidia-smi shows them)"
            )
        super().__init__(message, hint, code=code)
        self.pids = tuple(pids)


class GpuLost(GpuError):
    """NVML answers GPU_IS_LOST: the GPU fell off the bus (Xid 79) or cannot be reached."""

    default_hint = (
        "the GPU has fallen off the bus or is otherwise unreachable: look for Xid errors "
        "in the kernel log (dmesg); stop what runs on it and reset it as root "
        "(nvidia-smi -i <gpu> -r), or reboot; its slices are not offered meanwhile"
    )


class NvmlCallFailed(GpuError):
    """Any other NVML failure; ``code`` holds NVML's return code."""


def from_nvml(exc: pynvml.NVMLError, doing: str) -> GpuError:
    """Translate an ``NVMLError`` raised while ``doing`` (e.g. "creating 3g.40gb on GPU 0")."""
    code = exc.value
    text = f"{doing} failed: {exc}"
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return NvmlLibraryNotFound("the NVML library (libnvidia-ml.so.1) was not found",
                                   code=code)
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return DriverNotLoaded("the NVIDIA kernel driver is not loaded", code=code)
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return GpuLost(text, code=code)
    if code == pynvml.NVML_ERROR_IN_USE:
        return InstanceInUse(text)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return NoPermission(text, code=code)
    if code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES:
        return InsufficientResources(text, code=code)
    if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return NvmlCallFailed(
            text, "the NVIDIA driver is older than this NVML call needs; upgrade the driver",
            code=code)
    return NvmlCallFailed(text, code=code)
