"""The simulated driver, driven through pynvml's own wrappers as a real program would."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from ctypes import byref, c_uint

import pynvml
import pytest

from mig_spawner.gpu.simulator import SimulatedHost, SpecError, install, installed, uninstall

MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")
H100_1G, H100_1G_ME, H100_2G, H100_3G, H100_7G = 19, 20, 14, 9, 0


@pytest.fixture
def nvml():
    """``nvml(spec)`` installs a simulated host at pynvml's seam and initialises NVML."""

    def start(spec: str, state_file=None) -> SimulatedHost:
        host = SimulatedHost.from_spec(spec, state_file)
        install(host)
        pynvml.nvmlInit()
        return host

    yield start
    lib = installed()
    while lib is not None and lib.init_count:
        pynvml.nvmlShutdown()
    uninstall()


def gpu(index: int = 0):
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def create(profile_id: int, start: int | None = None, index: int = 0):
    """Create a GI (at ``start``, or where the driver chooses) and return its info."""
    if start is None:
        gi = pynvml.nvmlDeviceCreateGpuInstance(gpu(index), profile_id)
    else:
        size = {H100_1G: 1, H100_1G_ME: 1, H100_2G: 2, H100_3G: 4, H100_7G: 8}[profile_id]
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            gpu(index), profile_id, byref(placement))
    return gi, pynvml.nvmlGpuInstanceGetInfo(gi)


def mig_handles(index: int = 0):
    handles = []
    for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu(index))):
        with contextlib.suppress(pynvml.NVMLError_NotFound):  # a hole in the index range
            handles.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(index), i))
    return handles


# --- placement rules -----------------------------------------------------------------


def test_naive_creation_fragments_the_gpu_like_the_real_driver(nvml):
    nvml("h100x1")
    starts = [create(p)[1].placement.start for p in (H100_1G, H100_1G, H100_2G)]
    assert starts == [6, 4, 0]  # the driver's own order, not the densest one
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(H100_3G)


def test_chosen_placements_fit_all_four_and_ids_follow_placement(nvml):
    nvml("h100x1")
    ids = [create(p, s)[1].id for p, s in
           ((H100_1G, 0), (H100_1G, 1), (H100_2G, 2), (H100_3G, 4))]
    assert ids == [7, 8, 4, 2]
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(), H100_1G) == 0


@pytest.mark.parametrize("start", range(7))
def test_size_one_instance_at_start_s_gets_id_7_plus_s(nvml, start):
    nvml("h200x1")
    assert create(H100_1G, start)[1].id == 7 + start


def test_overlap_and_misaligned_placements_are_refused(nvml):
    nvml("h100x1")
    create(H100_3G, 0)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(H100_2G, 2)  # slices 2-3 belong to the 3g instance
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        create(H100_2G, 5)  # 2g starts at 0, 2 or 4 only
    assert create(H100_2G, 4)[1].id == 5


def test_only_one_media_extension_instance(nvml):
    nvml("h100x1")
    create(H100_1G_ME, 0)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(), H100_1G_ME) == 0
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(), H100_1G) == 6
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(H100_1G_ME, 1)


def test_one_me_rule_spans_profiles_on_a30(nvml):
    nvml("a30x1")
    a30 = gpu()
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        a30, 21, byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 1)))  # 1g.6gb+me
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            a30, 6, byref(pynvml.c_nvmlGpuInstancePlacement_t(2, 2)))  # 2g.12gb+me


def test_per_profile_cap_counts_instances(nvml):
    nvml("h100x1")
    create(H100_3G, 0)
    create(H100_3G, 4)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(), H100_3G) == 0
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
        gpu(), pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert info.instanceCount == 2


# --- profiles, instances and MIG devices ------------------------------------------------


def test_profile_info_by_enum_returns_chip_specific_ids(nvml):
    nvml("h100x1+a30x1")
    h100 = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 0)
    assert (h100.id, h100.name, h100.sliceCount, h100.memorySizeMB) == (19, "MIG 1g.10gb", 1,
                                                                          9984)
    assert pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu(1), 0).id == 14
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu(0), 8)  # 2_SLICE_REV1 is A30 only


