"""One simulated host: its state, the optional shared state file, and the test helpers.

With a state file, several processes (the hub, the slice service, a test) see one host:
writers take an ``fcntl`` lock on ``<state>.lock``, reload, change, atomically replace the
JSON file and bump a generation counter kept in the lock file; readers compare that
counter (memory-mapped, so checking it costs well under a microsecond) before every
simulated NVML call, and reload the JSON when it moved.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import threading
from collections import Counter
from collections.abc import Iterable, Iterator

import pynvml

from . import rules
from .activity import ActivityScript
from .spec import SpecError, parse_spec
from .state import (
    DeviceRef,
    HostState,
    InjectedError,
    SimComputeInstance,
    SimGpu,
    SimGpuInstance,
    mig_device_uuid,
    new_host_state,
)

_GENERATION = struct.Struct("<Q")
# How often a wait for a change (the simulated nvmlEventSetWait) looks at the state
# file for other processes' changes; this process's own changes wake it at once.
FILE_POLL = 0.05


class SimulatedHost(ActivityScript):
    """The simulated GPUs of one host, shared through ``state_file`` when one is given."""

    def __init__(self, state: HostState, state_file: str | None = None) -> None:
        self._state = state
        self.state_file = os.fspath(state_file) if state_file else None
        self._generation_map: mmap.mmap | None = None  # the lock file's 8-byte counter
        self._generation = -1  # the counter value our in-memory state was loaded at
        # Threads of one process share the in-memory state; flock covers other processes.
        self._thread_lock = threading.RLock()
        self._changed = threading.Condition(self._thread_lock)
        self._changes = 0  # changes made through this object (wakes wait_for_change)
        # NVML calls made through this process's simulated library, by function name.
        self.calls: Counter[str] = Counter()

    # --- construction -------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: str | None, state_file: str | os.PathLike | None = None
                  ) -> SimulatedHost:
        """Build the host ``spec`` describes, or join the one already in ``state_file``.

        A state file that exists wins; its spec must then equal ``spec`` (if one is given),
        so that two processes cannot silently disagree about the hardware.
        """
        if state_file is None:
            if not spec:
                raise SpecError("give a simulator spec (e.g. 'h200x2') or a state file")
            return cls(_build(spec))
        host = cls(HostState("", "", False, False, []), state_file)
        if not spec and not os.path.exists(host.state_file):
            # Before the lock: its file must not be left behind by a command that only reads.
            raise _no_state_file(host.state_file)
        with host._locked():
            if os.path.exists(host.state_file):
                try:
                    host._load()
                except (ValueError, KeyError, TypeError) as exc:
                    raise SpecError(
                        f"{host.state_file} is not a mig-spawner simulator state file ({exc})",
                        "delete it (and its .lock file) to start a new simulated host",
                    ) from None
                if spec and host._state.spec != spec.strip():
                    raise SpecError(
                        f"state file {host.state_file} holds the simulated host "
                        f"{host._state.spec!r}, not {spec.strip()!r}; use the same spec, "
                        "or delete the file to start a new host"
                    )
            elif not spec:  # deleted since the check above
                raise _no_state_file(host.state_file)
            else:
                host._state = _build(spec, os.path.abspath(host.state_file))
                host._save()
        return host

    @classmethod
    def open(cls, state_file: str | os.PathLike) -> SimulatedHost:
        """Join the host kept in an existing state file (e.g. from a test)."""
        return cls.from_spec(None, state_file)

    # --- state access (used by the simulated library) -----------------------------

    @property
    def state(self) -> HostState:
        """The state as last loaded; call :meth:`refresh` first to see other processes."""
        return self._state

    def refresh(self) -> HostState:
        """Reload the state if another process changed the file, and return it."""
        if self.state_file is not None:
            self._reload_if_changed()
        return self._state

    @contextlib.contextmanager
    def mutate(self) -> Iterator[HostState]:
        """Change the state under the file lock; the change is saved only if no error."""
        with self._thread_lock:
            if self.state_file is None:
                yield self._state
            else:
                with self._locked():
                    self._reload_if_changed()
                    yield self._state
                    self._save()
            self._changes += 1
            self._changed.notify_all()

    @property
    def changes(self) -> int:
        """How many changes this process made: read it before looking at the state, then
        :meth:`wait_for_change` cannot miss one made in between."""
        return self._changes

    def wait_for_change(self, seen: int, timeout: float) -> None:
        """Block until a change after :attr:`changes` read ``seen``, or ``timeout`` s.
        With a state file, other processes' changes are noticed within ``FILE_POLL`` s
        (so the caller looks again at least that often)."""
        with self._changed:
            if self._changes == seen:
                self._changed.wait(timeout if self.state_file is None
                                   else min(timeout, FILE_POLL))

    def take_injected_error(self, function: str) -> int | None:
        """The injected return code for this call of ``function``, if any (and count it)."""
        if not self._state.injected_errors:
            return None
        if not any(f.function == function for f in self._state.injected_errors):
            return None
        with self.mutate() as state:
            for fault in state.injected_errors:
                if fault.function == function:
                    fault.remaining -= 1
                    state.injected_errors = [f for f in state.injected_errors if f.remaining > 0]
                    return fault.code
        return None

    # --- test helpers -------------------------------------------------------------

    def set_processes(self, device: DeviceRef, processes: Iterable[tuple[int, int]]) -> None:
        """Make ``processes`` ``(pid, used MiB)`` run on a MIG device, or on a whole GPU
        with MIG off (named by its UUID), replacing any."""
        with self.mutate() as state:
            self._find(state, device).processes = [(int(p), int(m)) for p, m in processes]

    def set_memory_used(self, device: DeviceRef, mib: int | None) -> None:
        """Report ``mib`` MiB used on a MIG device or a whole GPU (None: the processes'
        sum)."""
        with self.mutate() as state:
            self._find(state, device).memory_used_mib = mib

    def inject_error(self, function: str, code: int | str, count: int = 1) -> None:
        """Make the next ``count`` calls of NVML ``function`` return ``code``.

        ``code`` is a number or a name: ``"IN_USE"`` / ``"NVML_ERROR_IN_USE"``.
        """
        value = _error_code(code)
        if count < 1:
            raise ValueError("count must be at least 1")
        with self.mutate() as state:
            state.injected_errors.append(InjectedError(function, value, count))

    def clear_errors(self) -> None:
        with self.mutate() as state:
            state.injected_errors.clear()

    def set_permissions(self, *, root: bool | None = None, mig_config: bool | None = None
                        ) -> None:
        """Root may switch MIG mode; the MIG ``config`` capability may create/destroy."""
        with self.mutate() as state:
            if root is not None:
                state.root = root
            if mig_config is not None:
                state.mig_config = mig_config

    def reset_gpu(self, index: int) -> None:
        """Reset a GPU: a pending MIG mode takes effect, all its instances are gone, and
        it is back if lost (a reset here also stands for the reboot a real lost GPU may
        need); its volatile ECC counters restart and a pending remap or page retirement
        is applied."""
        with self.mutate() as state:
            rules.reset_gpu(state.gpus[index])

    # --- health (docs/health.md) ----------------------------------------------------

    def inject_xid(self, xid: int, on: int | DeviceRef) -> None:
        """The driver reports critical Xid ``xid``: on GPU ``on`` (an index), attributed
        to no instance; or on a MIG device (its UUID, or (gpu, GI ID, CI ID)), with its
        GPU and compute instance IDs, as a driver with MIG on does where it can tell.
        Event sets registered for the GPU's Xid events deliver it."""
        if xid < 1:
            raise ValueError(f"{xid} is not an Xid")
        with self.mutate() as state:
            if isinstance(on, int):
                state.post_event(_gpu_at(state, on).index,
                                 pynvml.nvmlEventTypeXidCriticalError, xid)
            else:
                gpu, gi, ci = _mig_device(state, on)
                state.post_event(gpu.index, pynvml.nvmlEventTypeXidCriticalError, xid,
                                 gi.gi_id, ci.ci_id)

    def inject_ecc_error(self, gpu: int, count: int = 1) -> None:
        """``count`` uncorrectable (double-bit) ECC memory errors on GPU ``gpu``: its
        volatile and aggregate counters rise and a double-bit ECC event is posted (never
        attributed to an instance: nvml.h names instances for Xid events only). A real
        driver also logs Xid 48 and, from Ampere on, marks the row for remapping: inject
        those too where a test needs them. ``ValueError`` with ECC off: nothing would
        detect the error."""
        if count < 1:
            raise ValueError("count must be at least 1")
        with self.mutate() as state:
            target = _gpu_at(state, gpu)
            if not target.ecc_enabled:
                raise ValueError(f"ECC is off on simulated GPU {gpu}")
            target.ecc_uncorrected = [n + count for n in target.ecc_uncorrected]
            state.post_event(gpu, pynvml.nvmlEventTypeDoubleBitEccError)

    def set_ecc_mode(self, gpu: int, enabled: bool) -> None:
        """ECC on or off on GPU ``gpu`` (as after the reboot a real change needs). Off,
        the ECC counters and ECC events are NOT_SUPPORTED."""
        with self.mutate() as state:
            _gpu_at(state, gpu).ecc_enabled = bool(enabled)

    def set_remapped_rows(self, gpu: int, *, pending: bool | None = None,
                          failed: bool | None = None, correctable: int | None = None,
                          uncorrectable: int | None = None) -> None:
        """What ``nvmlDeviceGetRemappedRows`` answers for GPU ``gpu`` (unchanged where
        None): a remap pending until the next reset, a remap that failed (for good), and
        the rows remapped so far. ``ValueError`` on a GPU before Ampere, which retires
        pages instead."""
        with self.mutate() as state:
            target = _gpu_at(state, gpu)
            if not rules.remaps_rows(target):
                raise ValueError(f"simulated GPU {gpu} ({target.product}) retires pages; "
                                 "it does not remap rows")
            for slot, value in enumerate((correctable, uncorrectable, pending, failed)):
                if value is not None:
                    target.remapped_rows[slot] = int(value)

    def set_retired_pages_pending(self, gpu: int, pending: bool = True) -> None:
        """Retired pages wait for a reset on GPU ``gpu``. ``ValueError`` on Ampere and
        later, which remap rows instead (and answer NOT_SUPPORTED here)."""
        with self.mutate() as state:
            target = _gpu_at(state, gpu)
            if rules.remaps_rows(target):
                raise ValueError(f"simulated GPU {gpu} ({target.product}) remaps rows; it "
                                 "does not retire pages")
            target.pages_pending = bool(pending)

    def lose_gpu(self, gpu: int) -> None:
        """GPU ``gpu`` falls off the bus: the driver posts Xid 79, and from then on
        every call on it (its handle, its MIG devices, instances, inventory reads)
        answers GPU_IS_LOST, until :meth:`reset_gpu`."""
        with self.mutate() as state:
            target = _gpu_at(state, gpu)
            target.lost = True
            state.post_event(target.index, pynvml.nvmlEventTypeXidCriticalError, 79)

    def device_uuids(self) -> list[str]:
        """Every MIG device UUID, GPU by GPU, in NVML's enumeration order."""
        return [mig_device_uuid(g.uuid, gi.gi_id, ci.ci_id)
                for g in self.refresh().gpus for gi, ci in rules.mig_devices(g)]

    @staticmethod
    def _find(state: HostState, device: DeviceRef) -> SimComputeInstance | SimGpu:
        for gpu in state.gpus:
            if device == gpu.uuid and not gpu.mig_current:
                return gpu  # a whole GPU: processes run on it as on a compute instance
        return _mig_device(state, device)[2]

    # --- file handling ------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(f"{self.state_file}.lock", "a+b", opener=_private) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.fstat(lock.fileno()).st_size < _GENERATION.size:
                    lock.write(bytes(_GENERATION.size))
                    lock.flush()
                if self._generation_map is None:
                    self._generation_map = mmap.mmap(lock.fileno(), _GENERATION.size)
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _reload_if_changed(self) -> None:
        if _GENERATION.unpack_from(self._generation_map)[0] != self._generation:
            self._load()

    def _load(self) -> None:
        # Read the counter first: a write racing with us makes the next call reload again.
        self._generation = _GENERATION.unpack_from(self._generation_map)[0]
        with open(self.state_file, encoding="utf-8") as f:
            self._state = HostState.from_json(json.load(f))

    def _save(self) -> None:
        tmp = f"{self.state_file}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8", opener=_private) as f:
            json.dump(self._state.to_json(), f, separators=(",", ":"))
        os.replace(tmp, self.state_file)  # readers never see a half-written file
        self._generation = _GENERATION.unpack_from(self._generation_map)[0] + 1
        _GENERATION.pack_into(self._generation_map, 0, self._generation)


