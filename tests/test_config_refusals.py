"""Config that would start and break later is refused at start-up, one line naming the
setting, by the hub, the slice service and ``mig-spawner doctor`` alike.

The corpus below is config text and the exact line each wiring refuses it with; it is
checked in-process (the hub's ``check_hub_config``, the service's start, doctor's
``main``). One real process per wiring shows that the line reaches the admin as it
is, with a non-zero exit and no traceback: a hub on a ledger that does not answer, a
slice service and a doctor run on a right-sizing share out of range.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mig_spawner.config import load_config_files
from mig_spawner.service.app import SliceServiceApp
from mig_spawner.spawner.startup import check_hub_config
from tests.support.cli import run_cli
from tests.support.hub_harness import REPO
from tests.support.start_check import GROUPS, JUPYTERHUB, write_snippets

SHARE = "must be a share above 0 and at most 1 (0.75 is 75 %)"
INF = "inf is not a duration: write 'never' or None for no limit"
KEEP = "Keep could never extend a session"
LEDGER = ("c.MIGSettings.ledger_url: the ledger cannot be used from here ({}; the details "
          "are on stderr)")
NO_ANSWER = "the database does not answer, refuses this connection, or is no database"


def closed_port() -> int:
    """A local port nothing listens on: a connection there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A spawner as the hub would make it on a host that offers ``support``.
SPAWNER_ON = """
from mig_spawner.device_cgroup import HostSupport
from mig_spawner.spawner.local import SimpleLocalMIGSpawner

class HostSpawner(SimpleLocalMIGSpawner):
    host_support = staticmethod(lambda caps_dir: HostSupport({support}))

c.JupyterHub.spawner_class = HostSpawner
"""

# Whose start refuses each case: the service reads the shared snippets but not the
# spawners' settings, which the hub and doctor check.
ALL, HUB_AND_DOCTOR = ("hub", "doctor", "service"), ("hub", "doctor")