def test_possible_placements_use_the_two_call_protocol(nvml):
    nvml("h100x1")
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(), H100_2G, None, byref(count))
    slots = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(), H100_2G, slots, byref(count))
    assert [(p.start, p.size) for p in slots] == [(0, 2), (2, 2), (4, 2)]


def test_mig_device_handles_uuids_names_and_ids(nvml):
    nvml("h100x1:layout=3g.40gb,1g.10gb")
    handles = mig_handles()
    assert len(handles) == 2
    first = handles[0]
    assert pynvml.nvmlDeviceIsMigDeviceHandle(first).value == 1
    assert not pynvml.nvmlDeviceIsMigDeviceHandle(gpu())
    assert pynvml.nvmlDeviceGetName(first) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert MIG_UUID.match(pynvml.nvmlDeviceGetUUID(first))
    assert pynvml.nvmlDeviceGetUUID(gpu()).startswith("GPU-")
    assert (pynvml.nvmlDeviceGetGpuInstanceId(first),
            pynvml.nvmlDeviceGetComputeInstanceId(first)) == (2, 0)
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(first)
    assert pynvml.nvmlDeviceGetUUID(parent) == pynvml.nvmlDeviceGetUUID(gpu())
    by_uuid = pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(first))
    assert pynvml.nvmlDeviceIsMigDeviceHandle(by_uuid)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(), 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(), 7)


def test_mig_uuids_are_stable_across_hosts_built_from_one_spec(nvml):
    one = SimulatedHost.from_spec("h200x2:layout=1g.18gb*7").device_uuids()
    two = SimulatedHost.from_spec("h200x2:layout=1g.18gb*7").device_uuids()
    assert one == two and len(set(one)) == 14


def test_processes_and_memory_are_settable_per_mig_device(nvml):
    host = nvml("h100x1:layout=2g.20gb")
    uuid = host.device_uuids()[0]
    handle = mig_handles()[0]
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle) == []
    host.set_processes(uuid, [(4242, 1000), (4343, 24)])
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory // 2**20, p.gpuInstanceId) for p in procs] == [
        (4242, 1000, 5), (4343, 24, 5)]  # packed at the highest start: GI 5
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 1024 * 2**20
    host.set_memory_used((0, 5, 0), 5000)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    assert (memory.used // 2**20, memory.total // 2**20) == (5000, 20096)  # 19.625 GiB


def test_compute_instance_is_full_size_and_listed(nvml):
    nvml("h100x1")
    gi, _ = create(H100_3G, 4)
    ci_profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    # It shares its GPU instance's copy and media engines (H100 3g: 3 decoders, 3 JPEG).
    assert (ci_profile.sharedCopyEngineCount, ci_profile.sharedDecoderCount,
            ci_profile.sharedEncoderCount, ci_profile.sharedJpegCount,
            ci_profile.sharedOfaCount) == (3, 3, 0, 3, 0)
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    info = pynvml.nvmlComputeInstanceGetInfo(ci)
    assert (info.id, info.placement.size) == (0, 3)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
    array = (pynvml.c_nvmlComputeInstance_t * 1)()
    count = c_uint(0)
    pynvml.nvmlGpuInstanceGetComputeInstances(gi, ci_profile.id, array, byref(count))
    assert count.value == 1


def _offered(gi) -> dict[int, tuple[int, int]]:
    """What the GPU instance's compute-instance profile info call answers, per enum:
    (slices, SMs), as `nvidia-smi mig -lcip` lists it."""
    offered = {}
    for enum_index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, enum_index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except pynvml.NVMLError_NotSupported:
            continue
        offered[enum_index] = (info.sliceCount, info.multiprocessorCount)
    return offered


@pytest.mark.parametrize(("spec", "profile_id", "size", "offered"), [
    # A100 -lcip: a 1g offers only itself; a 2g 1c and itself; a 4g 1c, 2c and itself (no
    # 3c); a 7g 1c to 4c and itself.
    ("a100-40gbx1", 19, 1, {0: (1, 14)}),
    ("a100-40gbx1", 14, 2, {0: (1, 14), 1: (2, 28)}),
    ("a100-40gbx1", 5, 4, {0: (1, 14), 1: (2, 28), 3: (4, 56)}),
    ("a100-40gbx1", 0, 8, {0: (1, 14), 1: (2, 28), 2: (3, 42), 3: (4, 56), 4: (7, 98)}),
    # Hopper's double-memory 1g: only 1_SLICE_REV1 (enum 7), with the GI's 26 SMs;
    # `nvidia-smi mig -cgi 15 -C` makes "MIG 1g.20gb (ID 7)" on an H100.
    ("h100x1", 15, 2, {7: (1, 26)}),
    ("h200x1", 15, 2, {7: (1, 26)}),
])
def test_a_gpu_instance_offers_the_compute_profiles_the_real_driver_lists(
        nvml, spec, profile_id, size, offered):
    nvml(spec)
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu(), profile_id, byref(pynvml.c_nvmlGpuInstancePlacement_t(0, size)))
    assert _offered(gi) == offered
    full = max(offered, key=lambda e: (offered[e][1], -e))
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, full)
    assert pynvml.nvmlComputeInstanceGetInfo(ci).profileId == full
    for smaller in set(offered) - {full}:
        with pytest.raises(pynvml.NVMLError):  # several CIs per GI: out of scope
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, smaller)


