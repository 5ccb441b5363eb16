"""The ``mig-spawner`` command as an admin runs it, on a simulated driver.

Its ``main()`` decides what is printed and the exit status, so each case runs it
in-process (what a fresh process would do: arguments, working directory, output and
status); the real process (``python -m``) is run by the device check script's test
and by :func:`test_the_command_runs_as_a_process`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.cli import doctor
from mig_spawner.cli.main import main
from mig_spawner.cli.status import render_text
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import LeaseRequest, Ledger
from tests.support.cli import run_cli


def test_the_command_runs_as_a_process(tmp_path):
    """The wiring the in-process cases skip: the module exits with ``main``'s status,
    and a mistake in what it was given is one line, status 2 (the device check
    script's test runs commands that pass)."""
    wrong = subprocess.run([sys.executable, "-m", "mig_spawner.cli.main", "status",
                            "--simulate", "h9000x1"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("error: ") and wrong.stderr.count("\n") == 1, wrong.stderr
    inside = run_cli("status", "--simulate", "h9000x1")
    assert (inside.returncode, inside.stdout, inside.stderr) == (2, wrong.stdout, wrong.stderr)


def test_status_draws_each_instance_on_its_memory_slices():
    out = run_cli("status", "--simulate", "h200x2:layout=1g.18gb*2,2g.35gb,3g.71gb")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.count("NVIDIA H200") == 2
    slices_line = next(line for line in text.splitlines() if line.strip().startswith("["))
    # 1g at slices 0 and 1 (one cell each), 2g across 2-3, 3g across 4-7: left to right.
    order = [slices_line.index(p) for p in ("1g.18gb", "2g.35gb", "3g.71gb")]
    assert order == sorted(order)
    assert slices_line.count("1g.18gb") == 2
    assert "·free·" not in slices_line
    # one table row per MIG device, each with its MIG UUID
    assert text.count("MIG-") == 8


def test_status_json_lists_devices_with_uuids():
    out = run_cli("status", "--json", "--simulate", "h100x1:layout=1g.10gb*2,2g.20gb,3g.40gb")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    devices = data["gpus"][0]["mig_devices"]
    assert sorted(d["profile"] for d in devices) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    assert all(d["uuid"].startswith("MIG-") for d in devices)


def test_status_marks_busy_instances_and_free_slices():
    adapter = connect(simulate="h200x1:layout=1g.18gb*2")
    try:
        inv = adapter.inventory()
    finally:
        adapter.close()
    text = render_text(inv)
    assert text.count("·free·") == 6  # 8 memory slices, 2 used


def test_doctor_names_disabled_mig_and_the_fix_and_exits_1():
    out = run_cli("doctor", "--simulate", "a100-80gbx1:mig=off")
    assert out.returncode == 1
    assert "[FAIL] MIG mode" in out.stdout
    assert "MIG is disabled" in out.stdout
    assert "nvidia-smi -i 0 -mig 1" in out.stdout


def test_doctor_passes_on_a_ready_host():
    out = run_cli("doctor", "--simulate", "h200x1:layout=1g.18gb*7")
    assert out.returncode == 0, out.stdout
    assert "[FAIL]" not in out.stdout
    assert "0 failed" in out.stdout


def test_doctor_flags_an_old_driver():
    out = run_cli("doctor", "--simulate", "h200x1:driver=535.104.05:layout=1g.18gb*7")
    assert out.returncode == 1
    assert "[FAIL] driver version" in out.stdout
    assert "R550+" in out.stdout


def test_doctor_flags_pending_mig_mode():
    out = run_cli("doctor", "--simulate", "h100x1:mig=pending")
    assert out.returncode == 1
    assert "pending" in out.stdout
    assert "nvidia-smi -r -i 0" in out.stdout


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("pool", doctor.Status.FAIL), ("dynamic", doctor.Status.PASS)],
)
def test_offered_profiles_need_devices_in_pool_mode_only(mode, expected):
    adapter = connect(simulate="h200x1:layout=1g.18gb*7")
    try:
        inv = adapter.inventory()
    finally:
        adapter.close()
    check = doctor.check_offered_profiles(inv, ["1g.18gb", "3g.71gb"], mode)
    assert check.status is expected
    if expected is doctor.Status.FAIL:
        assert "3g.71gb" in check.detail


def test_privilege_is_a_failure_only_in_dynamic_mode():
    assert doctor.check_privilege(False, "pool").status is doctor.Status.PASS
    dyn = doctor.check_privilege(False, "dynamic")
    assert dyn.status is doctor.Status.FAIL
    assert "MIG config capability" in dyn.detail
    assert "nvidia-cap1" in dyn.fix and "nvidia-modprobe" in dyn.fix


def test_isolation_nodes_found_under_a_device_root(tmp_path):
    adapter = connect(simulate="h200x1:layout=7g.141gb")
    try:
        inv = adapter.inventory()
    finally:
        adapter.close()
    assert doctor.check_isolation_nodes(inv, str(tmp_path)).status is doctor.Status.WARN
    caps = tmp_path / "dev" / "nvidia-caps"
    caps.mkdir(parents=True)
    # 7g on gpu minor 0 is GI 0, CI 0: GI access minor 3, CI access minor 4
    for minor in (3, 4):
        (caps / f"nvidia-cap{minor}").touch()
    assert doctor.check_isolation_nodes(inv, str(tmp_path)).status is doctor.Status.PASS


def test_doctor_reads_the_offered_profiles_from_the_hub_config():
    # The shipped groups offer 3g.71gb and 7g.141gb among others: a host made of 1g
    # slices cannot serve them in pool mode, and doctor says which are missing.
    out = run_cli(
        "doctor", "--simulate", "h200x1:layout=1g.18gb*7", "--config-dir", "jupyterhub_config.d"
    )
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if "offered profiles" in x)
    assert "[FAIL]" in line
    assert "3g.71gb" in line
    # Profiles of GPU models this host does not have are not asked for.
    assert "1g.10gb" not in line


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ("'idle_timout': '30m'", "idle_timout"),
        # The demo once shipped this: every server warned as soon as it started.
        ("'server_idle_timeout': '10m'",
         "'analysts': warn_before 10m is not shorter than server_idle_timeout 10m"),
    ],
    ids=["misspelt-key", "warn-as-long-as-limit"],
)
def test_doctor_reports_a_broken_hub_config(tmp_path, settings, says):
    (tmp_path / "20-groups.py").write_text(
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
        f"{settings}}}}}\n"
    )
    out = run_cli("doctor", "--simulate", "h200x1:layout=1g.18gb*7", "--config-dir", str(tmp_path))
    assert out.returncode == 1
    assert "[FAIL] hub config" in out.stdout
    assert "analysts" in out.stdout
    assert says in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("args", "files", "says"),
    [
        (("doctor", "--sim-state", "/nonexistent/x"), {},
         "sim_state_file: the folder /nonexistent does not exist"),
        (("status", "--simulate", "h9000x1"), {}, "unknown GPU model 'h9000'"),
        (("doctor", "-f", "/nonexistent"), {}, "config path '/nonexistent' does not exist"),
        (("status", "-f", "{dir}"), {"10-a.py": "c.MIGSettings.simulate = (\n"},
         "10-a.py, line 1: '(' was never closed"),
        (("status", "-f", "{dir}"), {"10-a.py": "c.MIGSettings.simulate = 3\n"},
         "'simulate' trait of a MIGSettings instance expected a unicode string"),
        (("report", "--ledger-url", "postgresql+pg9000://u@localhost/hub"), {},
         "driver 'postgresql+pg9000'"),
    ],
    ids=["sim-state-folder", "simulate-model", "config-path", "config-syntax",
         "config-type", "ledger-driver"],
)
def test_a_mistake_in_what_a_command_is_given_is_one_error_line(tmp_path, args, files, says):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = run_cli(*(a.format(dir=tmp_path) for a in args), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and says in out.stderr, out.stderr


def test_status_says_in_words_why_a_simulated_layout_does_not_fit(capsys):
    assert main(["status", "--simulate", "h200x1:layout=1g.18gb*9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: simulator spec 'h200x1:layout=1g.18gb*9': layout "
                          "1g.18gb*9 cannot be made on one H200 141GB: nine 1g.18gb "
                          "instances do not fit, at most seven\n"), err


def test_report_and_status_in_an_empty_folder_create_no_file(tmp_path):
    out = run_cli("report", cwd=tmp_path)
    assert out.returncode == 1, out.stdout
    assert f"there is no ledger at {tmp_path / 'mig_spawner_ledger.sqlite'}" in out.stderr
    assert "no leases" not in out.stdout
    out = run_cli("status", "--sim-state", "sim-gpus.json", cwd=tmp_path)
    assert out.returncode == 1
    assert "sim-gpus.json does not exist" in out.stderr
    assert list(tmp_path.iterdir()) == []


# --- an unprivileged hub, the driver's own table, the read-only device check ---------------


def test_doctor_on_an_unprivileged_hub_passes_for_pool_mode():
    out = run_cli("doctor", "--simulate", "h200x2:unprivileged:layout=1g.18gb*7", "--mode",
                  "pool")
    assert out.returncode == 0, out.stdout
    assert "[FAIL]" not in out.stdout
    assert "[PASS] process listing" in out.stdout  # each slice's own list is readable


def test_doctor_names_what_the_hub_does_without_the_monitor_capability():
    out = run_cli("doctor", "--simulate", "h200x1:perm=config:monitor=root:layout=1g.18gb")
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if x.startswith("[FAIL]"))
    assert "MIG monitor capability" in line and "the spawn form offers none" in line
    assert "every spawn is refused" in line
    assert "/dev/nvidia-caps/nvidia-cap2" in out.stdout


def test_doctor_on_an_unprivileged_hub_fails_dynamic_mode_naming_the_capability():
    out = run_cli("doctor", "--simulate", "h200x2:unprivileged", "--mode", "dynamic")
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if x.startswith("[FAIL]"))
    assert "dynamic-mode privilege" in line and "MIG config capability" in line
    assert "nvidia-modprobe -f /proc/driver/nvidia/capabilities/mig/config" in out.stdout
    assert "chmod g+r /dev/nvidia-caps/nvidia-cap1" in out.stdout


