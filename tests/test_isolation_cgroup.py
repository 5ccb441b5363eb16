"""Kernel-enforced isolation, for real: a server the LocalMIGSpawner starts can open only
its own slice's device nodes, and so can everything it starts.

Needs root and a writable cgroup v1 ``devices`` controller (CI has both; without them
the tests fail under ``MIG_SPAWNER_REQUIRE_SYSTEM=1``). The GPUs are the simulator's;
their device nodes are stand-ins made with ``mknod`` in a temporary folder, named with
the minors the catalog computes (``nvidia-caps/nvidia-cap<3 + 135*gpu + 9*gi>``) and
mapped onto existing character devices (/dev/null, zero, full, random, urandom, kmsg),
so that an allowed open really succeeds. The other user's capability nodes are mapped
onto numbers no driver backs: outside the cgroup opening them fails with ENXIO (no
such device); inside, with EPERM, which only the device cgroup answers.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from jupyterhub.spawner import SpawnException
from traitlets.config import PyFileConfigLoader

from mig_spawner import device_cgroup, holder
from mig_spawner.cli import demo, doctor
from mig_spawner.cli.main import build_parser
from mig_spawner.core.catalog import capability_minors
from mig_spawner.core.isolation import PSEUDO_DEVICES, cgroup_v1_rules, device_rules
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import LeaseRequest, Ledger
from mig_spawner.spawner import LocalMIGSpawner, SimpleLocalMIGSpawner
from tests.support.polling import until
from tests.support.spawners import local_spawner, make_spawner
from tests.support.system_deps import missing, require_device_cgroup

SIM = "h200x1:layout=1g.18gb*2"  # two slices: ana's, and bob's
# Existing devices a confined process may really open, one per allowed node.
# (Not ptmx: a stand-in ptmx looks for a devpts beside itself.)
REAL = [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (1, 11)]
UNBACKED = [(1, 250), (1, 251)]

# The "server": opens each node, starts a child that does the same with an empty
# environment (only its cgroup ties it to the slice), reports, and waits to be stopped.
PROBE = r"""
import json, os, subprocess, sys, time
out, paths = sys.argv[1], json.loads(os.environ["PROBE_PATHS"])
def probe(name):
    seen = {}
    for path in paths:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY))
            seen[path] = "ok"
        except OSError as e:
            seen[path] = e.errno
    report = {"pid": os.getpid(), "opens": seen}
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))
if len(sys.argv) > 2 and sys.argv[2] == "child":
    probe("child.json")
else:
    subprocess.Popen([sys.executable, __file__, out, "child"],
                     env={"PROBE_PATHS": os.environ["PROBE_PATHS"]})
    probe("server.json")
time.sleep(120)
"""


def mknod(path: Path, number: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(*number))


def stand_ins(dev: Path, gpu_minor: int, mine: tuple[int, int], theirs: tuple[int, int]
              ) -> tuple[list[str], list[str]]:
    """Nodes for one GPU, ana's slice (``mine``: GI, CI) and bob's; returns the paths ana
    may open and bob's capability nodes."""
    real = iter(REAL)
    allowed = []
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{gpu_minor}"):
        mknod(dev / name, next(real))
        allowed.append(str(dev / name))
    for minor in capability_minors(gpu_minor, *mine):
        mknod(dev / "nvidia-caps" / f"nvidia-cap{minor}", next(real))
        allowed.append(str(dev / "nvidia-caps" / f"nvidia-cap{minor}"))
    other = []
    for minor, number in zip(capability_minors(gpu_minor, *theirs), UNBACKED,
                             strict=True):
        mknod(dev / "nvidia-caps" / f"nvidia-cap{minor}", number)
        other.append(str(dev / "nvidia-caps" / f"nvidia-cap{minor}"))
    return allowed, other


def opens(path: str) -> str | int:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY))
    except OSError as e:
        return e.errno
    return "ok"


class ConfinedSpawner(SimpleLocalMIGSpawner):
    """No pseudo devices beyond the slice: the stand-ins are pseudo devices themselves,
    and the probe opens none of its own (:func:`test_the_pseudo_devices_stay_open`
    covers them)."""

    device_baseline = ()


