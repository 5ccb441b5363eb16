"""Device-cgroup rules for one MIG slice (mig_spawner.core.isolation)."""

from __future__ import annotations

import pytest

from mig_spawner.core.isolation import (
    PSEUDO_DEVICES,
    IsolationError,
    cap_minors,
    capability_paths,
    cgroup_v1_rules,
    device_rules,
    driver_majors,
    driver_numbers,
    systemd_properties,
    systemd_run_args,
)


@pytest.mark.parametrize(
    ("gpu_minor", "gi", "ci", "expected"),
    [
        (0, 1, 0, (12, 13)),  # NVIDIA's documented example
        (0, 0, 0, (3, 4)),  # full-GPU instance on GPU 0
        (1, 7, 0, (3 + 135 + 63, 4 + 135 + 63)),  # a 1g slice at start 0 on GPU 1
        (2, 14, 7, (3 + 270 + 126, 4 + 270 + 126 + 7)),  # last GI, last CI of GPU 2
    ],
)
def test_capability_minors_follow_the_driver_layout(gpu_minor, gi, ci, expected):
    assert cap_minors(gpu_minor, gi, ci) == expected


@pytest.mark.parametrize(
    ("gpu_minor", "gi", "ci", "word"),
    [(-1, 1, 0, "gpu_minor"), (0, 15, 0, "gi_id"), (0, 1, 8, "ci_id"), (0, "1", 0, "gi_id"),
     (0, True, 0, "gi_id")],
)
def test_impossible_numbers_are_refused_with_their_name(gpu_minor, gi, ci, word):
    with pytest.raises(IsolationError, match=word):
        device_rules(gpu_minor, gi, ci)


def test_rules_allow_exactly_the_nodes_of_one_slice():
    rules = device_rules(1, 3, 0)
    assert [r.systemd for r in rules] == [
        "/dev/nvidiactl rw",
        "/dev/nvidia-uvm rw",
        "/dev/nvidia-uvm-tools rw",
        "/dev/nvidia1 rw",
        "/dev/nvidia-caps/nvidia-cap165 r",
        "/dev/nvidia-caps/nvidia-cap166 r",
    ]
    # Another slice of the same GPU gets other capability nodes, so neither sees the other.
    other = {r.path for r in device_rules(1, 4, 0)}
    assert {r.path for r in rules if "caps" in r.path}.isdisjoint(other)


def test_systemd_shapes():
    rules = device_rules(0, 1, 0)
    props = systemd_properties(rules)
    assert props["DevicePolicy"] == "closed"
    assert "/dev/nvidia-caps/nvidia-cap13 r" in props["DeviceAllow"]
    args = systemd_run_args(rules)
    assert args[:2] == ["systemd-run", "--scope"]
    assert "DevicePolicy=closed" in args
    assert "DeviceAllow=/dev/nvidia0 rw" in args
    # Each property is its own -p pair, as systemd-run expects.
    assert args.count("-p") == 1 + len(rules)


def test_capability_paths_for_nvidia_modprobe():
    assert capability_paths(0, 1, 0) == (
        "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access",
        "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access",
    )


PROC_DEVICES = """Character devices:
  1 mem
  5 /dev/tty
195 nvidia-frontend
234 nvidia-uvm
237 nvidia-caps

Block devices:
  8 sd
238 nvidia-caps
"""


def test_device_numbers_come_from_the_drivers_majors():
    majors = driver_majors(PROC_DEVICES)
    assert majors["nvidia-caps"] == 237  # the character device, not a block one
    rules = device_rules(1, 3, 0)
    assert cgroup_v1_rules(rules, driver_numbers(majors), baseline=()) == [
        "c 195:255 rw", "c 234:0 rw", "c 234:1 rw", "c 195:1 rw", "c 237:165 r", "c 237:166 r"]
    # The pseudo devices come first, as systemd's DevicePolicy=closed admits them.
    assert cgroup_v1_rules(rules, driver_numbers(majors))[:len(PSEUDO_DEVICES)] == list(
        PSEUDO_DEVICES)
    # Some driver builds register the GPUs' major as plain "nvidia".
    plain = driver_majors(PROC_DEVICES.replace("nvidia-frontend", "nvidia"))
    assert cgroup_v1_rules(rules[:1], driver_numbers(plain), ()) == ["c 195:255 rw"]


def test_a_driver_without_mig_capabilities_is_named():
    majors = driver_majors(PROC_DEVICES.replace("237 nvidia-caps\n", ""))
    with pytest.raises(IsolationError, match="no 'nvidia-caps' device"):
        cgroup_v1_rules(device_rules(0, 1, 0), driver_numbers(majors))


def test_rules_name_nodes_where_the_device_dir_is():
    assert [r.path for r in device_rules(0, 1, 0, "/tmp/dev/")][-2:] == [
        "/tmp/dev/nvidia-caps/nvidia-cap12", "/tmp/dev/nvidia-caps/nvidia-cap13"]


def test_a_scope_named_for_the_lease_becomes_the_user():
    args = systemd_run_args(device_rules(0, 1, 0), "mig-spawner-abc.scope", "ana")
    assert args[-4:] == ["--unit=mig-spawner-abc.scope", "--slice=system.slice",
                         "--uid=ana", "--"]
