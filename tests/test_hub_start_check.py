"""A wrong GPU policy or setting stops the hub at start, naming what is wrong; what may be
on purpose (a group not created yet, ``allowed = []``) is a warning.

``check_hub_config`` decides, so each mistake is checked in-process on the config the
hub would load from its snippets. A real hub is started only for the wiring: that
``jupyterhub_config.py`` runs the check, that a refusal stops the hub with its message
before it makes its database, and that a config with warnings starts and keeps what
was added after the check.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mig_spawner.config import load_config_files
from mig_spawner.service.app import SliceServiceApp
from mig_spawner.spawner.startup import check_hub_config
from tests.support.hub_harness import HubProcess
from tests.support.start_check import (
    GROUPS,
    JUPYTERHUB,
    POLICY_WRONG,
    SETTING_WRONG,
    refusal,
    write_snippets,
)

REPO = Path(__file__).resolve().parents[1]

def service(option: str) -> str:
    """A snippet starting the slice service on the hub's own config, plus ``option``."""
    command = [sys.executable, "-m", "mig_spawner.service"]
    return ("import os\n"
            f"c.JupyterHub.services = [{{'name': 'mig-slices', 'command': {command!r} + "
            f"['--config-dir=' + os.path.dirname(__file__), {option!r}]}}]\n")


@pytest.fixture
def hub_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The hub's working directory: its database and ledger would lie there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- what the check refuses, in-process ----------------------------------------------


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
        (
            # Each valid alone; together a member could never hold the three allowed.
            "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
            "'quota_slices': 1, 'max_slices_per_user': 3}}",
            ["group 'analysts': max_slices_per_user 3 can never be reached, the whole "
             "group's quota_slices is 1; lower max_slices_per_user to 1"],
        ),
    ],
    ids=["unknown-key", "profile-not-on-these-gpus", "bad-duration", "negative-limit",
         "quota-below-user-limit"],
)
def test_a_wrong_policy_is_refused(hub_dir, groups, expected):
    message = refusal(hub_dir, groups)
    assert POLICY_WRONG in message
    for word in expected:
        assert word in message, message


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
        # A misspelt class: nothing would read the policy or the mode set there.
        ("c.MIGPolicyConfg.group_policies = {'analysts': {'allowed': ['7g.141gb']}}",
         ["c.MIGPolicyConfg is not a mig-spawner class", "did you mean c.MIGPolicyConfig?"]),
        ("c.LocalMIGSpawnr.mig_mode = 'dynamic'",
         ["c.LocalMIGSpawnr is not a mig-spawner class", "did you mean c.LocalMIGSpawner?"]),
        # The slice service's settings, in the snippets it shares with the hub ...
        ("c.SliceServiceApp.cul_every = '30s'",
         ["c.SliceServiceApp.cul_every is not a setting of SliceServiceApp",
          "did you mean 'cull_every'?"]),
        ("c.SliceServiceApp.concurrency = 'ten'",
         ["c.SliceServiceApp.concurrency = 'ten'", "expected an int"]),
        # ... and on its command line, which the check runs the service's loading on.
        (service("--SliceServiceApp.orphan_grase=10m"),
         ["the slice service 'mig-slices' would not start",
          "c.SliceServiceApp.orphan_grase is not a setting of SliceServiceApp",
          "did you mean 'orphan_grace'?"]),
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
         "misspelt-settings-trait", "misspelt-policy-class", "misspelt-spawner-class",
         "unknown-service-setting", "wrong-service-value", "unknown-service-option",
         "ledger-on-local-spawner", "ledger-on-mixin", "ledger-on-service",
         "service-on-another-ledger"],
)
def test_a_wrong_setting_is_refused(hub_dir, extra, expected):
    message = refusal(hub_dir, GROUPS, extra)
    assert SETTING_WRONG in message, message
    for words in expected:
        assert words in message, message


def test_sections_of_other_packages_are_not_taken_for_misspellings(hub_dir):
    """KubeSpawner is three letters from KubeMIGSpawner, and a real class."""
    snippets = write_snippets(hub_dir, GROUPS, """
        c.KubeSpawner.start_timeout = 600
        c.LocalProcessSpawner.term_timeout = 5
        c.ConfigurableHTTPProxy.should_start = True
    """)
    check_hub_config(load_config_files(snippets))  # no SystemExit