def spawner(tmp_path: Path, user: str, cls=SimpleLocalMIGSpawner):
    """``user``'s spawner with isolation on (off by default with simulated GPUs), its
    device nodes the stand-ins under ``tmp_path/dev``."""
    return local_spawner(tmp_path, f"sqlite:///{tmp_path / 'ledger.sqlite'}", user=user,
                         sim=SIM, cls=cls, isolation=True, device_dir=str(tmp_path / "dev"),
                         home_dir_template=str(tmp_path / "home" / "{username}"))


def probed(path: Path, timeout: float = 15.0) -> dict:
    """What the probe wrote to ``path``, once it has."""
    until(path.exists, timeout, f"{path.name} from the probe", every=0.02)
    return json.loads(path.read_text())


async def test_a_server_opens_only_its_own_slices_nodes(tmp_path):
    hierarchy = require_device_cgroup()
    SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")
    # Bob holds one slice, so ana's server gets the other.
    bob = spawner(tmp_path, "bob")
    mine = bob.user_policy(bob.policies())
    plan = await bob.claim_decide(mine.offer("small"), mine)
    with Ledger.open(bob.ledger_url) as ledger:
        bobs = ledger.leases.claim(LeaseRequest("bob"), plan.decide)
    with connect(simulate=SIM, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        inventory = gpus.inventory()
    gpu = inventory.gpus[0]
    ana_device = next(d for d in inventory.mig_devices if d.uuid != bobs.mig_uuid)
    allowed, bobs_nodes = stand_ins(tmp_path / "dev", gpu.minor,
                                    (ana_device.gi_id, ana_device.ci_id),
                                    (bobs.gi_id, bobs.ci_id))
    # Outside any device cgroup: every node ana may open opens; bob's are no device.
    assert [opens(p) for p in allowed] == ["ok"] * 6
    assert [opens(p) for p in bobs_nodes] == [errno.ENXIO] * 2

    s = spawner(tmp_path, "ana", ConfinedSpawner)
    out = tmp_path / "out"
    out.mkdir()
    s.cmd = [sys.executable, str(tmp_path / "probe.py"), str(out)]
    (tmp_path / "probe.py").write_text(PROBE)
    s.environment = {"PROBE_PATHS": json.dumps(allowed + bobs_nodes)}
    s.user_options = {"profile": "small"}
    s.interrupt_timeout = s.term_timeout = 2
    await s.start()
    try:
        lease = s._lease
        assert lease.mig_uuid == ana_device.uuid
        group = hierarchy / device_cgroup.PARENT / lease.id
        server, child = probed(out / "server.json"), probed(out / "child.json")
        expected = {**dict.fromkeys(allowed, "ok"),
                    **dict.fromkeys(bobs_nodes, errno.EPERM)}
        assert server["opens"] == expected
        assert child["opens"] == expected  # the rule is inherited
        assert server["pid"] == s.pid
        # Both are in the slice's group, so both hold the slice, although the child's
        # environment no longer names the lease.
        assert device_cgroup.pids_in_slice_cgroup(lease) == {s.pid, child["pid"]}
        found = holder.check(lease, members=device_cgroup.pids_in_slice_cgroup(lease))
        assert found.state == holder.RUNNING and set(found.pids) == {s.pid, child["pid"]}
        rules = (group / "devices.list").read_text().splitlines()
        assert rules[0] == "c 1:3 rw" and "c 1:11 r" in rules and len(rules) == 6
    finally:
        await s.stop()
    # The server stopped; its child, found by its cgroup, was stopped before the slice
    # was given back; and the group went with them.
    assert holder.start_time(child["pid"]) is None
    assert not group.exists()
    with Ledger.open(s.ledger_url) as ledger:
        assert not ledger.leases.get(lease.id).held


def test_the_pseudo_devices_stay_open(tmp_path):
    """A confined server keeps /dev/null, the terminals and the random devices (what
    systemd's DevicePolicy=closed admits), and nothing else of the host's."""
    require_device_cgroup()
    groups = device_cgroup.SliceCgroups(parent=f"mig-spawner-test-{os.getpid()}")
    groups.create("pseudo", cgroup_v1_rules((), lambda rule: (0, 0), PSEUDO_DEVICES))
    join = groups.joiner("pseudo")
    try:
        probe = ("import os\nfor p in ('/dev/null', '/dev/urandom', '/dev/ptmx', '/dev/kmsg'):\n"
                 "    try: os.close(os.open(p, os.O_RDWR if p != '/dev/kmsg' else os.O_RDONLY))"
                 "; print('ok')\n    except OSError as e: print(e.errno)")
        done = subprocess.run([sys.executable, "-c", probe], preexec_fn=join,
                              capture_output=True, text=True, check=True, timeout=30)
    finally:
        join.close()
    assert done.stdout.split() == ["ok", "ok", "ok", str(errno.EPERM)]
    assert groups.pids("pseudo") == set()
    assert groups.remove("pseudo")
    (groups.hierarchy / groups.parent).rmdir()


@pytest.mark.parametrize("setting", [None, False])
async def test_simulated_gpus_run_unconfined_unless_asked(tmp_path, setting):
    """Off by default with the simulator (and whenever set False): no group, no wrapper."""
    SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")
    s = spawner(tmp_path, "ana")
    s.isolation = setting
    assert s.isolation_mechanism() is None


@pytest.mark.parametrize(("layout", "root", "why"), [
    (["devices/devices.allow"], False, "the hub does not run as root"),
    (["cgroup.controllers"], True, "cgroup v2, where device control needs systemd"),
    (["cgroup.controllers", "systemd"], True, "'systemd-run' is not in the hub's PATH"),
    ([], True, "neither a cgroup v1 devices hierarchy nor cgroup v2"),
])
def test_a_host_without_a_device_cgroup_says_why(tmp_path, monkeypatch, layout, root, why):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    support = device_cgroup.host_support(tmp_path, tmp_path / "systemd", is_root=root,
                                         caps_dir=tmp_path / "nvidia-caps")
    assert support.mechanism is None and why in support.why
    # Where the driver has capability nodes, their permissions confine servers instead
    # (when the hub is root, as only root may give them away).
    (tmp_path / "nvidia-caps").mkdir()
    support = device_cgroup.host_support(tmp_path, tmp_path / "systemd", is_root=root,
                                         caps_dir=tmp_path / "nvidia-caps")
    if root:
        assert support.mechanism == device_cgroup.CAPABILITY_NODES and why in support.why
    else:
        assert support.mechanism is None


def test_each_kind_of_host_gets_its_mechanism(tmp_path, monkeypatch):
    (tmp_path / "v1" / "devices").mkdir(parents=True)
    (tmp_path / "v1" / "devices" / "devices.allow").touch()
    assert device_cgroup.host_support(tmp_path / "v1", is_root=True).mechanism == (
        device_cgroup.CGROUP_V1)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").touch()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "systemd-run").touch(mode=0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert device_cgroup.host_support(tmp_path / "v2", tmp_path / "v2", is_root=True
                                      ).mechanism == device_cgroup.SYSTEMD


