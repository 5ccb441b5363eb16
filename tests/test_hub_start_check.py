"""A wrong GPU policy or setting stops the real hub at start, naming what is wrong;
what may be on purpose (a group not created yet, ``allowed = []``) is a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.hub_harness import HubProcess

REPO = Path(__file__).resolve().parents[1]
JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"

SPAWNER = """
c = get_config()  # noqa: F821
c.JupyterHub.spawner_class = "mig-simple"
c.MIGSettings.simulate = "h200x1:layout=1g.18gb*7"
"""


def service(option: str) -> str:
    """A snippet starting the slice service on the hub's own config, plus ``option``."""
    command = [sys.executable, "-m", "mig_spawner.service"]
    return ("import os\n"
            f"c.JupyterHub.services = [{{'name': 'mig-slices', 'command': {command!r} + "
            f"['--config-dir=' + os.path.dirname(__file__), {option!r}]}}]\n")


GROUPS = "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb']}}"


def write_hub(tmp_path: Path, groups: str, extra: str = "") -> list[str]:
    """The shipped jupyterhub_config.py over a config.d holding ``groups`` and ``extra``;
    returns the command that starts the hub."""
    shutil.copy(REPO / "jupyterhub_config.py", tmp_path / "jupyterhub_config.py")
    snippets = tmp_path / "jupyterhub_config.d"
    snippets.mkdir()
    (snippets / "10-spawner.py").write_text(SPAWNER)
    (snippets / "20-groups.py").write_text("c = get_config()  # noqa: F821\n" + groups)
    (snippets / "90-extra.py").write_text(
        "c = get_config()  # noqa: F821\n" + textwrap.dedent(extra))
    return [str(JUPYTERHUB), "-f", str(tmp_path / "jupyterhub_config.py"), "--port=0"]


def start_hub(tmp_path: Path, groups: str, extra: str = "") -> subprocess.CompletedProcess[str]:
    """Start the hub (see :func:`write_hub`) and wait for it to exit."""
    return subprocess.run(write_hub(tmp_path, groups, extra), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (
            "c.MIGPolicyConfig.group_policies = "
            "{'analysts': {'allowed': ['1g.18gb'], 'server_idle_timout': '30m'}}",
            ["analysts", "server_idle_timout", "server_idle_timeout"],
        ),
        (
            # 2g.20gb is an H100/A100 profile: this host's H200 cannot serve it.
            "c.MIGPolicyConfig.group_policies = {'ml-team': {'allowed': ['2g.20gb']}}",
            ["ml-team", "2g.20gb", "2g.35gb"],
        ),
        (
            "c.MIGPolicyConfig.group_policies = "
            "{'analysts': {'allowed': ['1g.18gb'], 'kernel_idle_timeout': '30x'}}",
            ["analysts", "kernel_idle_timeout", "30x"],
        ),
        (
            "c.MIGPolicyConfig.group_policies = "
            "{'analysts': {'allowed': ['1g.18gb'], 'max_slices_per_user': -1}}",
            ["analysts", "max_slices_per_user", "-1"],
        ),
    ],
    ids=["unknown-key", "profile-not-on-these-gpus", "bad-duration", "negative-limit"],
)
def test_hub_refuses_to_start_with_a_wrong_policy(tmp_path, groups, expected):
    result = start_hub(tmp_path, groups)
    assert result.returncode != 0
    err = result.stderr
    assert "the GPU policy in jupyterhub_config.d is wrong" in err
    for word in expected:
        assert word in err, err[-2000:]
    # It stopped at config time: no database was made, no port was ever bound.
    assert not (tmp_path / "jupyterhub.sqlite").exists()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('c.SimpleLocalMIGSpawner.mig_mode = "dynamc"',
         ["c.SimpleLocalMIGSpawner.mig_mode = 'dynamc'", "'pool', 'dynamic'"]),
        ('c.MIGSpawnerMixin.strategy = "packed"',
         ["c.MIGSpawnerMixin.strategy = 'packed'", "'pack', 'spread'"]),
        ("c.MIGPolicyConfig.group_polices = {}",
         ["c.MIGPolicyConfig.group_polices", "did you mean 'group_policies'?"]),
        ("c.SimpleLocalMIGSpawner.mig_mod = 'pool'",
         ["c.SimpleLocalMIGSpawner.mig_mod", "did you mean 'mig_mode'?"]),
        ("c.MIGSettings.ledger_ur = 'sqlite:////tmp/x.sqlite'",
         ["c.MIGSettings.ledger_ur", "did you mean 'ledger_url'?"]),
        # Where v1 and its docs put the ledger: refused, naming the one place now.
        ("c.LocalMIGSpawner.ledger_url = 'sqlite:////tmp/x.sqlite'",
         ["c.LocalMIGSpawner.ledger_url is not read any more", "c.MIGSettings.ledger_url"]),
        ("c.MIGSpawnerMixin.ledger_url = ''",
         ["c.MIGSpawnerMixin.ledger_url is not read any more", "c.MIGSettings.ledger_url"]),
        ("c.SliceServiceApp.ledger_url = 'sqlite:////tmp/x.sqlite'",
         ["c.SliceServiceApp.ledger_url is not read any more", "c.MIGSettings.ledger_url"]),
        # A managed slice service told to use another ledger than the hub's.
        (service("--ledger-url=sqlite:////tmp/other-ledger.sqlite"),
         ["'mig-slices' would use the ledger sqlite:////tmp/other-ledger.sqlite",
          "but the hub uses sqlite:///", "c.MIGSettings.ledger_url"]),
    ],
    ids=["bad-mode", "bad-strategy", "misspelt-policy-trait", "misspelt-spawner-trait",
         "misspelt-settings-trait", "ledger-on-local-spawner", "ledger-on-mixin",
         "ledger-on-service", "service-on-another-ledger"],
)
def test_hub_refuses_to_start_with_a_wrong_setting(tmp_path, extra, expected):
    began = time.monotonic()
    result = start_hub(tmp_path, GROUPS, extra)
    assert result.returncode != 0
    err = result.stderr
    assert "the configuration in jupyterhub_config.d is wrong" in err, err[-2000:]
    for words in expected:
        assert words in err, err[-2000:]
    assert not (tmp_path / "jupyterhub.sqlite").exists()  # stopped before the hub began
    assert time.monotonic() - began < 60


