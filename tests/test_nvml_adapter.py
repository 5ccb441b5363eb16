"""The GPU adapter on the simulated driver: inventory, create/destroy, typed errors."""

from __future__ import annotations

import ctypes.util
import re

import pynvml
import pytest

from mig_spawner.gpu import connect, errors
from mig_spawner.gpu.simulator import SimulatedHost, uninstall
from tests.mocking import mig_device

MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")
MUTATING = ("nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceDestroy",
            "nvmlComputeInstanceDestroy", "nvmlDeviceSetMigMode")


@pytest.fixture
def adapters():
    """``open_(spec, state_file)`` connects an adapter; all are closed afterwards."""
    opened = []

    def open_(simulate=None, state_file=None):
        adapter = connect(simulate, state_file)
        opened.append(adapter)
        return adapter

    yield open_
    for adapter in opened:
        adapter.close()
    uninstall()


@pytest.fixture
def shared(tmp_path, adapters):
    """An adapter plus a second handle on the same simulated host (as a test or service)."""

    def open_(spec):
        state = tmp_path / "sim.json"
        host = SimulatedHost.from_spec(spec, state)
        return adapters(spec, state), host

    return open_


# --- inventory -----------------------------------------------------------------------------


def test_inventory_of_a_mixed_host(adapters):
    inv = adapters("h100x1:layout=1g.10gb*2,2g.20gb,3g.40gb+a100-80gbx1:mig=pending+t4x1"
                   ":driver=550.54.15").inventory()
    assert (inv.driver_version, inv.cuda_driver_version) == ("550.54.15", 12040)
    h100, a100, t4 = inv.gpus
    assert (h100.model_key, h100.mig_enabled, h100.memory_total_mib) == ("h100", True, 81562)
    assert [(g.gi_id, g.profile, g.start, g.size) for g in h100.gpu_instances] == [
        (2, "3g.40gb", 4, 4), (4, "2g.20gb", 2, 2), (7, "1g.10gb", 0, 1), (8, "1g.10gb", 1, 1)]
    assert [len(g.compute_instances) for g in h100.gpu_instances] == [1, 1, 1, 1]
    assert h100.gpu_instances[0].compute_instances[0].slice_count == 3
    device = h100.mig_devices[0]
    assert MIG_UUID.match(device.uuid) and device.gpu_uuid == h100.uuid
    assert (device.name, device.profile, device.gi_id, device.ci_id, device.start) == (
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "3g.40gb", 2, 0, 4)
    assert (device.memory_total_mib, device.memory_used_mib, device.processes) == (40448, 0, ())
    assert (a100.mig_current, a100.mig_pending, a100.mig_enabled) == (False, True, False)
    assert a100.mig_devices == () and a100.gpu_instances == ()
    assert (t4.mig_supported, t4.model_key, t4.product) == (False, None, "Tesla T4")
    assert mig_device(inv, device.uuid) == device


def test_inventory_shows_processes_and_memory_set_elsewhere(shared):
    adapter, host = shared("h200x2:layout=1g.18gb*7")
    uuid = host.device_uuids()[9]
    host.set_processes(uuid, [(1234, 2048), (1235, 10)])
    host.set_memory_used(uuid, 3000)
    device = mig_device(adapter.inventory(), uuid)
    assert (device.gpu_index, device.pids, device.busy) == (1, (1234, 1235), True)
    assert device.processes[0].used_memory_mib == 2048
    assert device.memory_used_mib == 3000


def test_inventory_is_read_only(shared, tmp_path):
    adapter, _ = shared("h100x2:layout=1g.10gb*3+a100-40gbx1:mig=pending")
    before = (tmp_path / "sim.json").read_bytes()
    adapter.inventory()
    adapter.gpu(0)
    assert (tmp_path / "sim.json").read_bytes() == before
    lib = pynvml.nvmlLib
    assert not [name for name in MUTATING if lib.host.calls[name]]


def test_holes_in_the_mig_index_range_are_skipped(adapters):
    adapter = adapters("h100x1:layout=1g.10gb*3")
    pynvml.nvmlLib.host.inject_error("nvmlDeviceGetMigDeviceHandleByIndex", "INVALID_ARGUMENT")
    assert [d.index for d in adapter.inventory().gpus[0].mig_devices] == [1, 2]
    assert len(adapter.inventory().mig_devices) == 3