def test_the_service_on_the_hubs_own_config_passes(hub_dir):
    """The ledger check's counterpart: the service reading the hub's config passes it."""
    message = refusal(hub_dir, GROUPS + "\nc.MIGPolicyConfig.group_polices = {}",
                      service("--dry-run"))
    assert "'mig-slices' would" not in message  # only the misspelling stops it
    assert "group_polices" in message


def test_the_slice_service_itself_refuses_a_setting_it_does_not_have(hub_dir):
    """Run on its own (not by the hub), the service stops as the hub would."""
    snippets = write_snippets(hub_dir, GROUPS, "c.SliceServiceApp.cul_every = '30s'")
    with pytest.raises(SystemExit) as stopped:
        SliceServiceApp().initialize([f"--config-dir={snippets}"])
    assert ("c.SliceServiceApp.cul_every is not a setting of SliceServiceApp; did you "
            "mean 'cull_every'?") in str(stopped.value.code)


# --- what may be on purpose: a warning, in-process -----------------------------------


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
        ("c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb'], "
         "'quota_slices': 0}}",
         "group 'analysts' has quota_slices = 0: no slice is ever charged to it"),
    ],
    ids=["group-not-on-the-hub", "allowed-nothing", "offer-without-device", "memory-wording",
         "quota-zero"],
)
def test_policy_that_may_be_on_purpose_is_a_warning(hub_dir, capsys, groups, warning):
    config = load_config_files(write_snippets(hub_dir, groups))
    config.JupyterHub.load_groups = {"analysts": {"users": []}}
    assert check_hub_config(config).groups  # the policy, for the hub to use
    err = capsys.readouterr().err.replace("\n", " ")
    assert "mig-spawner: warning: " in err and warning in err, err


def test_a_role_or_service_added_after_the_check_is_kept(hub_dir):
    """The check reads a copy: a role or service appended after it (a later file, Zero
    to JupyterHub's extraConfig) reaches the hub, as does everything before it, and
    reading a section makes none."""
    config = load_config_files(write_snippets(hub_dir, GROUPS))
    config.JupyterHub.load_roles.append({"name": "early", "groups": ["analysts"]})
    config.JupyterHub.services.append({"name": "early-service"})
    sections = set(config)
    check_hub_config(config)
    assert set(config) == sections
    config.JupyterHub.load_roles.append({"name": "late", "groups": ["analysts"]})
    config.JupyterHub.services.append({"name": "late-service"})

    # What the hub's List traits are given (traitlets' Configurable._load_config).
    roles = config.JupyterHub.load_roles.get_value([])
    assert [r["name"] for r in roles] == ["early", "late"]
    services = config.JupyterHub.services.get_value([])
    assert [s["name"] for s in services] == ["early-service", "late-service"]


# --- the wiring, on a real hub: once a refusal, once a start ---------------------------


def test_a_refusal_stops_the_real_hub_before_it_starts(tmp_path):
    write_snippets(tmp_path, GROUPS, "c.LocalMIGSpawnr.mig_mode = 'dynamic'")
    shutil.copy(REPO / "jupyterhub_config.py", tmp_path / "jupyterhub_config.py")
    result = subprocess.run(
        [str(JUPYTERHUB), "-f", str(tmp_path / "jupyterhub_config.py"), "--port=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert SETTING_WRONG in result.stderr, result.stderr[-2000:]
    assert "did you mean c.LocalMIGSpawner?" in result.stderr, result.stderr[-2000:]
    # It stopped at config time: no database was made, no port was ever bound.
    assert not (tmp_path / "jupyterhub.sqlite").exists()


def test_a_hub_with_a_warning_starts_with_what_came_after_the_check(tmp_path):
    snippets = write_snippets(
        tmp_path, "c.MIGPolicyConfig.group_policies = {'analyst': {'allowed': ['1g.18gb']}}")
    hub = HubProcess.start(tmp_path / "hub", sorted(snippets.glob("*.py")), textwrap.dedent("""
        c.JupyterHub.load_groups = {"analysts": {"users": []}}
        from mig_spawner.spawner.startup import check_hub_config
        check_hub_config(c)
        c.JupyterHub.services.append({"name": "added-after-the-check"})
    """))
    try:
        log = hub.log_tail(100_000).replace("\n", " ")
        assert ("mig-spawner: warning: c.MIGPolicyConfig.group_policies has a policy for the "
                "group 'analyst'") in log, log[-2000:]
        services = hub.session.get(hub.api("/services"), timeout=10)
        assert "added-after-the-check" in services.json(), services.text
    finally:
        hub.close()