def test_busy_instances_cannot_be_destroyed(nvml):
    host = nvml("h100x1:layout=7g.80gb")
    host.set_processes((0, 0, 0), [(777, 100)])
    gi = pynvml.nvmlDeviceGetGpuInstanceById(gpu(), 0)
    ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlGpuInstanceDestroy(gi)  # it still holds its compute instance
    host.set_processes((0, 0, 0), [])
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert mig_handles() == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetGpuInstanceById(gpu(), 0)


# --- MIG mode, GPUs without MIG, permissions ------------------------------------------------


def test_gpu_without_mig_answers_not_supported(nvml):
    nvml("t4x1")
    assert pynvml.nvmlDeviceGetName(gpu()) == "Tesla T4"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(gpu())
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceCreateGpuInstance(gpu(), 19)


def test_ampere_mig_enable_is_pending_until_reset(nvml):
    host = nvml("a100-80gbx1:mig=off")
    status = pynvml.nvmlDeviceSetMigMode(gpu(), pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert pynvml.nvmlDeviceGetMigMode(gpu()) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        create(H100_1G)  # MIG is not live yet
    host.reset_gpu(0)
    assert pynvml.nvmlDeviceGetMigMode(gpu()) == [1, 1]
    assert create(H100_1G, 0)[1].id == 7


def test_hopper_mig_switch_is_immediate_but_not_with_instances(nvml):
    nvml("h200x1:mig=off")
    assert pynvml.nvmlDeviceSetMigMode(gpu(), 1) == pynvml.NVML_SUCCESS
    assert pynvml.nvmlDeviceGetMigMode(gpu()) == [1, 1]
    create(H100_1G, 0)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlDeviceSetMigMode(gpu(), 0)


def test_spec_mig_pending(nvml):
    nvml("a100-40gbx1:mig=pending")
    assert pynvml.nvmlDeviceGetMigMode(gpu()) == [0, 1]


def test_permissions(nvml):
    host = nvml("h100x1:perm=config")
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceSetMigMode(gpu(), 0)  # root only
    gi, _ = create(H100_1G, 0)
    host.set_permissions(mig_config=False)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        create(H100_1G, 1)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlGpuInstanceDestroy(gi)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu(), H100_1G) == 6  # reads work


# --- faithfulness of the seam and error injection ------------------------------------------