def test_catalog_from_driver_reproduces_the_h200_table():
    out = run_cli("catalog", "--from-driver", "--simulate", "h200x1", "--json")
    assert out.returncode == 0, out.stderr
    gpu = json.loads(out.stdout)["gpus"][0]
    assert gpu["model_key"] == "h200" and gpu["differences_from_catalog"] == []
    ours = run_cli("catalog", "--model", "h200", "--json")
    expected = [{k: v for k, v in row.items() if k not in ("source", "verified")}
                for row in json.loads(ours.stdout)["models"][0]["profiles"]]
    assert gpu["profiles"] == expected
    assert [r["memory_mib"] for r in gpu["profiles"]] == [
        16384, 16384, 33024, 33024, 71168, 71168, 143104]
    assert [(r["decoders"], r["jpeg"], r["ofa"]) for r in gpu["profiles"]] == [
        (1, 1, 0), (1, 1, 1), (1, 1, 0), (2, 2, 0), (3, 3, 0), (4, 4, 0), (7, 7, 1)]
    text = run_cli("catalog", "--model", "h200").stdout.splitlines()
    assert text[1].split()[8:12] == ["dec", "enc", "jpeg", "ofa"]


def test_catalog_from_driver_is_read_only_and_says_when_mig_is_off(tmp_path):
    state = tmp_path / "sim.json"
    out = run_cli("catalog", "--from-driver", "--simulate", "h100x1:mig=off",
                  "--sim-state", str(state))
    assert out.returncode == 0, out.stderr
    assert "lists no MIG profiles" in out.stdout
    before = state.read_bytes()
    run_cli("catalog", "--from-driver", "--sim-state", str(state))
    assert state.read_bytes() == before