class NoDeviceControl(SimpleLocalMIGSpawner):
    host_support = staticmethod(lambda **_: device_cgroup.HostSupport(None, "no controller"))


async def test_isolation_asked_for_on_a_host_without_it_refuses_the_spawn(tmp_path, caplog):
    SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")
    s = spawner(tmp_path, "ana", NoDeviceControl)
    s.user_options = {"profile": "small"}
    with pytest.raises(SpawnException) as refused:
        await s.start()
    assert refused.value.jupyterhub_message == (
        "GPU isolation is on but this host cannot apply it; tell a hub admin.")
    assert "no controller" in refused.value.log_message  # the why, for the admin's log
    with Ledger.open(s.ledger_url) as ledger:
        assert ledger.leases.active() == []  # the slice was given back


class SystemdHost(SimpleLocalMIGSpawner):
    host_support = staticmethod(lambda **_: device_cgroup.HostSupport(device_cgroup.SYSTEMD))


class SystemdHostPerUser(SystemdHost):
    runs_as_user = True  # as LocalMIGSpawner: each server as its user's account


@pytest.mark.parametrize("cls", [SystemdHost, SystemdHostPerUser])
async def test_on_cgroup_v2_the_server_starts_in_a_scope_named_for_its_lease(tmp_path, cls):
    SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")
    s = spawner(tmp_path, "root", cls)
    s.cmd = ["jupyterhub-singleuser"]
    mine = s.user_policy(s.policies())
    plan = await s.claim_decide(mine.offer("small"), mine)
    with Ledger.open(s.ledger_url) as ledger:
        lease = ledger.leases.claim(LeaseRequest("root"), plan.decide)
    await s.prepare_slice(lease)
    run_as = ["--uid=root"] if cls.runs_as_user else []
    assert s.cmd[:2] == ["systemd-run", "--scope"]
    assert s.cmd[-4 - len(run_as):] == [
        f"--unit=mig-spawner-{lease.id}.scope", "--slice=system.slice", *run_as, "--",
        "jupyterhub-singleuser"]
    assert f"DeviceAllow={tmp_path}/dev/nvidiactl rw" in s.cmd
    # systemd-run must start as root to make the scope: it becomes the user itself, so
    # the child only changes to the user's home (root's, here).
    started = subprocess.run(["pwd"], preexec_fn=s.make_preexec_fn("root"), text=True,
                             capture_output=True, check=True, timeout=30)
    home = "/root" if cls.runs_as_user else str(tmp_path / "home" / "root")
    assert started.stdout.strip() == home