# (config text, the one line, who refuses it)
CORPUS = {
    # -- right-sizing: read by every spawn form, so a wrong value broke every form
    "rightsize-share-as-percent": (
        "c.RightsizeConfig.fits_below = 75",
        f"c.RightsizeConfig.fits_below = 75: {SHARE}", ALL),
    "rightsize-share-nan": (
        "c.RightsizeConfig.full_above = float('nan')",
        f"c.RightsizeConfig.full_above = nan: {SHARE}", ALL),
    "rightsize-misspelt": (
        "c.RightsizeConfig.min_session = 2",
        "c.RightsizeConfig.min_session is not a setting of RightsizeConfig; did you mean "
        "'min_sessions'?", ALL),
    "rightsize-misspelt-class": (
        "c.RightsizeConfg.recent = 5",
        "c.RightsizeConfg is not a mig-spawner class, so nothing reads its settings; did you "
        "mean c.RightsizeConfig?", ALL),
    "rightsize-zero-samples": (
        "c.RightsizeConfig.min_samples = 0",
        "c.RightsizeConfig.min_samples = 0: must be 1 or more", ALL),
    "rightsize-recent-below-min-sessions": (
        "c.RightsizeConfig.recent = 2",
        "c.RightsizeConfig.recent = 2 is less than c.RightsizeConfig.min_sessions = 3: no "
        "size could ever have enough judged sessions for a verdict; raise recent or lower "
        "min_sessions", ALL),
    # -- the group policy
    "budget-inf": (
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
        "'budget': float('inf')}}",
        f"group 'analysts': budget: {INF} (budgets are compute-slice-hours, e.g. '40h')", ALL),
    "idle-timeout-inf": (
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
        "'server_idle_timeout': float('inf')}}",
        f"group 'analysts': server_idle_timeout: {INF}", ALL),
    "max-extensions-without-extend-by": (
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
        "'max_extensions': 2}}",
        f"group 'analysts': max_extensions 2 without extend_by: {KEEP}; set extend_by (what "
        "one Keep adds, e.g. '1h') or remove max_extensions", ALL),
    "extend-by-without-max-extensions": (
        "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
        "'extend_by': '1h'}}",
        f"group 'analysts': extend_by 1h with max_extensions 0: {KEEP}; set max_extensions "
        "(how many times, e.g. 2) or remove extend_by", ALL),
    # -- the ledger: the first spawn met it
    "ledger-does-not-answer": (
        "c.MIGSettings.ledger_url = 'postgresql+psycopg2://mig:s3cret@127.0.0.1:{port}/mig'",
        LEDGER.format(NO_ANSWER), ALL),
    "ledger-folder-missing": (
        "c.MIGSettings.ledger_url = 'sqlite:////nonexistent/mig/ledger.sqlite'",
        LEDGER.format("no such folder or database driver, or no permission"), ALL),
    "ledger-url-not-a-url": (
        "c.MIGSettings.ledger_url = 'postgresql+psycopg2://mig:s3cret@db:port/mig'",
        "c.MIGSettings.ledger_url: not a SQLAlchemy URL; use e.g. "
        "'sqlite:////srv/jupyterhub/mig_ledger.sqlite' or 'postgresql://user@db/mig'", ALL),
    # -- isolation: every spawn failed on these
    "isolation-device-dir-missing": (
        "c.LocalMIGSpawner.isolation = True\nc.LocalMIGSpawner.device_dir = '/nonexistent/dev'",
        "c.LocalMIGSpawner.device_dir = '/nonexistent/dev': no such folder; isolation "
        "(c.LocalMIGSpawner.isolation = True) reads the NVIDIA device nodes there",
        HUB_AND_DOCTOR),
    "isolation-on-a-host-that-cannot": (
        SPAWNER_ON.format(support="None, 'no device cgroup here'")
        + "c.HostSpawner.isolation = True",
        "c.HostSpawner.isolation = True: this host cannot confine servers (no device cgroup "
        "here); set it to None (confined where the host can) or False (mig-spawner doctor, "
        "docs/admin-install.md)", HUB_AND_DOCTOR),
    "isolation-without-nvidia-modprobe": (
        # The real driver (not simulated), on a host with a device cgroup.
        SPAWNER_ON.format(support="'systemd'")
        + "c.MIGSettings.simulate = None\n"
        "c.LocalMIGSpawner.nvidia_modprobe = 'nvidia-modprobe-not-here'",
        "c.LocalMIGSpawner.nvidia_modprobe = 'nvidia-modprobe-not-here': not found in the "
        "hub's PATH; isolation needs it to create the slices' capability nodes (give its "
        "full path)", HUB_AND_DOCTOR),
    "spawner-of-a-wrong-jupyterhub-setting": (
        "c.Spawner.cmd = 5",
        "c.JupyterHub.spawner_class: SimpleLocalMIGSpawner cannot be made from this config: "
        "The 'cmd' trait of a SimpleLocalMIGSpawner instance expected a list or None, not "
        "the int 5.", HUB_AND_DOCTOR),
    # -- numbers of our classes that traitlets takes: NaN, infinity, negative
    "service-timeout-nan": (
        "c.SliceServiceApp.request_timeout = float('nan')",
        "c.SliceServiceApp.request_timeout = nan: must be a finite number, got nan", ALL),
    "service-interval-zero": (
        "c.SliceServiceApp.usage_sample_interval = 0",
        "c.SliceServiceApp.usage_sample_interval = 0: must be more than 0, got 0.0", ALL),
    "service-retries-negative": (
        "c.SliceServiceApp.retries = -1",
        "c.SliceServiceApp.retries = -1: must be 0 or more", ALL),
    "service-grace-inf": (
        "c.SliceServiceApp.orphan_grace = float('inf')",
        f"c.SliceServiceApp.orphan_grace = inf: {INF}", ALL),
    "nice-negative": (
        "c.LocalMIGSpawner.nice = -3",
        "c.LocalMIGSpawner.nice = -3: must be 0 or more", HUB_AND_DOCTOR),
    "kube-ttl-inf": (
        "c.KubeMIGSpawner.mig_availability_ttl = float('inf')",
        "c.KubeMIGSpawner.mig_availability_ttl = inf: must be a finite number, got inf",
        HUB_AND_DOCTOR),
    # -- what the cluster would refuse at every read or pod: a selector, a label
    "kube-label-selector": (
        "c.KubeMIGSpawner.mig_node_label_selector = 'nvidia.com/gpu.present=true='",
        "c.KubeMIGSpawner.mig_node_label_selector = 'nvidia.com/gpu.present=true=': "
        "'nvidia.com/gpu.present=true=' is not a label selector requirement; write e.g. "
        "'nvidia.com/gpu.present=true', 'pool!=cpu' or 'zone in (a,b)', comma separated",
        HUB_AND_DOCTOR),
    "kube-node-label": (
        "c.KubeMIGSpawner.mig_node_selector = {'gpu pool': 'yes'}",
        "c.KubeMIGSpawner.mig_node_selector = {'gpu pool': 'yes'}: 'gpu pool' is not a "
        "Kubernetes label key (e.g. 'pool' or 'example.com/pool')", HUB_AND_DOCTOR),
}
CASES = [pytest.param(text, line, id=name) for name, (text, line, _) in CORPUS.items()]