def test_the_service_on_the_hubs_own_config_starts(tmp_path):
    """The check's counterpart: the service reading the hub's config passes it."""
    result = start_hub(tmp_path, GROUPS + "\nc.MIGPolicyConfig.group_polices = {}",
                       service("--dry-run"))
    assert "'mig-slices' would use" not in result.stderr  # only the misspelling stops it
    assert "group_polices" in result.stderr


@pytest.mark.parametrize(
    ("groups", "warning"),
    [
        ("c.MIGPolicyConfig.group_policies = {'analyst': {'allowed': ['1g.18gb']}}",
         "policy for the group 'analyst', which this hub does not have (did you mean "
         "'analysts'?)"),
        ("c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': []}}",
         "the group 'analysts' has allowed = []"),
        # The simulated layout is seven 1g.18gb: a pool without any 3g.71gb.
        ("c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb', '3g.71gb']}}",
         "pool mode offers 3g.71gb to analysts but no such MIG device exists on this host"),
        ("c.MIGPolicyConfig.offers = {'1g.18gb': {'display_name': 'Small (18 GB)'}}\n"
         + GROUPS,
         "the offer '1g.18gb' says '18 GB' in its display_name, but the slice has 16.0 GiB "
         "on H200 141GB: mig-spawner shows memory as GiB with one decimal; write '16.0 GiB'"),
    ],
    ids=["group-not-on-the-hub", "allowed-nothing", "offer-without-device", "memory-wording"],
)
def test_policy_that_may_be_on_purpose_is_a_warning_and_the_hub_starts(tmp_path, groups,
                                                                       warning):
    snippets = tmp_path / "jupyterhub_config.d"
    snippets.mkdir()
    (snippets / "10-spawner.py").write_text(SPAWNER)
    (snippets / "20-groups.py").write_text("c = get_config()  # noqa: F821\n" + groups)
    hub = HubProcess.start(tmp_path / "hub", sorted(snippets.glob("*.py")), textwrap.dedent("""
        c.JupyterHub.load_groups = {"analysts": {"users": []}}
        from mig_spawner.spawner.startup import check_hub_config
        check_hub_config(c)
    """))
    try:
        log = hub.log_tail(100_000).replace("\n", " ")
        assert "mig-spawner: warning: " in log and warning in log, log[-2000:]
        assert hub.session.get(hub.api("/"), timeout=10).ok  # and it serves
    finally:
        hub.close()