def _mig_device(state: HostState, device: DeviceRef
                ) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
    for gpu in state.gpus:
        for gi, ci in rules.mig_devices(gpu):
            if device in ((gpu.index, gi.gi_id, ci.ci_id),
                          mig_device_uuid(gpu.uuid, gi.gi_id, ci.ci_id)):
                return gpu, gi, ci
    raise KeyError(f"no simulated MIG device {device!r}")


def _gpu_at(state: HostState, index: int) -> SimGpu:
    if not 0 <= index < len(state.gpus):
        raise KeyError(f"no simulated GPU {index}; the host has {len(state.gpus)}")
    return state.gpus[index]


def _private(path: str, flags: int) -> int:
    """Create files for this user only: the state names who runs what on which slice."""
    return os.open(path, flags, 0o600)


def _build(spec: str, place: str = "") -> HostState:
    host_spec = parse_spec(spec)
    state = new_host_state(host_spec, spec.strip(), place)
    first = 0
    for group in host_spec.groups:
        for gpu in state.gpus[first:first + group.count]:
            if group.layout:
                try:
                    rules.apply_layout(gpu, group.layout)
                except ValueError as exc:
                    raise SpecError(f"simulator spec {spec!r}: {exc}") from None
        first += group.count
    return state


def _error_code(code: int | str) -> int:
    if isinstance(code, int):
        if code not in pynvml.NVMLError._valClassMapping:
            raise ValueError(f"{code} is not an NVML return code")
        return code
    name = code.strip().upper()
    name = name if name.startswith("NVML_ERROR_") else f"NVML_ERROR_{name}"
    value = getattr(pynvml, name, None)
    if not isinstance(value, int):
        raise ValueError(f"{code!r} is not an NVML error name (e.g. 'IN_USE', 'NO_PERMISSION')")
    return value


def _no_state_file(path: str) -> SpecError:
    return SpecError(f"state file {path} does not exist and no simulator spec was given "
                     "to create it")