def test_doctor_warns_with_the_rows_where_the_driver_differs():
    out = run_cli("doctor", "--simulate", "b200x1:driver=580.65.06:layout=1g.23gb*7")
    assert out.returncode == 0, out.stdout
    line = next(x for x in out.stdout.splitlines() if "profile table" in x)
    assert line.startswith("[WARN]")
    assert "1g.23gb: memory_mib catalog 22.0 GiB driver 20.5 GiB" in line
    assert "1g.23gb+me: memory_mib catalog 22.0 GiB driver 20.5 GiB" in line
    assert "2g.45gb" not in line


def test_doctor_json_and_the_garbling_driver_warning():
    out = run_cli("doctor", "--json", "--simulate", "h100x1:driver=535.54.03:layout=7g.80gb")
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["process listing"]["status"] == "warn"
    assert "535.54.03" in checks["process listing"]["detail"]


def test_status_shows_gib_and_unknown_processes(tmp_path):
    state = tmp_path / "sim.json"
    host = SimulatedHost.from_spec("h200x1:unprivileged:layout=2g.35gb", state)
    host.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", "UNKNOWN")
    out = run_cli("status", "--sim-state", str(state))
    assert out.returncode == 0, out.stderr
    assert "0.0 GiB / 32.2 GiB" in out.stdout and "unknown" in out.stdout
    assert "2g.35gb?" in out.stdout