V1 = device_cgroup.HostSupport(device_cgroup.CGROUP_V1)
NONE = device_cgroup.HostSupport(None, "this host runs cgroup v2, where device control "
                                 "needs systemd (DevicePolicy=), and systemd is not running")
CAPS = device_cgroup.HostSupport(device_cgroup.CAPABILITY_NODES, NONE.why)


@pytest.mark.parametrize(("setting", "simulated", "host", "status", "words"), [
    (None, False, V1, "pass", "only its slice's device nodes (cgroup v1 devices); this "
     "protects servers that do not run as root: a root process can leave its cgroup"),
    (None, False, NONE, "warn", "servers are NOT confined to their slice: this host runs "
     "cgroup v2, where device control needs systemd"),
    (True, False, NONE, "fail", "LocalMIGSpawner.isolation is True but this host cannot "
     "confine servers (this host runs cgroup v2"),
    (True, True, NONE, "fail", "every spawn will fail"),
    (False, False, V1, "warn", "off (LocalMIGSpawner.isolation = False)"),
    (None, True, V1, "pass", "off: the GPUs are simulated (LocalMIGSpawner.isolation = "
     "True, or mig-spawner demo --isolation, turns it on)"),
    (True, True, V1, "pass", "(cgroup v1 devices)"),
    (None, False, CAPS, "pass", "each user's servers can read only their own slices' "
     "capability nodes (capability-node permissions; no device cgroup: this host runs "
     "cgroup v2"),
])
def test_doctor_names_how_servers_are_confined_or_why_not(setting, simulated, host, status,
                                                          words):
    check = doctor.check_device_isolation(setting, simulated, host)
    assert (check.name, check.status.value) == ("device isolation", status)
    assert words in check.detail
    assert bool(check.fix) == (status != "pass")
    # The capability nodes are looked for only where servers are to be confined.
    assert doctor.confines(setting, simulated, host) == (
        status == "fail" or "only their own" in check.detail or "only its" in check.detail)