def test_calls_before_init_and_unknown_symbols_fail_like_libnvidia_ml(nvml):
    host = nvml("h100x1")
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetFanSpeed(gpu())
    assert host.calls["nvmlDeviceGetCount_v2"] == 1


def test_error_injection_for_n_calls(nvml):
    host = nvml("h100x2")
    host.inject_error("nvmlDeviceGetCount_v2", "DRIVER_NOT_LOADED", count=2)
    host.inject_error("nvmlDeviceCreateGpuInstanceWithPlacement", pynvml.NVML_ERROR_UNKNOWN)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlDeviceGetCount()
    assert pynvml.nvmlDeviceGetCount() == 2
    with pytest.raises(pynvml.NVMLError_Unknown):
        create(H100_1G, 0)
    assert create(H100_1G, 0)[1].id == 7
    with pytest.raises(ValueError, match="not an NVML error name"):
        host.inject_error("nvmlDeviceGetCount_v2", "BROKEN")


def test_in_use_error_text_is_nvmls(nvml):
    nvml("h100x1")
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)) == "In use by another client"


# --- spec strings and fleet files -------------------------------------------------------------


def test_multi_group_spec_with_driver(nvml):
    host = nvml("a100-80gbx2:driver=550.54.15+h200x2")
    assert pynvml.nvmlDeviceGetCount() == 4
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 12040
    names = [pynvml.nvmlDeviceGetName(gpu(i)) for i in range(4)]
    assert names == ["NVIDIA A100-SXM4-80GB"] * 2 + ["NVIDIA H200"] * 2
    assert len({g.uuid for g in host.state.gpus}) == 4


def test_plus_me_belongs_to_the_profile_not_to_the_group_list(nvml):
    nvml("h100x1:layout=1g.10gb+me,1g.10gb+a30x1")
    assert pynvml.nvmlDeviceGetCount() == 2
    names = sorted(pynvml.nvmlDeviceGetName(h).split()[-1] for h in mig_handles(0))
    assert names == ["1g.10gb", "1g.10gb+me"]


def test_layout_is_packed_densely_and_deterministically(nvml):
    nvml("h100x1:layout=1g.10gb*2,2g.20gb,3g.40gb")
    gis = [(pynvml.nvmlDeviceGetGpuInstanceId(h), pynvml.nvmlDeviceGetName(h).split()[-1])
           for h in mig_handles()]
    assert gis == [(2, "3g.40gb"), (4, "2g.20gb"), (7, "1g.10gb"), (8, "1g.10gb")]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("h300x2", "unknown GPU model 'h300'.*known: a100-40gb"),
        ("h200x0", "at least 1"),
        ("h200x2:color=red", "unknown option 'color'.*mig=on"),
        ("h200x2:mig=maybe", "mig=maybe is not one of on, off, pending"),
        ("h100x1:layout=1g.18gb", "'1g.18gb' is not a MIG profile of the H100.*1g.10gb"),
        ("h100x1:layout=3g.40gb*3", "3g.40gb.3 cannot be made on one H100 80GB: three "
                                    "3g.40gb instances do not fit, at most two"),
        ("h100x1:layout=1g.10gb+me*2", "two 1g.10gb.me instances do not fit, at most one"),
        ("h100x1:layout=4g.40gb,3g.40gb,1g.10gb", "need 8 compute slices, the GPU has 7"),
        ("h100x1:layout=3g.40gb*2,1g.10gb", "need 9 memory slices, the GPU has 8"),
        ("h200x1:driver=banana", "not a driver version"),
        ("h200x1:driver=550.54.15+a100-80gbx1:driver=570.133.20", "sets driver twice"),
        ("t4x1:layout=1g.10gb", "has no MIG"),
        ("h200x1:mig=off:layout=1g.18gb", "a layout needs mig=on"),
        ("h200x1:layout=1g.18gb*x", "must be a number"),
        ("", "give a simulator spec"),
        ("missing.yaml", "cannot read simulator fleet file"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(SpecError, match=message) as exc:
        SimulatedHost.from_spec(spec)
    assert "docs/simulator.md" in exc.value.hint  # a GpuError, so the CLI shows the hint


def test_fleet_files_yaml_and_json(nvml, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "driver: 560.35.03\nperm: config\ngpus:\n"
        "  - {model: h200, count: 2, layout: [1g.18gb, 3g.71gb]}\n"
        "  - {model: a100-40gb, mig: off}\n"
    )
    host = nvml(str(fleet))
    assert pynvml.nvmlDeviceGetCount() == 3
    assert len(mig_handles(1)) == 2
    assert pynvml.nvmlDeviceGetMigMode(gpu(2)) == [0, 0]
    assert not host.state.root and host.state.mig_config
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"model": "h200", "colour": "red"}]}))
    with pytest.raises(SpecError, match=r"unknown keys \['colour'\]"):
        SimulatedHost.from_spec(str(bad))