def test_device_check_script_reads_everything_and_exits_0(tmp_path):
    import os
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "device-check.sh"
    state = tmp_path / "sim.json"
    SimulatedHost.from_spec("h200x1:layout=1g.18gb*2", state)
    before = state.read_bytes()
    env = dict(os.environ, MIG_SPAWNER_SIMULATE="h200x1:layout=1g.18gb*2",
               MIG_SPAWNER_SIM_STATE=str(state),
               MIG_SPAWNER=f"{sys.executable} -m mig_spawner.cli.main", OUT_DIR=str(tmp_path))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("doctor.json", "status.json", "catalog-from-driver.json"):
        json.loads((tmp_path / name).read_text())
    assert "matches the catalog" in out.stdout
    assert state.read_bytes() == before  # read-only: no MIG mode or instance changed
    # The media-engine columns a real H200 confirms: ID, MiB, SM, CE, DEC, ENC, JPEG, OFA.
    lines = out.stdout.splitlines()
    assert lines[lines.index(next(x for x in lines if "the driver's profiles" in x)) + 1
                 ].split() == ["profile", "ID", "MiB", "SM", "CE", "DEC", "ENC", "JPEG", "OFA",
                               "inst"]
    rows = {x.split()[0]: x.split()[1:] for x in lines if x.startswith("  ")}
    assert rows["1g.18gb"] == ["19", "16384", "16", "1", "1", "0", "1", "0", "7"]
    assert rows["7g.141gb"] == ["0", "143104", "132", "8", "7", "0", "7", "1", "1"]


def test_doctor_lists_policy_groups_the_hub_does_not_have(tmp_path):
    (tmp_path / "20-groups.py").write_text(
        "c.JupyterHub.load_groups = {'analysts': {'users': []}}\n"
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb']},"
        " 'reserch': {'allowed': ['1g.18gb']}}\n"
        f"c.JupyterHub.db_url = 'sqlite:///{tmp_path}/jupyterhub.sqlite'\n"
    )
    out = run_cli("doctor", "--simulate", "h200x1:layout=1g.18gb*7", "--config-dir", str(tmp_path))
    line = next(x for x in out.stdout.splitlines() if "hub policy" in x)
    assert "[WARN]" in line and "'reserch'" in line and "analysts" not in line
    assert "[PASS] hub settings" in out.stdout