def test_the_processes_in_a_slices_scope_or_group_hold_it(tmp_path):
    """Read as the holder rule reads them: the lease's cgroup v1 group, or its systemd
    scope on cgroup v2 (here a folder standing in for /sys/fs/cgroup)."""
    lease = type("L", (), {"id": "0123abcd"})()
    groups = device_cgroup.SliceCgroups(tmp_path / "devices")
    scopes = tmp_path / "system.slice"
    assert device_cgroup.pids_in_slice_cgroup(lease, groups, scopes) == set()
    (scopes / "mig-spawner-0123abcd.scope").mkdir(parents=True)
    (scopes / "mig-spawner-0123abcd.scope" / "cgroup.procs").write_text("41\n42\n")
    (tmp_path / "devices" / "mig-spawner" / "0123abcd").mkdir(parents=True)
    (tmp_path / "devices" / "mig-spawner" / "0123abcd" / "cgroup.procs").write_text("7\n")
    assert device_cgroup.pids_in_slice_cgroup(lease, groups, scopes) == {7, 41, 42}
    # An id that cannot name a group has none (and none is ever made for it).
    assert device_cgroup.pids_in_slice_cgroup(type("L", (), {"id": ".."})(), groups, scopes
                                              ) == set()
    with pytest.raises(ValueError, match="cannot name a cgroup"):
        groups.create("../x", [])