def test_hidden_processes_do_not_break_the_inventory(adapters, caplog):
    adapter = adapters("h100x1:layout=7g.80gb")
    pynvml.nvmlLib.host.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", "NO_PERMISSION")
    device = adapter.inventory().mig_devices[0]
    assert (device.processes, device.processes_unknown, device.busy) == ((), True, True)
    assert "cannot list the processes" in caplog.text


def test_listing_instances_without_the_monitor_capability_names_it(adapters):
    adapter = adapters("h100x1:perm=config:monitor=root:layout=7g.80gb")
    with pytest.raises(errors.MonitorCapabilityMissing,
                       match="listing the GPU instances of GPU 0") as exc:
        adapter.inventory()
    assert "/proc/driver/nvidia/capabilities/mig/monitor" in exc.value.hint
    assert isinstance(exc.value, errors.NoPermission)


def test_drivers_without_the_versioned_profile_call_still_work(adapters):
    adapter = adapters("a100-40gbx1")
    pynvml.nvmlLib.host.inject_error("nvmlDeviceGetGpuInstanceProfileInfoV", "FUNCTION_NOT_FOUND",
                                     count=pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    device = adapter.create_instance(0, "1g.10gb", 2)  # the double-memory 1g profile, ID 15
    assert (device.profile, device.gi_id, device.size) == ("1g.10gb", 4, 2)
    assert pynvml.nvmlLib.host.calls["nvmlDeviceGetGpuInstanceProfileInfo"] > 0


# --- creating and destroying ---------------------------------------------------------------


def test_create_at_chosen_placements_fits_what_naive_creation_cannot(adapters):
    adapter = adapters("h100x1")
    made = [adapter.create_instance(0, p, s) for p, s in
            (("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4))]
    assert [(d.gi_id, d.ci_id, d.start, d.size) for d in made] == [
        (7, 0, 0, 1), (8, 0, 1, 1), (4, 0, 2, 2), (2, 0, 4, 4)]
    assert all(MIG_UUID.match(d.uuid) for d in made)
    assert made[3].memory_total_mib == 40448
    assert len(adapter.inventory().mig_devices) == 4


@pytest.mark.parametrize(("spec", "profile"), [
    ("h200x1", "1g.35gb"), ("h100x1", "1g.20gb"), ("gh200x1", "1g.24gb"), ("b200x1", "1g.45gb"),
    ("a100-80gbx1", "1g.20gb"), ("h200x1", "1g.18gb"), ("a30x1", "2g.12gb+me"),
])
def test_every_profile_is_made_with_the_compute_instance_its_driver_offers(
        adapters, spec, profile):
    """Hopper and Blackwell's double-memory 1g spans its GPU instance with compute profile
    1_SLICE_REV1 (7), not 1_SLICE (0): asked of the GPU instance, the driver offers it."""
    gpus = adapters(spec)
    device = gpus.create_instance(0, profile, 0)
    [gi] = [g for g in gpus.gpu(0).gpu_instances if g.gi_id == device.gi_id]
    [ci] = gi.compute_instances
    slices = {"1g": 1, "2g": 2}[profile[:2]]
    assert ci.slice_count == slices
    double_memory_1g = profile == {"h200x1": "1g.35gb", "h100x1": "1g.20gb",
                                   "gh200x1": "1g.24gb", "b200x1": "1g.45gb"}.get(spec)
    assert ci.profile_index == (7 if double_memory_1g else slices - 1)


def test_the_full_compute_profile_is_the_spanning_one_not_the_first_of_its_size():
    from mig_spawner.gpu.nvml import ComputeProfile, full_compute_profile

    # A driver that offered a 16-SM 1_SLICE beside the 26-SM 1_SLICE_REV1 in a double-memory
    # 1g: the one with the GI's SMs spans it.
    both = [ComputeProfile(0, 0, 1, 16), ComputeProfile(7, 7, 1, 26)]
    assert full_compute_profile(both, 1).enum_index == 7
    # An equal pair (as some listings show for a plain 1g): the lowest enum, the default.
    assert full_compute_profile([ComputeProfile(7, 7, 1, 16), ComputeProfile(0, 0, 1, 16)],
                                1).enum_index == 0
    four = [ComputeProfile(0, 0, 1, 14), ComputeProfile(1, 1, 2, 28), ComputeProfile(3, 3, 4, 56)]
    assert full_compute_profile(four, 4).profile_id == 3
    assert full_compute_profile(four, 3) is None


def test_destroy_frees_the_slices(adapters):
    adapter = adapters("h200x1:layout=7g.141gb")
    adapter.destroy_instance(0, 0)
    assert adapter.inventory().gpus[0].gpu_instances == ()
    assert adapter.create_instance(0, "1g.18gb", 6).gi_id == 13


def test_busy_instance_is_not_destroyed_and_names_the_pids(shared):
    adapter, host = shared("h100x1:layout=3g.40gb")
    host.set_processes((0, 2, 0), [(4242, 100), (4343, 1)])
    with pytest.raises(errors.InstanceInUse) as exc:
        adapter.destroy_instance(0, 2)
    assert exc.value.pids == (4242, 4343)
    assert "4242, 4343" in exc.value.hint
    assert len(adapter.inventory().mig_devices) == 1  # nothing was destroyed
    host.set_processes((0, 2, 0), [])
    adapter.destroy_instance(0, 2)
    assert adapter.inventory().mig_devices == ()


def test_failed_compute_instance_does_not_leak_the_gpu_instance(adapters):
    adapter = adapters("h100x1")
    pynvml.nvmlLib.host.inject_error("nvmlGpuInstanceCreateComputeInstance", "UNKNOWN")
    with pytest.raises(errors.NvmlCallFailed, match=r"creating a 2g\.20gb instance .*Unknown"):
        adapter.create_instance(0, "2g.20gb", 0)
    assert adapter.inventory().gpus[0].gpu_instances == ()


# --- typed errors with hints -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "gpu", "profile", "start", "error", "message", "hint"),
    [
        ("h100x1:layout=3g.40gb", 0, "2g.20gb", 4, errors.InsufficientResources,
         "no room for 2g.20gb at memory slices 4-5 on GPU 0", "another placement"),
        ("h100x1", 0, "2g.20gb", 1, errors.InvalidPlacement, "cannot start at memory slice 1",
         r"\[0, 2, 4\]"),
        ("h100x1", 0, "2g.35gb", 0, errors.UnknownProfile, "'2g.35gb' is not a MIG profile",
         r"1g.10gb, 1g.10gb\+me, 1g.20gb, 2g.20gb, 3g.40gb"),
        ("h100x1", 3, "1g.10gb", 0, errors.NoSuchGpu, "no GPU 3; this host has 1 GPU", "-L"),
        ("t4x1", 0, "1g.10gb", 0, errors.MigNotSupported, "Tesla T4", "A100"),
        ("a30x1:mig=off", 0, "1g.6gb", 0, errors.MigDisabled, "disabled on GPU 0",
         "nvidia-smi -i 0 -mig 1"),
        ("a100-40gbx1:mig=pending", 0, "1g.5gb", 0, errors.MigPending,
         "off now and on pending a GPU reset", "nvidia-smi -i 0 -r"),
        ("h200x1:perm=none", 0, "1g.18gb", 0, errors.NoPermission, "creating a 1g.18gb",
         "/dev/nvidia-caps/nvidia-cap1"),
    ],
)
def test_create_errors_are_typed_and_say_what_to_do(adapters, spec, gpu, profile, start, error,
                                                    message, hint):
    with pytest.raises(error, match=message) as exc:
        adapters(spec).create_instance(gpu, profile, start)
    assert re.search(hint, exc.value.hint)
    assert isinstance(exc.value, errors.GpuError)


def test_no_permission_to_destroy_names_the_capability(adapters):
    adapter = adapters("h200x1:layout=1g.18gb:perm=none")
    with pytest.raises(errors.NoPermission) as exc:
        adapter.destroy_instance(0, 13)
    assert "/proc/driver/nvidia/capabilities/mig/config" in exc.value.hint
    assert exc.value.code == pynvml.NVML_ERROR_NO_PERMISSION


def test_destroying_a_missing_instance(adapters):
    with pytest.raises(errors.InstanceNotFound, match="GPU 0 has no GPU instance 9"):
        adapters("h100x1").destroy_instance(0, 9)


@pytest.mark.parametrize(
    ("function", "code", "error"),
    [("nvmlInitWithFlags", "LIBRARY_NOT_FOUND", errors.NvmlLibraryNotFound),
     ("nvmlInitWithFlags", "DRIVER_NOT_LOADED", errors.DriverNotLoaded),
     ("nvmlDeviceGetCount_v2", "GPU_IS_LOST", errors.GpuLost)],
)
def test_injected_driver_failures_become_typed_errors(tmp_path, adapters, function, code, error):
    state = tmp_path / "sim.json"
    SimulatedHost.from_spec("h200x1", state).inject_error(function, code)
    with pytest.raises(error) as exc:
        adapters(state_file=state).inventory()
    assert exc.value.hint
    assert adapters(state_file=state).inventory().gpus[0].product == "NVIDIA H200"


def test_in_use_from_the_driver_is_typed(adapters):
    adapter = adapters("h100x1:layout=1g.10gb")
    pynvml.nvmlLib.host.inject_error("nvmlGpuInstanceDestroy", "IN_USE")
    with pytest.raises(errors.InstanceInUse, match="In use by another client"):
        adapter.destroy_instance(0, 13)


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this host has a real NVIDIA driver")
def test_real_driver_missing_is_a_clear_error(monkeypatch, adapters):
    adapters("h100x1")  # a simulator left installed must not answer for the real driver
    monkeypatch.delenv("MIG_SPAWNER_SIMULATE", raising=False)
    monkeypatch.delenv("MIG_SPAWNER_SIM_STATE", raising=False)
    with pytest.raises(errors.NvmlLibraryNotFound) as exc:
        connect()
    assert "libnvidia-ml.so.1" in str(exc.value)
    assert "MIG_SPAWNER_SIMULATE" in exc.value.hint


# --- wiring --------------------------------------------------------------------------------------


def test_can_configure_follows_the_capability(shared):
    adapter, host = shared("h100x1:perm=config")
    assert adapter.can_configure()
    host.set_permissions(mig_config=False)
    assert not adapter.can_configure()


def test_environment_selects_the_simulator(monkeypatch, tmp_path, adapters):
    monkeypatch.setenv("MIG_SPAWNER_SIMULATE", "a30x3")
    monkeypatch.setenv("MIG_SPAWNER_SIM_STATE", str(tmp_path / "env.json"))
    assert len(adapters().inventory().gpus) == 3
    assert (tmp_path / "env.json").exists()


def test_two_simulated_adapters_in_one_process_stay_apart(adapters):
    first = adapters("h100x1")
    second = adapters("a30x2")
    assert [g.product for g in first.inventory().gpus] == ["NVIDIA H100 80GB HBM3"]
    assert len(second.inventory().gpus) == 2
    first.create_instance(0, "7g.80gb", 0)
    assert second.inventory().mig_devices == ()


# --- unprivileged hubs, process-list fallbacks, GI IDs as the driver gives them -----------


def test_unprivileged_hub_keeps_the_inventory_working(shared):
    adapter, host = shared("h200x2:unprivileged:layout=1g.18gb*2,3g.71gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100)])
    inv = adapter.inventory()
    assert [g.memory_total_mib for g in inv.gpus] == [143770, 143770]  # the catalog's figure
    assert len(inv.mig_devices) == 6
    # Each slice's own process list is anyone's to read (nvml.h); only the parent's is not.
    assert [d.pids for d in inv.mig_devices if d.busy] == [(4242,)]
    assert not any(d.processes_unknown for d in inv.mig_devices)
    assert not adapter.can_configure()
    with pytest.raises(errors.NoPermission, match=r"creating a 1g\.18gb"):
        adapter.create_instance(0, "1g.18gb", 0)


def test_a_hub_with_only_the_config_capability_creates_and_destroys(adapters):
    """Not root, but allowed to make instances: the recommended dynamic-mode hub. The
    parent GPU's memory is refused to it, so the catalog's figure stands in."""
    adapter = adapters("h200x1:perm=config")
    assert adapter.can_configure()
    device = adapter.create_instance(0, "3g.71gb", 4)
    assert device.memory_total_mib == 71168
    assert adapter.inventory().gpus[0].memory_total_mib == 143770
    adapter.destroy_instance(0, device.gi_id)
    assert adapter.inventory().mig_devices == ()


@pytest.mark.parametrize("api", ["v3", "v2", "v1"])
def test_processes_are_read_on_every_library(shared, api):
    adapter, host = shared(f"h100x1:procs={api}:layout=3g.40gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100), (4343, 2048)])
    device = adapter.inventory().mig_devices[0]
    assert (device.pids, device.processes_unknown) == ((4242, 4343), False)
    assert device.processes[1].used_memory_mib == 2048


def test_garbled_v3_records_fall_back_to_v2(shared, caplog):
    adapter, host = shared("h100x1:driver=535.54.03:layout=3g.40gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100), (4343, 1)])
    device = adapter.inventory().mig_devices[0]
    assert (device.pids, device.processes_unknown) == ((4242, 4343), False)
    assert "garbled" in caplog.text
    assert "535.54.03 (535.43-535.86) garbles process lists" in caplog.text


def test_processes_nobody_can_read_are_unknown_not_empty(shared):
    adapter, host = shared("h100x1:procs=v2:layout=3g.40gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100)])
    host.inject_error("nvmlDeviceGetComputeRunningProcesses_v2", "UNKNOWN")
    device = adapter.inventory().mig_devices[0]
    assert (device.processes, device.processes_unknown, device.busy) == ((), True, True)


@pytest.mark.parametrize("ids", ["forward", "reverse", "sequential"])
def test_ids_are_read_back_whatever_the_board_numbering(shared, ids):
    adapter, host = shared(f"a100-80gbx1:ids={ids}")
    made = [adapter.create_instance(0, p, s) for p, s in (("3g.40gb", 4), ("1g.10gb", 0))]
    inv = adapter.inventory()
    assert {(d.gi_id, d.start) for d in inv.mig_devices} == {(d.gi_id, d.start) for d in made}
    assert sorted(host.device_uuids()) == sorted(d.uuid for d in made)
    host.set_processes(made[0].uuid, [(4242, 1)])
    with pytest.raises(errors.InstanceInUse):
        adapter.destroy_instance(0, made[0].gi_id)
    adapter.destroy_instance(0, made[1].gi_id)
    assert [d.uuid for d in adapter.inventory().mig_devices] == [made[0].uuid]


def test_a_failed_refresh_after_creating_rolls_the_instance_back(adapters):
    adapter = adapters("h100x1")
    pynvml.nvmlLib.host.inject_error("nvmlDeviceGetMaxMigDeviceCount", "UNKNOWN")
    with pytest.raises(errors.NvmlCallFailed):
        adapter.create_instance(0, "3g.40gb", 4)
    assert adapter.inventory().gpus[0].gpu_instances == ()


def test_driver_figures_reach_the_inventory(adapters):
    inv = adapters("h200x1:layout=1g.18gb").inventory()
    gpu = inv.gpus[0]
    driver = {p.name: p for p in gpu.driver_profiles}
    assert driver["1g.35gb"].memory_mib == 33024 and driver["7g.141gb"].sm_count == 132
    assert driver["1g.18gb"].media == (1, 0, 1, 0) and driver["7g.141gb"].media == (7, 0, 7, 1)
    assert driver["3g.71gb"].placement_starts == (0, 4)
    assert inv.model("h200").profile("7g.141gb").memory_text == "139.8 GiB"


def test_mig_off_gpu_reports_no_profiles_and_no_devices(adapters):
    adapter = adapters("h100x1:mig=off")
    gpu = adapter.inventory().gpus[0]
    assert (gpu.driver_profiles, gpu.mig_devices) == ((), ())
    assert adapter.driver_profiles(0) == ()
    assert gpu.memory_total_mib == 81562


@pytest.mark.parametrize("spec", ["h200x1", "h200x1:procs=v2", "h200x1:procs=v1",
                                  "h200x1:driver=535.54.03", "h200x1:perm=none"])
def test_what_runs_on_a_whole_gpu_is_in_the_inventory(shared, spec):
    """With MIG off the GPU's own handle lists its processes and memory (anyone may read
    them then), through the same calls and quirks as a MIG device's."""
    adapter, host = shared(f"{spec}:mig=off")
    uuid = adapter.inventory().gpus[0].uuid
    host.set_processes(uuid, [(4242, 100), (4343, 2048)])
    gpu = adapter.inventory().gpus[0]
    assert ([(p.pid, p.used_memory_mib) for p in gpu.processes], gpu.processes_unknown,
            gpu.memory_used_mib) == ([(4242, 100), (4343, 2048)], False, 2148)
    assert gpu.pids_on(uuid) == (4242, 4343)


def test_a_whole_gpus_unreadable_process_list_is_unknown(shared):
    adapter, host = shared("h200x1:procs=v2:mig=off")
    host.set_processes(adapter.inventory().gpus[0].uuid, [(4242, 100)])
    host.inject_error("nvmlDeviceGetComputeRunningProcesses_v2", "NO_PERMISSION")
    gpu = adapter.inventory().gpus[0]
    assert (gpu.processes, gpu.processes_unknown) == ((), True)
