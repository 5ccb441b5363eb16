"""The hub's start-up check on a jupyterhub_config.d the test writes: the snippets
(the MIG spawner on a simulated H200, the group policies, more settings) and what the
check stops the hub with."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from mig_spawner.config import load_config_files
from mig_spawner.spawner.startup import check_hub_config

#: The hub's command, from the test's virtualenv.
JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"
#: Group policies that pass the check: analysts may have a 1g.18gb.
GROUPS = "c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': ['1g.18gb']}}"
SPAWNER = """
c = get_config()  # noqa: F821
c.JupyterHub.spawner_class = "mig-simple"
c.MIGSettings.simulate = "h200x1:layout=1g.18gb*7"
"""
#: What the check's one line begins with for a wrong policy, or a wrong setting.
POLICY_WRONG = "the GPU policy in jupyterhub_config.d is wrong"
SETTING_WRONG = "the configuration in jupyterhub_config.d is wrong"


def write_snippets(tmp_path: Path, groups: str, extra: str = "") -> Path:
    """A jupyterhub_config.d holding the spawner, ``groups`` and ``extra``."""
    snippets = tmp_path / "jupyterhub_config.d"
    snippets.mkdir()
    (snippets / "10-spawner.py").write_text(SPAWNER)
    (snippets / "20-groups.py").write_text("c = get_config()  # noqa: F821\n" + groups)
    (snippets / "90-extra.py").write_text(
        "c = get_config()  # noqa: F821\n" + textwrap.dedent(extra))
    return snippets


def refusal(hub_dir: Path, groups: str, extra: str = "") -> str:
    """What the start-up check stops the hub with, on the snippets of ``groups`` and
    ``extra`` (loaded as ``jupyterhub_config.py`` loads them)."""
    config = load_config_files(write_snippets(hub_dir, groups, extra))
    with pytest.raises(SystemExit) as stopped:
        check_hub_config(config)
    return str(stopped.value.code)