# --- the shared state file ------------------------------------------------------------------

_CHILD = """
import sys, pynvml
from mig_spawner.gpu.simulator import SimulatedHost, install
host = SimulatedHost.open(sys.argv[1])
install(host)
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
    h, 14, pynvml.byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 2)))
host.set_processes(host.device_uuids()[0], [(31337, 512)])
print(len(host.device_uuids()))
"""


def test_state_file_is_shared_between_processes(nvml, tmp_path):
    state = tmp_path / "sim.json"
    host = nvml("h100x1:layout=3g.40gb", state)  # packed at start 4
    assert len(mig_handles()) == 1
    child = subprocess.run([sys.executable, "-c", _CHILD, str(state)], capture_output=True,
                           text=True, timeout=60, check=True)
    assert child.stdout.strip() == "1"  # it saw our instance; its new GI has no CI yet
    assert pynvml.nvmlDeviceGetGpuInstanceById(gpu(), 3)  # the child's 2g instance
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(mig_handles()[0])
    assert [p.pid for p in procs] == [31337]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        create(H100_2G, 0)  # the child's instance holds those slices for us too
    assert SimulatedHost.open(state).state.gpus[0].gis.keys() == host.state.gpus[0].gis.keys()


def test_state_file_must_match_the_spec(tmp_path):
    state = tmp_path / "sim.json"
    SimulatedHost.from_spec("h200x1", state)
    assert SimulatedHost.from_spec("h200x1", state).state.spec == "h200x1"
    with pytest.raises(SpecError, match="holds the simulated host 'h200x1', not 'h100x1'"):
        SimulatedHost.from_spec("h100x1", state)
    with pytest.raises(SpecError, match="does not exist"):
        SimulatedHost.open(tmp_path / "other.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(SpecError, match="not a mig-spawner simulator state file") as exc:
        SimulatedHost.open(tmp_path / "junk.json")
    assert "delete it" in exc.value.hint


# --- nvml.h with MIG off, NVML's privilege rules, GI ID schemes, process-list calls ---------


def test_mig_off_answers_as_nvml_h_says(nvml):
    nvml("h100x1:mig=off")
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu()) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu(), pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    count = c_uint(0)  # possible placements come whatever the mode
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(), H100_3G, None, byref(count))
    assert count.value == 2


@pytest.mark.parametrize("spec", ["h200x1:perm=config", "h200x1:perm=none",
                                  "h200x1:unprivileged"])
def test_a_caller_without_root_is_refused_the_parent_gpus_totals(nvml, spec):
    """nvml.h: with MIG on, a parent handle answers memory and processes "only if the
    caller has appropriate privileges"; per-instance figures come from the MIG device
    handles. These are NVML's rules, on with every spec: only the caller changes."""
    host = nvml(f"{spec}:layout=1g.18gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100)])
    for call in (pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetComputeRunningProcesses):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call(gpu())
    mig = mig_handles()[0]
    assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 16 * 1024 ** 3  # its own: fine
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(mig)] == [4242]
    host.set_permissions(root=True)
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu()).total == 143770 * 2 ** 20
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu())] == [4242]


