"""A GPU's health from the driver: faults the simulator injects, read back through the
GPU adapter (NVML events and the polled checks) and judged by the pure core."""

from __future__ import annotations

import queue
import threading

import pynvml
import pytest
from traitlets import TraitError

from mig_spawner.config import MIGSettings
from mig_spawner.core.health import (
    APPLICATION_XIDS,
    DriverEvent,
    EventKind,
    Fault,
    FaultKind,
    GpuHealth,
    event_fault,
    health_faults,
)
from mig_spawner.gpu import connect, errors
from mig_spawner.gpu.simulator import SimulatedHost, uninstall

SPEC = "h200x2:layout=3g.71gb,2g.35gb,1g.18gb*2"
# Long enough never to be reached when the event comes; the tests wait on the event.
EVENT_TIMEOUT = 30


@pytest.fixture
def gpus(tmp_path):
    """``open_(spec)`` -> an adapter on a simulated host kept in a state file, and the
    adapter's own handle on that host (``SimulatedHost.open(state)`` is another
    process's)."""
    opened = []

    def open_(spec=SPEC):
        opened.append(connect(spec, tmp_path / "sim.json"))
        return opened[-1], pynvml.nvmlLib.host

    yield open_
    for adapter in opened:
        adapter.close()
    uninstall()


@pytest.fixture
def events(gpus):
    """``watch(adapter)`` -> a queue of the driver events the adapter's watcher reads."""

    def watch(adapter, wait_ms=200):
        seen: queue.Queue[DriverEvent] = queue.Queue()
        watcher = adapter.watch_events(seen.put, wait_ms=wait_ms)
        return seen, watcher

    return watch


@pytest.fixture
def xid_events(gpus, events):
    """``read(*xids)`` -> the events the driver delivers for those Xids, posted on GPU 0
    of a fresh adapter, in order."""

    def read(*xids):
        adapter, host = gpus()
        seen, _ = events(adapter)
        for xid in xids:
            host.inject_xid(xid, on=0)
        return [seen.get(timeout=EVENT_TIMEOUT) for _ in xids]

    return read


def faults_of(adapter, expected=None):
    return [f for h in adapter.health(expected) for f in health_faults(h)]


# --- events: Xid and double-bit ECC, through the event set ------------------------------


def test_an_xid_on_a_gpu_wakes_the_reader_and_is_a_fault_of_the_whole_gpu(gpus, events):
    adapter, host = gpus()
    seen, watcher = events(adapter)
    assert watcher.watched == {g.index: g.uuid for g in adapter.inventory().gpus}
    host.inject_xid(79, on=1)
    event = seen.get(timeout=EVENT_TIMEOUT)
    gpu1 = adapter.inventory().gpus[1]
    assert event == DriverEvent(EventKind.XID, 1, gpu1.uuid, xid=79)
    fault = event_fault(event)
    assert fault == Fault(FaultKind.XID, 1, gpu1.uuid, "Xid 79 (the GPU has fallen off the bus)",
                          xid=79)
    assert fault.whole_gpu and str(fault) == "GPU 1: Xid 79 (the GPU has fallen off the bus)"


def test_an_xid_the_driver_attributes_to_a_mig_device_concerns_that_device(gpus, events):
    adapter, host = gpus()
    seen, _ = events(adapter)
    device = adapter.inventory().gpus[0].mig_devices[2]
    host.inject_xid(94, on=device.uuid)
    fault = event_fault(seen.get(timeout=EVENT_TIMEOUT))
    assert (fault.kind, fault.gpu_index, fault.gi_id, fault.ci_id, fault.whole_gpu) == (
        FaultKind.XID, 0, device.gi_id, device.ci_id, False)
    assert str(fault) == (f"GPU 0, GPU instance {device.gi_id} (compute instance 0): "
                          "Xid 94 (contained ECC error)")


def test_an_application_xid_is_no_fault(xid_events):
    first, second = xid_events(13, 48)
    assert (first.xid, event_fault(first)) == (13, None)
    assert event_fault(second).detail == "Xid 48 (double-bit ECC error)"


def test_the_ignored_xids_are_configurable(xid_events):
    app, gsp = xid_events(13, 119)
    settings = MIGSettings()
    assert tuple(settings.ignored_xids) == APPLICATION_XIDS == (13, 31, 43, 45, 68, 109)
    settings.ignored_xids = [119, 119]
    assert settings.ignored_xids == [119]
    assert event_fault(gsp, settings.ignored_xids) is None
    assert event_fault(app, settings.ignored_xids).xid == 13
    assert event_fault(app, ()).xid == 13  # nothing ignored: every Xid is a fault


@pytest.mark.parametrize("bad", [[0], [-13], ["79"], [True]])
def test_a_wrong_xid_is_refused_naming_the_setting(bad):
    with pytest.raises(TraitError, match="ignored_xids"):
        MIGSettings(ignored_xids=bad)


