"""The shipped jupyterhub_config.py, and ``mig-spawner demo``: config and what it prints.

The hub itself is exercised by test_spawner_hub.py and test_browser.py with the same
snippets; here only what the demo adds (users, groups, ports, the who-sees-what table).
"""

from __future__ import annotations

import argparse

from traitlets.config import PyFileConfigLoader

from mig_spawner.cli import demo


def _args(tmp_path, **kw):
    values = {"simulate": demo.DEMO_SPEC, "ip": "127.0.0.1", "port": 8000,
              "dir": str(tmp_path), "password": demo.DEFAULT_PASSWORD}
    values.update(kw)
    return argparse.Namespace(**values)


def test_config_has_the_demo_users_in_three_groups_and_the_simulated_gpus(tmp_path):
    path = demo.write_config(_args(tmp_path), tmp_path)
    config = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8000"
    assert config.JupyterHub.spawner_class == "mig-simple"
    groups = config.JupyterHub.load_groups
    assert set(groups) == {"analysts", "ml-team", "admins"}
    assert config.Authenticator.allowed_users == {u for g in groups.values() for u in g["users"]}
    assert config.SharedPasswordAuthenticator.user_password == demo.DEFAULT_PASSWORD
    assert config.LocalMIGSpawner.simulate == demo.DEMO_SPEC
    # The shipped policies are loaded, not a copy of them.
    assert "analysts" in config.MIGPolicyConfig.group_policies


def test_without_simulate_the_demo_uses_the_real_driver(tmp_path):
    path = demo.write_config(_args(tmp_path, simulate=None), tmp_path)
    assert "LocalMIGSpawner.simulate" not in path.read_text()


def test_it_prints_who_sees_what_on_the_spawn_form(tmp_path):
    table = demo.who_sees_what(_args(tmp_path), tmp_path)
    assert "GPU 0 NVIDIA H200, GPU 1 NVIDIA H200" in table
    rows = table.splitlines()
    analysts = next(r for r in rows if "analysts" in r)
    assert "small (6 free)" in analysts and "medium (2 free)" in analysts
    assert "large" not in analysts
    admins = next(r for r in rows if " admins " in r)
    assert "full (none free)" in admins


def test_the_shipped_jupyterhub_config_loads_every_snippet_in_order():
    from pathlib import Path

    repo = Path(demo.__file__).resolve().parents[2]
    config = PyFileConfigLoader("jupyterhub_config.py", path=str(repo)).load_config()
    assert config.JupyterHub.spawner_class == "mig"  # 10-spawner.py
    assert config.LocalMIGSpawner.mig_mode == "pool"
    assert "ml-team" in config.MIGPolicyConfig.group_policies  # 20-groups.py
    assert config.JupyterHub.cleanup_servers is False  # 00-hub.py