def test_with_mig_off_the_parent_is_anyones_to_read(nvml):
    nvml("h200x1:perm=none:mig=off")
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu()).total == 143770 * 2 ** 20
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(gpu()) == []


def test_perm_uid_judges_each_caller_by_its_real_uid(nvml, monkeypatch):
    nvml("h200x1:perm=uid:layout=1g.18gb")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetMemoryInfo(gpu())
    with pytest.raises(pynvml.NVMLError_NoPermission):
        create(H100_1G, 0)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu()).total > 0
    assert create(H100_1G, 0)[1].placement.start == 0


@pytest.mark.parametrize("perm", ["config", "none"])
def test_the_monitor_capability_gates_listing_instances(nvml, perm):
    """NVIDIA makes mig/monitor world-readable; monitor=root takes it away from every
    caller but root (HAMi#1044, gpu-feature-discovery#6: "Insufficient Permissions")."""
    host = nvml(f"h200x1:perm={perm}:monitor=root:layout=1g.18gb")
    array = (pynvml.c_nvmlGpuInstance_t * 7)()
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetGpuInstances(gpu(), H100_1G, array, byref(c_uint(0)))
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetGpuInstanceById(gpu(), 13)
    mig = mig_handles()[0]  # the MIG devices themselves are still there
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == 13
    host.set_permissions(root=True)
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstances(gpu(), H100_1G, array, byref(count))
    assert count.value == 1


def test_the_monitor_capability_is_world_readable_by_default(nvml):
    nvml("h200x1:perm=none:layout=1g.18gb")
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstances(gpu(), H100_1G, (pynvml.c_nvmlGpuInstance_t * 7)(),
                                     byref(count))
    assert count.value == 1


@pytest.mark.parametrize(("ids", "expected"), [
    ("forward", [2, 3, 9]),       # the guide's formula: size 4 at 4 -> 2, size 2 at 0 -> 3
    ("reverse", [1, 6, 11]),      # NVIDIA/DCGM#138's A100: size 4 at 4 -> 1
    ("sequential", [1, 2, 3]),    # creation order
])
def test_gi_id_schemes_per_board(nvml, ids, expected):
    nvml(f"a100-80gbx1:ids={ids}")
    got = [create(H100_3G, 4)[1].id, create(H100_2G, 0)[1].id, create(H100_1G, 2)[1].id]
    assert got == expected


def test_gi_id_scheme_is_chosen_per_gpu(nvml):
    nvml("a100-80gbx1:ids=reverse+a100-80gbx1")
    assert create(H100_3G, 4, index=0)[1].id == 1
    assert create(H100_3G, 4, index=1)[1].id == 2


def test_unknown_id_scheme_is_a_clear_error():
    with pytest.raises(SpecError, match="ids=upward is not one of forward, reverse, sequential"):
        SimulatedHost.from_spec("h100x1:ids=upward")


@pytest.mark.parametrize("api", ["v2", "v1"])
def test_an_older_library_lacks_the_newer_process_calls(nvml, api):
    host = nvml(f"h100x1:procs={api}:layout=1g.10gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100)])
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(), 0)
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
    if api == "v2":
        assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(mig)] == [4242]
    else:
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetComputeRunningProcesses_v2(mig)


def test_drivers_535_43_to_86_garble_v3_records_after_the_first(nvml):
    host = nvml("h100x1:driver=535.54.03:layout=1g.10gb")
    host.set_processes(host.device_uuids()[0], [(4242, 100), (4343, 200)])
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu(), 0)
    first, second = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(mig)
    gi_id = pynvml.nvmlDeviceGetGpuInstanceId(mig)
    assert (first.pid, first.gpuInstanceId) == (4242, gi_id)
    assert second.pid != 4343 and second.gpuInstanceId != gi_id
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(mig)] == [4242, 4343]


# --- the driver's table per corrected row: media engines, exact MiB, IDs, SMs, CEs -----------

