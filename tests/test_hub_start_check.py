"""A wrong GPU policy stops the real hub at start, naming the group and the key."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"

SPAWNER = """
c = get_config()  # noqa: F821
c.JupyterHub.spawner_class = "mig-simple"
c.MIGSettings.simulate = "h200x1:layout=1g.18gb*7"
"""


def start_hub(tmp_path: Path, groups: str) -> subprocess.CompletedProcess[str]:
    """Run the shipped jupyterhub_config.py over a config.d holding ``groups``."""
    shutil.copy(REPO / "jupyterhub_config.py", tmp_path / "jupyterhub_config.py")
    snippets = tmp_path / "jupyterhub_config.d"
    snippets.mkdir()
    (snippets / "10-spawner.py").write_text(SPAWNER)
    (snippets / "20-groups.py").write_text("c = get_config()  # noqa: F821\n" + groups)
    return subprocess.run(
        [str(JUPYTERHUB), "-f", str(tmp_path / "jupyterhub_config.py"), "--port=0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
