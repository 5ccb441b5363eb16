"""The shipped jupyterhub_config.py, and ``mig-spawner demo``: config and what it prints.

The demo hub itself runs in test_demo_hub.py; here only what the demo's config and
banner say (users, groups, ports, limits, the slice service, the who-sees-what table).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from traitlets.config import PyFileConfigLoader

from mig_spawner.cli import demo
from mig_spawner.cli.main import build_parser
from mig_spawner.service.app import SliceServiceApp

REPO = Path(__file__).resolve().parents[1]


def _args(tmp_path, *argv):
    return build_parser().parse_args(["demo", "--simulate", "--dir", str(tmp_path), *argv])


def load(path):
    return PyFileConfigLoader(path.name, path=str(path.parent)).load_config()


def test_config_has_the_demo_users_in_three_groups_and_the_simulated_gpus(tmp_path):
    path = demo.write_config(_args(tmp_path), tmp_path)
    config = load(path)
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8000"
    assert config.JupyterHub.spawner_class == "mig-simple"
    groups = config.JupyterHub.load_groups
    assert set(groups) == {"analysts", "ml-team", "research", "admins"}
    # The demo admin is a hub admin, and named servers let per-user limits be tried.
    assert config.Authenticator.admin_users == {"ada"}
    assert config.JupyterHub.allow_named_servers is True
    assert config.JupyterHub.named_server_limit_per_user == demo.NAMED_SERVER_LIMIT > 2
    assert config.Authenticator.allowed_users == {u for g in groups.values() for u in g["users"]}
    assert config.SharedPasswordAuthenticator.user_password == demo.DEFAULT_PASSWORD
    assert config.MIGSettings.simulate == demo.DEMO_SPEC
    # The shipped policies are loaded, not a copy of them.
    assert "analysts" in config.MIGPolicyConfig.group_policies
    # Every demo group may wait for a full size instead of being refused.
    assert all(p["queue"] and p["max_wait"] == 900
               for p in config.MIGPolicyConfig.group_policies.values())
    # And checked as the shipped jupyterhub_config.py checks them, last.
    assert path.read_text().rstrip().endswith("check_hub_config(c)")


def test_the_demo_refuses_a_wrong_setting_as_the_hub_does(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "SNIPPETS", (*demo.SNIPPETS, "99-typo.py"))
    monkeypatch.setattr(demo, "config_dir", lambda: tmp_path / "conf")
    (tmp_path / "conf").mkdir()
    for name in demo.SNIPPETS[:-1]:
        (tmp_path / "conf" / name).symlink_to(REPO / "jupyterhub_config.d" / name)
    (tmp_path / "conf" / "99-typo.py").write_text("c.SimpleLocalMIGSpawner.strategy = 'packed'\n")
    path = demo.write_config(_args(tmp_path), tmp_path)
    with pytest.raises(SystemExit, match=r"c.SimpleLocalMIGSpawner.strategy = 'packed'"):
        load(path)


def test_without_simulate_the_demo_uses_the_real_driver(tmp_path):
    args = _args(tmp_path)
    args.simulate = None
    path = demo.write_config(args, tmp_path)
    assert "MIGSettings.simulate" not in path.read_text()


def test_it_prints_who_sees_what_on_the_spawn_form(tmp_path):
    table = demo.who_sees_what(_args(tmp_path), tmp_path)
    assert "GPU 0 NVIDIA H200, GPU 1 NVIDIA H200, GPU 2 NVIDIA H200" in table
    rows = table.splitlines()
    analysts = next(r for r in rows if "analysts" in r)
    assert "small (6 free)" in analysts and "medium (2 free)" in analysts
    assert "large" not in analysts
    admins = next(r for r in rows if " admins " in r)
    # Every offer has an instance in the demo's layout, the whole GPU too.
    assert "none free" not in table
    assert "full (1 free)" in admins


def test_the_slice_service_runs_beside_the_demo_hub_on_its_config_and_short_limits(tmp_path):
    path = demo.write_config(_args(tmp_path, "--kernel-idle", "20s", "--port", "8123"),
                             tmp_path)
    config = load(path)
    [service] = [s for s in config.JupyterHub.services if s["name"] == demo.SLICE_SERVICE]
    # On a port of its own (not the snippet's fixed 10101), reading the demo's file.
    assert service["url"] != "http://127.0.0.1:10101"
    assert service["command"][-1] == f"--config-dir={path}"
    assert sum(a.startswith("--config-dir=") for a in service["command"]) == 1
    assert "custom:mig-spawner:slicemap" in config.JupyterHub.custom_scopes.get_value({})

    # What the service itself makes of that file: the demo's GPUs, ledger and limits.
    app = SliceServiceApp()
    app.initialize(service["command"][3:])
    shared = app.shared
    assert shared.simulate == demo.DEMO_SPEC
    assert shared.sim_state_file == f"{tmp_path}/sim-gpus.json"
    assert app.ledger_url == f"sqlite:///{tmp_path}/mig_spawner_ledger.sqlite"
    assert app.cull_every == 15 and app.slice_idle_after == 20
    policy = app.load_policy()
    assert policy.group("analysts").kernel_idle_timeout == 20
    assert policy.group("admins").server_idle_timeout == 600
    # The snippet's longer limit while nobody waits is the demo's too, and every group
    # warns well before its stops (the demo once warned every server as it started).
    analysts = policy.group("analysts")
    assert analysts.server_idle_timeout_when_unwaited == 600
    assert analysts.server_idle_timeout_when_waited == 300
    assert analysts.warn_before == 180 and analysts.max_wait == 900


def test_bad_limit_says_what_to_write(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--kernel-idle", "soon")
    assert "--kernel-idle: 'soon' is not a duration" in capsys.readouterr().err


def test_the_banner_gives_limits_and_the_slice_map(tmp_path):
    text = demo.banner(_args(tmp_path, "--port", "8123"), tmp_path)
    assert "a kernel idle 2 min is shut down, a server idle 10 min is stopped" in text
    assert "(5 min while someone waits for its size), after a warning 3 min before" in text
    assert "a spawn waits at most 15 min for a slice (max_wait)" in text
    assert "checks every 15 s" in text
    other = demo.banner(_args(tmp_path, "--warn-before", "1m", "--max-wait", "5m"), tmp_path)
    assert "after a warning 1 min before; a spawn waits at most 5 min" in other
    assert re.search(r"Slice map \(log in as ada, group admins\): "
                     r"http://127.0.0.1:8123/services/mig-slices/slices", text)


def test_the_banners_cli_command_works_as_typed_without_the_venv_on_path(tmp_path):
    text = demo.banner(_args(tmp_path), tmp_path)
    command = re.search(r"from this folder: (\S+) doctor -f (\S+) ", text)
    assert command is not None, text
    # 'make demo' puts .venv/bin on its own PATH only: the shell that ran it finds no
    # bare 'mig-spawner', so the banner names the script by its path.
    assert "/" in command.group(1) and os.access(command.group(1), os.X_OK)
    assert command.group(2) == str(tmp_path / "demo_config.py")


def test_the_banner_says_how_to_stop_the_demo_in_the_background_too(tmp_path):
    text = demo.banner(_args(tmp_path), tmp_path)
    # Ctrl-C in a terminal; SIGTERM to the demo's own PID where SIGINT is ignored.
    assert "Ctrl-C" in text
    assert f"'kill {os.getpid()}' (SIGTERM" in text and "in the background" in text


def test_demo_help_shows_the_defaults_of_port_ip_and_dir(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: .demo)"):
        assert default in help_text, help_text


def test_make_demo_passes_demo_args_on():
    dry = subprocess.run(["make", "-n", "demo", "DEMO_ARGS=--port 8300 --ip 0.0.0.0"],
                         cwd=REPO, capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert "mig-spawner demo --simulate --port 8300 --ip 0.0.0.0" in dry.stdout


def test_point_service_needs_the_service_loaded():
    from traitlets.config import Config

    with pytest.raises(ValueError, match=r"load jupyterhub_config\.d/30-slice-service\.py"):
        demo.point_service(Config(), "mig-slices", "http://127.0.0.1:1", "x.py")


def test_the_shipped_jupyterhub_config_loads_every_snippet_in_order(monkeypatch):
    """Every snippet loads, in order, and then the start-up check runs on them all. Its
    host facts (a ledger folder in /srv/jupyterhub, a GPU host's nvidia-modprobe) are
    those of the host the shipped config is written for, not this one: here the check
    is recorded, and the settings' names and values are checked."""
    from mig_spawner.config import section_problems
    from mig_spawner.spawner import startup

    checked = []
    monkeypatch.setattr(startup, "check_hub_config", checked.append)
    repo = Path(demo.__file__).resolve().parents[2]
    config = PyFileConfigLoader("jupyterhub_config.py", path=str(repo)).load_config()
    assert config.JupyterHub.spawner_class == "mig"  # 10-spawner.py
    assert config.LocalMIGSpawner.mig_mode == "pool"
    assert "ml-team" in config.MIGPolicyConfig.group_policies  # 20-groups.py
    assert config.JupyterHub.cleanup_servers is False  # 00-hub.py
    assert checked == [config]  # after the last snippet
    assert section_problems(config, startup._checked_classes(config).values()) == []