# (model, NVML profile enum) -> the profile info a real driver answers: name, ID, memory
# MiB, SMs, copy engines, (decoders, encoders, JPEG, OFA), instances.
DRIVER_ROWS = [
    # H200: NVIDIA/mig-parted#120 and the guide: every plain Hopper profile has decoders
    # and JPEG decoders, +me adds the OFA, 7g has 7/7/1.
    ("h200", 0, "1g.18gb", 19, 16384, 16, 1, (1, 0, 1, 0), 7),
    ("h200", 7, "1g.18gb+me", 20, 16384, 16, 1, (1, 0, 1, 1), 1),
    ("h200", 9, "1g.35gb", 15, 33024, 26, 1, (1, 0, 1, 0), 4),
    ("h200", 1, "2g.35gb", 14, 33024, 32, 2, (2, 0, 2, 0), 3),
    ("h200", 2, "3g.71gb", 9, 71168, 60, 3, (3, 0, 3, 0), 2),
    ("h200", 3, "4g.71gb", 5, 71168, 64, 4, (4, 0, 4, 0), 1),
    ("h200", 4, "7g.141gb", 0, 143104, 132, 8, (7, 0, 7, 1), 1),
    # H100: 19.62 GiB is 20096 MiB, not 20091; H100 NVL: 21.62 is 22144, 46.38 is 47488.
    ("h100", 1, "2g.20gb", 14, 20096, 32, 2, (2, 0, 2, 0), 3),
    ("h100-nvl", 9, "1g.24gb", 15, 22144, 26, 1, (1, 0, 1, 0), 4),
    ("h100-nvl", 2, "3g.47gb", 9, 47488, 60, 3, (3, 0, 3, 0), 2),
    # H100 PCIe: 114 SMs, not SXM's 132 (-lgip on 570.169).
    ("h100-pcie", 0, "1g.10gb", 19, 9984, 14, 1, (1, 0, 1, 0), 7),
    ("h100-pcie", 9, "1g.20gb", 15, 20096, 14, 1, (1, 0, 1, 0), 4),
    ("h100-pcie", 1, "2g.20gb", 14, 20096, 30, 2, (2, 0, 2, 0), 3),
    ("h100-pcie", 4, "7g.80gb", 0, 81152, 114, 8, (7, 0, 7, 1), 1),
    # A100: 1g has no media engines, 7g has 5 decoders, 1 JPEG, 1 OFA (the guide).
    ("a100-40gb", 0, "1g.5gb", 19, 4864, 14, 1, (0, 0, 0, 0), 7),
    ("a100-40gb", 1, "2g.10gb", 14, 9856, 28, 2, (1, 0, 0, 0), 3),
    ("a100-80gb", 4, "7g.80gb", 0, 81152, 98, 7, (5, 0, 1, 1), 1),
    # A30: 4g has 4 decoders, 1 JPEG, 1 OFA; 5.81 GiB is 5952 MiB.
    ("a30", 0, "1g.6gb", 14, 5952, 14, 1, (0, 0, 0, 0), 4),
    ("a30", 8, "2g.12gb+me", 6, 11968, 28, 2, (2, 0, 1, 1), 1),
    ("a30", 3, "4g.24gb", 0, 24000, 56, 4, (4, 0, 1, 1), 1),
    # B200 2g.45gb: 4 copy engines and 2 decoders as the real -lgip gives (guide: 3, 1).
    ("b200", 1, "2g.45gb", 14, 45312, 36, 4, (2, 0, 2, 0), 3),
    # RTX PRO 6000 (real -lgip on 610.43.02): a plain 1g has a decoder, an encoder and a
    # JPEG decoder; 2g.48gb+me.all exists (ID 64); -me IDs are 67 (1g) and 66 (2g).
    ("rtx-pro-6000", 0, "1g.24gb", 14, 24192, 46, 1, (1, 1, 1, 0), 4),
    ("rtx-pro-6000", 0xF, "1g.24gb+me.all", 65, 24192, 46, 1, (4, 4, 4, 1), 1),
    ("rtx-pro-6000", 0xD, "1g.24gb-me", 67, 24192, 46, 1, (0, 0, 0, 0), 4),
    ("rtx-pro-6000", 0x10, "2g.48gb+me.all", 64, 48512, 94, 2, (4, 4, 4, 1), 1),
    ("rtx-pro-6000", 0xE, "2g.48gb-me", 66, 48512, 94, 2, (0, 0, 0, 0), 2),
    ("rtx-pro-6000", 3, "4g.96gb", 0, 97408, 188, 4, (4, 4, 4, 1), 1),
    # RTX PRO 5000 (the guide's later revision): 2g.48gb has 4 copy engines, 3/3/1/1.
    ("rtx-pro-5000", 0xF, "1g.24gb+me.all", 65, 24192, 46, 1, (3, 3, 1, 1), 1),
    ("rtx-pro-5000", 1, "2g.48gb", 5, 48384, 92, 4, (3, 3, 1, 1), 1),
]