def test_a_double_bit_ecc_error_is_an_event_and_a_counter_of_the_whole_gpu(gpus, events):
    adapter, host = gpus()
    seen, _ = events(adapter)
    host.inject_ecc_error(1, count=2)
    event = seen.get(timeout=EVENT_TIMEOUT)
    assert (event.kind, event.gpu_index, event.gi_id, event.ci_id) == (
        EventKind.DOUBLE_BIT_ECC, 1, None, None)
    assert event_fault(event).kind is FaultKind.ECC and event_fault(event).whole_gpu
    assert [(f.kind, f.gpu_index, f.detail) for f in faults_of(adapter)] == [
        (FaultKind.ECC, 1, "2 uncorrectable ECC memory error(s) since the GPU was last reset")]


def test_events_before_the_watch_began_are_not_delivered(gpus, events):
    adapter, host = gpus()
    host.inject_xid(79, on=0)  # nvml.h: events before registering are not recorded
    seen, _ = events(adapter)
    host.inject_xid(62, on=1)
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 62


def test_one_event_set_and_one_thread_for_the_whole_fleet(gpus, events):
    adapter, host = gpus("h200x8:layout=1g.18gb*7")
    lib, threads = pynvml.nvmlLib, threading.active_count()
    seen, watcher = events(adapter)
    assert (len(watcher.watched), threading.active_count()) == (8, threads + 1)
    assert (lib.host.calls["nvmlEventSetCreate"], lib.host.calls["nvmlDeviceRegisterEvents"]) \
        == (1, 8)
    host.inject_xid(79, on=7)
    assert seen.get(timeout=EVENT_TIMEOUT).gpu_index == 7
    watcher.close()
    assert lib.host.calls["nvmlEventSetFree"] == 1 and not watcher._thread.is_alive()


def test_a_gpu_with_ecc_off_is_watched_for_xids_only(gpus, events):
    adapter, host = gpus()
    host.set_ecc_mode(1, False)
    seen, watcher = events(adapter)
    assert set(watcher.watched) == {0, 1}
    with pytest.raises(ValueError, match="ECC is off"):
        host.inject_ecc_error(1)
    host.inject_xid(79, on=1)
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 79


def test_a_lost_gpu_is_not_watched_and_the_others_are(gpus, events):
    adapter, host = gpus()
    host.lose_gpu(0)
    seen, watcher = events(adapter)
    assert set(watcher.watched) == {1}
    host.inject_xid(79, on=1)
    assert seen.get(timeout=EVENT_TIMEOUT).gpu_index == 1


def test_a_failing_wait_does_not_stop_the_reader(gpus, events, caplog):
    adapter, host = gpus()
    host.inject_error("nvmlEventSetWait_v2", "UNKNOWN")
    seen, _ = events(adapter, wait_ms=50)
    host.inject_xid(79, on=0)
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 79
    assert "waiting for NVML events failed" in caplog.text


def test_events_injected_by_another_process_arrive(gpus, events, tmp_path):
    adapter, _ = gpus()
    seen, _ = events(adapter)
    # Another host object on the state file: what a test beside a hub or service does.
    SimulatedHost.open(tmp_path / "sim.json").inject_xid(79, on=1)
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 79


# --- polled checks --------------------------------------------------------------------------


def test_a_healthy_host_has_no_fault_and_says_what_it_read(gpus):
    adapter, _ = gpus()
    healths = adapter.health()
    assert [(h.gpu_index, h.lost, h.ecc_uncorrected, h.rows_pending, h.rows_failed,
             h.pages_pending) for h in healths] == [(0, False, 0, False, False, None),
                                                    (1, False, 0, False, False, None)]
    assert faults_of(adapter) == []


def test_a_pending_or_failed_row_remap_is_a_fault_of_the_gpu(gpus):
    adapter, host = gpus()
    host.set_remapped_rows(0, pending=True, correctable=1)
    assert [(f.kind, f.gpu_index, f.whole_gpu, f.detail) for f in faults_of(adapter)] == [
        (FaultKind.ROW_REMAP, 0, True, "a faulty memory row waits for a GPU reset to be "
         "remapped")]
    host.set_remapped_rows(0, failed=True)
    assert [f.detail for f in faults_of(adapter)] == [
        "a memory row could not be remapped: the GPU needs service"]
    with pytest.raises(ValueError, match="retires pages"):
        SimulatedHost.from_spec("t4x1").set_remapped_rows(0, pending=True)


def test_retired_pages_pending_before_ampere(gpus):
    adapter, host = gpus("t4x1+h100x1")
    host.set_retired_pages_pending(0)
    t4, h100 = adapter.health()
    assert (t4.pages_pending, t4.rows_pending) == (True, None)  # a T4 retires pages
    assert (h100.pages_pending, h100.rows_pending) == (None, False)  # an H100 remaps rows
    assert [(f.kind, f.gpu_index) for f in faults_of(adapter)] == [
        (FaultKind.RETIRED_PAGES, 0)]
    with pytest.raises(ValueError, match="remaps rows"):
        host.set_retired_pages_pending(1)