def snippets(tmp_path: Path, text: str) -> Path:
    """The hub's jupyterhub_config.d with ``text`` after the spawner and groups."""
    return write_snippets(tmp_path, GROUPS, text.replace("{port}", str(closed_port())))


def problem_lines(message: str) -> list[str]:
    """The problems a refusal lists, one a line (``  - ...``)."""
    return [line[4:] for line in message.splitlines() if line.startswith("  - ")]


@pytest.fixture
def hub_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hub's working directory: its database and default ledger lie there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("text", "line"), CASES)
def test_the_hub_refuses_it_in_one_line(hub_dir, text, line):
    with pytest.raises(SystemExit) as stopped:
        check_hub_config(load_config_files(snippets(hub_dir, text)))
    message = str(stopped.value.code)
    assert problem_lines(message) == [line], message
    assert "s3cret" not in message


@pytest.mark.parametrize(("text", "line"), CASES)
def test_doctor_fails_it_in_one_line(hub_dir, text, line):
    out = run_cli("doctor", "--config-dir", str(snippets(hub_dir, text)))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    failed = [row for row in out.stdout.splitlines() if row.startswith("[FAIL] hub ")]
    assert failed, out.stdout
    assert line in out.stdout, out.stdout
    assert "s3cret" not in out.stdout


SERVICE_CASES = [case for case in CASES if "service" in CORPUS[case.id][2]]


@pytest.mark.parametrize(("text", "line"), SERVICE_CASES)
def test_the_slice_service_refuses_it_in_one_line(hub_dir, text, line):
    app = SliceServiceApp(check_gpus=False)
    with pytest.raises(SystemExit) as stopped:
        app.initialize([f"--config-dir={snippets(hub_dir, text)}"])
        app.start()  # the policy and the ledger are checked as it starts
    assert stopped.value.code == f"mig-spawner-service: {line}"


# --- the wiring: each process says the line, exits non-zero, and no traceback --------


def run_to_exit(command: list[str], cwd: Path, timeout: float = 60
                ) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end; past ``timeout`` (a hub that started), its whole
    process group (the hub's proxy too) is killed and the test fails."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command[0]} did not stop at start-up:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_a_hub_on_a_ledger_that_does_not_answer_stops_before_it_starts(tmp_path):
    port = closed_port()
    write_snippets(tmp_path, GROUPS, "c.MIGSettings.ledger_url = "
                   f"'postgresql+psycopg2://mig:s3cret@127.0.0.1:{port}/mig'")
    (tmp_path / "jupyterhub_config.py").write_text(
        (REPO / "jupyterhub_config.py").read_text())
    hub = run_to_exit([str(JUPYTERHUB), "-f", str(tmp_path / "jupyterhub_config.py"),
                       "--port=0"], tmp_path)
    assert hub.returncode != 0
    assert "Traceback" not in hub.stderr, hub.stderr
    lines = hub.stderr.splitlines()
    assert f"  - {LEDGER.format(NO_ANSWER)}" in lines, hub.stderr
    # The admin's detail names the database (its password hidden); the line does not.
    detail = next(x for x in lines if x.startswith("mig-spawner: the ledger database"))
    assert f"127.0.0.1:{port}" in detail and "Connection refused" in detail, detail
    assert "s3cret" not in hub.stderr
    assert not (tmp_path / "jupyterhub.sqlite").exists()  # stopped at config time


def test_the_slice_service_process_stops_with_the_line(tmp_path):
    config = write_snippets(tmp_path, GROUPS, CORPUS["rightsize-share-as-percent"][0])
    service = run_to_exit([sys.executable, "-m", "mig_spawner.service",
                           f"--config-dir={config}"], tmp_path)
    assert service.returncode == 1
    assert service.stderr == (
        f"mig-spawner-service: {CORPUS['rightsize-share-as-percent'][1]}\n"), service.stderr


def test_the_doctor_process_fails_with_the_line(tmp_path):
    config = write_snippets(tmp_path, GROUPS, CORPUS["rightsize-share-as-percent"][0])
    doctor = run_to_exit([sys.executable, "-m", "mig_spawner.cli.main", "doctor",
                          "--config-dir", str(config)], tmp_path)
    assert doctor.returncode == 1
    assert "Traceback" not in doctor.stderr, doctor.stderr
    row = next(x for x in doctor.stdout.splitlines() if x.startswith("[FAIL] hub settings"))
    assert row.endswith(f"  {CORPUS['rightsize-share-as-percent'][1]}"), doctor.stdout