@pytest.mark.parametrize(("model", "enum", "name", "pid", "mib", "sms", "ces", "media",
                          "count"), DRIVER_ROWS, ids=[f"{r[0]}-{r[2]}" for r in DRIVER_ROWS])
def test_profile_info_answers_as_the_real_driver(nvml, model, enum, name, pid, mib, sms, ces,
                                                 media, count):
    nvml(f"{model}x1")
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu(), enum)
    assert (info.name, info.id, info.memorySizeMB, info.multiprocessorCount,
            info.copyEngineCount, info.instanceCount) == (f"MIG {name}", pid, mib, sms, ces,
                                                          count)
    assert (info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount) == media


def test_rtx_pro_6000_places_on_the_drivers_12_unit_grid(nvml):
    """-lgipp on 610.43.02: {0,3,6,9}:3, {0,6}:6, {0}:12; `-cgi 2g.48gb,1g.24gb,1g.24gb`
    gave GI 1 at 0:6, GI 5 at 6:3 and GI 6 at 9:3."""
    nvml("rtx-pro-6000x1")
    count = c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(), 14, None, byref(count))
    slots = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu(), 14, slots, byref(count))
    assert [(p.start, p.size) for p in slots] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    got = [pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceCreateGpuInstance(gpu(), pid))
           for pid in (5, 14, 14)]
    assert [(i.id, i.placement.start, i.placement.size) for i in got] == [
        (1, 0, 6), (5, 6, 3), (6, 9, 3)]


def test_processes_run_on_a_whole_gpu_as_on_a_mig_device(nvml, tmp_path):
    """With MIG off, the GPU's handle lists what runs on it; the records name no GPU or
    compute instance (NVML sets both to 0xFFFFFFFF); the MIG mode cannot change under it."""
    host = nvml("h200x1:mig=off", tmp_path / "sim.json")
    uuid = pynvml.nvmlDeviceGetUUID(gpu())
    host.set_processes(uuid, [(4242, 1000)])
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(gpu())
    assert [(p.pid, p.usedGpuMemory // 2**20, p.gpuInstanceId, p.computeInstanceId)
            for p in procs] == [(4242, 1000, 0xFFFFFFFF, 0xFFFFFFFF)]
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu()).used == 1000 * 2**20
    host.set_memory_used(uuid, 5000)
    assert SimulatedHost.open(tmp_path / "sim.json").state.gpus[0].processes == [(4242, 1000)]
    assert pynvml.nvmlDeviceGetMemoryInfo(gpu()).used == 5000 * 2**20
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlDeviceSetMigMode(gpu(), 1)
    host.set_processes(uuid, [])
    host.set_memory_used(uuid, None)
    assert pynvml.nvmlDeviceSetMigMode(gpu(), 1) == pynvml.NVML_SUCCESS
    with pytest.raises(KeyError):
        host.set_processes(uuid, [(1, 1)])  # MIG on: processes run on its MIG devices