def test_not_supported_is_not_known_and_no_fault(gpus):
    adapter, host = gpus()
    host.set_ecc_mode(0, False)
    host.inject_error("nvmlDeviceGetRemappedRows", "NOT_SUPPORTED")
    gpu0 = adapter.health()[0]
    assert (gpu0.ecc_uncorrected, gpu0.rows_pending, gpu0.rows_failed, gpu0.pages_pending) == (
        None, None, None, None)
    assert health_faults(gpu0) == ()


def test_a_lost_gpu_is_a_fault_and_every_call_on_it_says_so(gpus):
    adapter, host = gpus()
    uuid1 = adapter.inventory().gpus[1].uuid
    host.lose_gpu(1)
    assert [(f.kind, f.gpu_index, f.gpu_uuid, f.whole_gpu) for f in faults_of(adapter)] == [
        (FaultKind.LOST, 1, uuid1, True)]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByUUID(uuid1)
    with pytest.raises(errors.GpuLost) as exc:
        adapter.gpu(1)  # what runs on it cannot be read: that must not read as "nothing"
    assert "reset" in exc.value.hint


def test_an_expected_mig_device_the_driver_no_longer_lists_is_missing(gpus):
    adapter, _ = gpus()
    gpu1 = adapter.inventory().gpus[1]
    expected = {gpu1.uuid: [d.uuid for d in gpu1.mig_devices[:2]]}
    assert faults_of(adapter, expected) == []
    adapter.destroy_instance(1, gpu1.mig_devices[0].gi_id)
    assert faults_of(adapter, expected) == [Fault(
        FaultKind.MISSING_INSTANCE, 1, gpu1.uuid, "the driver no longer lists this MIG device",
        device_uuid=gpu1.mig_devices[0].uuid)]
    assert not faults_of(adapter, expected)[0].whole_gpu


def test_a_gpu_that_is_gone_entirely_leaves_its_devices_missing():
    fake = GpuHealth(-1, "GPU-gone", missing=("MIG-a",))
    assert [str(f) for f in health_faults(fake)] == [
        "GPU GPU-gone, MIG device MIG-a: the driver no longer lists this MIG device"]


# --- the inventory with a lost GPU, and a reset -----------------------------------------------


def test_a_lost_gpu_does_not_hide_the_others(gpus):
    adapter, host = gpus()
    before = adapter.inventory()
    host.lose_gpu(1)
    inventory = adapter.inventory()
    gpu0, gpu1 = inventory.gpus
    assert gpu0 == before.gpus[0] and not gpu0.lost
    assert (gpu1.lost, gpu1.uuid, gpu1.product, gpu1.minor) == (
        True, before.gpus[1].uuid, before.gpus[1].product, 1)
    # Nothing on it is offered or counts as free: no MIG, no devices, processes unknown.
    assert (gpu1.mig_devices, gpu1.mig_enabled, gpu1.model_key, gpu1.processes_unknown) == (
        (), False, None, True)
    assert inventory.mig_devices == before.gpus[0].mig_devices


def test_a_gpu_lost_before_this_process_read_it_is_still_listed(gpus):
    _, host = gpus()
    host.lose_gpu(0)
    late = connect(None, host.state_file)
    try:
        lost, gpu1 = late.inventory().gpus
        assert (lost.lost, lost.uuid, lost.minor, gpu1.lost) == (True, "", -1, False)
        assert [h.lost for h in late.health()] == [True, False]
    finally:
        late.close()


def test_a_reset_brings_a_lost_gpu_back_without_its_layout(gpus):
    adapter, host = gpus()
    host.inject_ecc_error(1)
    host.set_remapped_rows(1, pending=True)
    host.lose_gpu(1)
    adapter.reset_gpu(1)
    gpu1 = adapter.inventory().gpus[1]
    assert (gpu1.lost, gpu1.mig_enabled, gpu1.mig_devices) == (False, True, ())
    # The reset applied the remap and restarted the volatile counters.
    assert faults_of(adapter) == []


@pytest.mark.parametrize(("spec", "function"), [
    ("h200x1:layout=7g.141gb", "nvmlDeviceGetComputeRunningProcesses_v3"),
    ("t4x1", "nvmlDeviceGetMemoryInfo"),
])
def test_lost_in_a_call_whose_other_failures_are_tolerated_is_lost(gpus, spec, function):
    adapter, host = gpus(spec)
    host.inject_error(function, "GPU_IS_LOST")
    assert adapter.inventory().gpus[0].lost


def test_lost_in_any_health_call_is_lost_not_unknown(gpus):
    adapter, host = gpus()
    host.inject_error("nvmlDeviceGetRemappedRows", "GPU_IS_LOST")
    assert [h.lost for h in adapter.health()] == [True, False]