def test_doctor_fails_a_setting_the_hub_would_refuse(tmp_path):
    (tmp_path / "10-spawner.py").write_text("c.LocalMIGSpawner.mig_mode = 'dynamc'\n")
    out = run_cli("doctor", "--simulate", "h200x1:layout=1g.18gb*7", "--config-dir", str(tmp_path))
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if "hub settings" in x)
    assert "[FAIL]" in line and "c.LocalMIGSpawner.mig_mode = 'dynamc'" in line


def test_report_reads_the_hubs_ledger_from_its_config(tmp_path):
    ledger = tmp_path / "elsewhere.sqlite"
    Ledger.open(f"sqlite:///{ledger}").close()  # the hub created it
    (tmp_path / "10-spawner.py").write_text(f"c.MIGSettings.ledger_url = 'sqlite:///{ledger}'\n")
    out = run_cli("report", "-f", str(tmp_path), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr  # that ledger, not one in the working directory
    assert not (tmp_path / "mig_spawner_ledger.sqlite").exists()


def test_doctor_on_a_gpu_without_mig_skips_what_needs_mig_instead_of_passing_it():
    out = run_cli("doctor", "--simulate", "t4x1", "--config-dir", "jupyterhub_config.d")
    assert out.returncode == 1
    assert "[FAIL] MIG support" in out.stdout
    assert "[PASS] MIG mode" not in out.stdout
    skip = "[SKIP] MIG mode                not checked: no GPU here supports MIG (see MIG support)"
    assert skip in out.stdout
    assert "[SKIP] offered profiles" in out.stdout
    assert out.stdout.rstrip().endswith("6 skipped")


def test_doctor_with_mig_pending_skips_the_profile_checks_and_says_why():
    # The shipped groups are set: with MIG pending, doctor must not call them unset or
    # missing, only say that they could not be checked yet.
    out = run_cli("doctor", "--json", "--simulate", "h200x1:mig=pending",
                  "--config-dir", "jupyterhub_config.d")
    assert out.returncode == 1
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["MIG mode"]["status"] == "fail"
    for name in ("profile table", "process listing", "offered profiles"):
        assert checks[name]["status"] == "skip", checks[name]
        assert "MIG is not enabled on any GPU (see MIG mode)" in checks[name]["detail"]
    assert "no profiles are offered" not in out.stdout
    # Simulated GPUs leave isolation off by default: no device nodes to look for.
    assert checks["isolation device nodes"]["status"] == "skip"
    assert json.loads(out.stdout)["skipped"] == 4


def test_doctor_skips_the_offered_profiles_when_the_hub_policy_is_wrong():
    out = run_cli("doctor", "--simulate", "a100-40gbx1:layout=1g.5gb*7",
                  "--config-dir", "jupyterhub_config.d")
    assert "[FAIL] hub config" in out.stdout
    assert "[SKIP] offered profiles        not checked: the hub's policy is wrong" in out.stdout
    assert "no profiles are offered to any group" not in out.stdout


@pytest.mark.parametrize("where", ["before the command", "after the command",
                                   "after the action"])
def test_the_global_options_are_taken_before_or_after_the_command(tmp_path, where):
    """``-f``, ``--ledger-url`` and ``--simulate`` mean the same wherever they stand:
    ``mig-spawner budget grant -f CFG research 20h`` as an admin types it."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    Ledger.open(url).close()  # the hub created it
    (tmp_path / "20-groups.py").write_text(
        "c.MIGPolicyConfig.group_policies = {'research': {'allowed': ['1g.18gb'], "
        "'budget': '40h'}}\n")
    options = ["-f", str(tmp_path), "--ledger-url", url, "--simulate", "h200x1"]
    args = {"before the command": [*options, "budget", "grant", "research", "20h"],
            "after the command": ["budget", *options, "grant", "research", "20h"],
            "after the action": ["budget", "grant", *options, "research", "20h"]}[where]
    out = run_cli(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "granted 20 compute-slice-hours to the budget of group 'research'" in out.stdout
    with Ledger.open(url) as ledger:  # that ledger, the config's group
        extras = ledger.usage.budget(datetime.now(UTC) - timedelta(hours=1))[1]
    assert [x.group for x in extras] == ["research"]
    # The same for a command one level deep, given before or after it.
    for argv in (["--simulate", "h200x1", "status"], ["status", "--simulate", "h200x1"]):
        assert "NVIDIA H200" in run_cli(*argv, "--ledger-url", url).stdout


DEMO_GPU1 = ("h200x1:layout=1g.18gb*4,2g.35gb,1g.35gb"
             "+h200x1:layout=3g.71gb,2g.35gb,1g.18gb*2")


def test_status_right_after_an_apply_shows_the_new_layouts_free_slices(tmp_path):
    """The demo's GPU 1 re-cut to 2 x 2g.35gb + 3g.71gb while ben holds the 1g.18gb at
    slice 0: status holds only what is being re-cut (0 and 1), and shows the kept
    2g.35gb and 3g.71gb free; once ben is gone the next pass makes the new 2g.35gb,
    and status shows it free, with no hold left."""
    from mig_spawner.core.policy import build_policy
    from mig_spawner.spawner.decide import make_decide

    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    sim = ["--simulate", DEMO_GPU1, "--sim-state", str(tmp_path / "sim.json"),
           "--ledger-url", url]
    SimulatedHost.from_spec(DEMO_GPU1, tmp_path / "sim.json")
    gpus = connect(simulate=DEMO_GPU1, state_file=str(tmp_path / "sim.json"))
    mine = build_policy(None, None, {"g": {"allowed": ["1g.18gb"], "max_slices_per_user": 9}}
                        ).for_user(["g"])
    with Ledger.open(url) as ledger:
        leases = [ledger.leases.claim(LeaseRequest(user), make_decide(
            mine, mine.offer("1g.18gb"), gpus.inventory(), "pool", "pack"))
            for user in ("a1", "a2", "a3", "a4", "ben")]
    (ben,) = [x for x in leases if x.gpu_index == 1]
    assert run_cli("layout", "apply", *sim, "1=2g.35gb*2,3g.71gb").returncode == 0

    def gpu1() -> tuple[list, list]:
        data = json.loads(run_cli("status", *sim, "--json").stdout)
        held = {h["mig_uuid"] for h in data["holders"]}
        free = sorted((d["profile"], d["start"]) for d in data["gpus"][1]["mig_devices"]
                      if d["uuid"] not in held)
        return free, data["layout_changes"]

    free, changes = gpu1()
    assert [c["held_slices"] for c in changes] == [[0, 1]]
    assert ("2g.35gb", 2) in free and ("3g.71gb", 4) in free
    with Ledger.open(url) as ledger:
        ledger.leases.release(ben.id, "stopped")
    assert run_cli("layout", "apply", *sim, "1=2g.35gb*2,3g.71gb").returncode == 0
    assert gpu1() == ([("2g.35gb", 0), ("2g.35gb", 2), ("3g.71gb", 4)], [])
    assert "no new server is given" not in run_cli("status", *sim).stdout


def test_doctor_says_how_long_servers_may_take_to_start(tmp_path):
    """JupyterHub's 30 s http_timeout ended starts on a loaded host: doctor says what
    the spawner makes of the hub's two timeouts."""
    (tmp_path / "00-hub.py").write_text("c.Spawner.http_timeout = 30\n"
                                        "c.Spawner.start_timeout = 60\n")
    out = run_cli("doctor", "--simulate", "h200x1:layout=1g.18gb*7", "-f", str(tmp_path),
                  "--json")
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    found = checks["start timeouts"]
    assert found["status"] == "pass"
    assert found["detail"].startswith("servers may take 300 s to answer (http_timeout 30 s")
    assert "started once more on its slice" in found["detail"]
    assert "JupyterHub's start_timeout becomes 721 s" in found["detail"]