def test_the_demo_flag_confines_simulated_servers_on_stand_in_nodes(tmp_path):
    require_device_cgroup()
    args = build_parser().parse_args(["demo", "--simulate", "--isolation",
                                      "--dir", str(tmp_path)])
    demo.check_isolation(args)  # this host can: no error
    path = demo.write_config(args, tmp_path)
    made = demo.make_stand_ins(args, tmp_path)
    config = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    assert config.LocalMIGSpawner.isolation is True
    s = make_spawner(config, cls=SimpleLocalMIGSpawner)
    assert s.isolation_mechanism() == device_cgroup.CGROUP_V1
    with connect(simulate=args.simulate, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        inventory = gpus.inventory()
    numbers = set()
    for gpu in inventory.gpus:
        for d in gpu.mig_devices:
            rules = device_rules(gpu.minor, d.gi_id, d.ci_id, s.device_dir)
            assert {r.path for r in rules} <= set(made)
            numbers |= set(cgroup_v1_rules(rules, s.device_numbers(), baseline=()))
    # One number per node, none of them a real device of the mem driver.
    assert {n.split()[1] for n in numbers} == {f"1:{64 + i}" for i in range(len(made))}
    assert [opens(p) for p in made[:3]] == [errno.ENXIO] * 3


async def test_the_demo_confines_a_whole_gpu_server_to_its_stand_in_node(tmp_path):
    """A GPU with MIG off gets its stand-in node too: a whole-GPU spawn with simulated
    isolation starts (it failed with 500, the hub finding no node to confine it to), and
    its server opens its GPU's node (no driver behind it: ENXIO), not the other GPU's."""
    require_device_cgroup()
    args = build_parser().parse_args([
        "demo", "--simulate", "h200x1:layout=1g.18gb*2+h200x1:mig=off", "--isolation",
        "--dir", str(tmp_path)])
    path = demo.write_config(args, tmp_path)
    demo.make_stand_ins(args, tmp_path)
    config = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    config.MIGSettings.ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    config.MIGPolicyConfig.group_policies = {  # as jupyterhub_config.d/25-whole-gpus.py
        **config.MIGPolicyConfig.group_policies, "gpu-users": {"allowed": ["gpu"]}}
    s = make_spawner(config, "gia", ["gpu-users"], cls=ConfinedSpawner)
    dev = Path(s.device_dir)
    own, other = str(dev / "nvidia1"), str(dev / "nvidia0")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    s.cmd = [sys.executable, str(tmp_path / "probe.py"), str(out)]
    s.environment = {"PROBE_PATHS": json.dumps([own, other])}
    s.user_options = {"profile": "gpu"}
    s.interrupt_timeout = s.term_timeout = 2
    await s.start()
    try:
        assert s._lease.mode == "gpu" and s._lease.gpu_index == 1
        server = probed(out / "server.json")
        assert server["opens"] == {own: errno.ENXIO, other: errno.EPERM}
    finally:
        await s.stop()


NOBODY, BOBS_UID = pwd.getpwnam("nobody").pw_uid, 4242


class NoCgroupHost(LocalMIGSpawner):
    """A host with the driver's capability nodes but no device cgroup (cgroup v2 without
    systemd): the real decision, on a cgroup folder that has neither."""

    host_support = staticmethod(lambda caps_dir: device_cgroup.host_support(
        Path("/nonexistent"), caps_dir=caps_dir))


async def test_without_a_cgroup_a_users_server_reads_only_its_own_capability_nodes(tmp_path):
    """Capability-node permissions: ana's server runs as a Unix account (nobody here)
    that may read its slice's GI and CI nodes and no other slice's."""
    if os.geteuid() != 0:
        missing("capability-node permissions are given by root (chown)")
    # The probe runs as nobody: a Python that nobody may run (the test's may be in /root).
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        missing("no system python3 for the probe that runs as nobody")
    base = Path(tempfile.mkdtemp(prefix="mig-caps-"))  # readable by nobody, unlike tmp_path
    try:
        base.chmod(0o755)
        await _confined_by_capability_nodes(tmp_path, base, python)
    finally:
        shutil.rmtree(base)


async def _confined_by_capability_nodes(tmp_path: Path, base: Path, python: str) -> None:
    SimulatedHost.from_spec(SIM, tmp_path / "sim-gpus.json")
    bob = spawner(tmp_path, "bob")
    mine = bob.user_policy(bob.policies())
    with Ledger.open(bob.ledger_url) as ledger:
        bobs = ledger.leases.claim(LeaseRequest("bob"),
                            (await bob.claim_decide(mine.offer("small"), mine)).decide)
    with connect(simulate=SIM, state_file=str(tmp_path / "sim-gpus.json")) as gpus:
        ana_device = next(d for d in gpus.inventory().mig_devices if d.uuid != bobs.mig_uuid)
    dev = base / "dev"
    control = [dev / n for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0")]
    anas = [dev / "nvidia-caps" / f"nvidia-cap{m}"
            for m in capability_minors(0, ana_device.gi_id, ana_device.ci_id)]
    bobs_nodes = [dev / "nvidia-caps" / f"nvidia-cap{m}"
                  for m in capability_minors(0, bobs.gi_id, bobs.ci_id)]
    # A node of a slice no lease holds, still nobody's since an earlier server of theirs
    # (its lease released by a hub that died before it gave the nodes back).
    stale = dev / "nvidia-caps" / "nvidia-cap30"
    for path, number in zip([*control, *anas, *bobs_nodes, stale],
                            [*REAL[:5], (1, 5), (1, 8), (1, 3), (1, 7)], strict=True):
        mknod(path, number)
        path.chmod(0o666 if path in control else 0o444)  # as the driver makes them
    for path in bobs_nodes:  # as bob's server's start left them: his alone
        os.chown(path, BOBS_UID, BOBS_UID)
        path.chmod(0o400)
    os.chown(stale, NOBODY, NOBODY)
    out = base / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    (base / "probe.py").write_text(PROBE)
    (base / "probe.py").chmod(0o644)

    s = spawner(tmp_path, "nobody", NoCgroupHost)
    s.device_dir = str(dev)
    s.cmd = [python, str(base / "probe.py"), str(out)]
    paths = [str(p) for p in (*control, *anas, *bobs_nodes, stale)]
    s.environment = {"PROBE_PATHS": json.dumps(paths)}
    s.user_options = {"profile": "small"}
    s.interrupt_timeout = s.term_timeout = 2
    assert s.isolation_mechanism() == device_cgroup.CAPABILITY_NODES
    await s.start()
    try:
        server, child = probed(out / "server.json"), probed(out / "child.json")
    finally:
        await s.stop()
        os.kill(probed(out / "child.json")["pid"], 9)  # no cgroup finds it: the weakness
    expected = {**dict.fromkeys(paths[:6], "ok"), **dict.fromkeys(paths[6:], errno.EACCES)}
    assert server["opens"] == expected and child["opens"] == expected
    # Given back: ana's nodes are root's alone again, as the stale one was made at her
    # start; bob's stay his while his lease holds them.
    def owner(path: Path) -> tuple[int, int]:
        return path.stat().st_uid, stat.S_IMODE(path.stat().st_mode)

    assert [owner(p) for p in (*anas, stale)] == [(0, 0o400)] * 3
    assert [owner(p) for p in bobs_nodes] == [(BOBS_UID, 0o400)] * 2
