"""Starts on a loaded host, on a real hub: the spawner waits for its server to answer.

JupyterHub gives a started server ``http_timeout`` to answer and then stops it; on a
loaded host servers took longer (3 of 15 starts failed so in the demo, one of them a
waiter's right after its grant, who lost the slice and queued again at the back). One
hub with ``http_timeout`` of 2 s, a third of what these servers take (the demo's 30 s
against starts of 30 s and more):

* a server that answers only after 6 s starts, where JupyterHub stopped it at 2 s;
* a server whose first process exits before it answers is started once more on the
  same slice, which its lease keeps: one lease, no second place in line.
"""

from __future__ import annotations

import stat
import textwrap

import pytest

from mig_spawner.ledger import Ledger
from tests.support.hub_harness import VENV_BIN, start_mig_hub

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*2"
#: The server's command: sleeps $DELAY first; with $FLAKY its first run exits at once.
WRAPPER = f"""#!/bin/sh
if [ -n "$FLAKY" ] && [ ! -e "$HOME/.ran-once" ]; then touch "$HOME/.ran-once"; exit 3; fi
sleep "${{DELAY:-0}}"
exec {VENV_BIN / "jupyterhub-singleuser"} "$@"
"""


def test_a_slow_or_failed_first_start_keeps_its_slice_and_starts(tmp_path):
    wrapper = tmp_path / "singleuser.sh"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    url = f"sqlite:///{tmp_path}/ledger.sqlite"
    hub = start_mig_hub(tmp_path, SIM, textwrap.dedent(f"""
        c.Spawner.cmd = [{str(wrapper)!r}]
        c.Spawner.http_timeout = 2
        c.Spawner.start_timeout = 60
        c.MIGSettings.ledger_url = {url!r}
        c.MIGPolicyConfig.group_policies = {{"team": {{"allowed": ["small"]}}}}
        def _env(spawner):
            spawner.environment = {{"slow": {{"DELAY": "6"}}, "flaky": {{"FLAKY": "1"}}}}.get(
                spawner.user.name, {{}})
        c.Spawner.pre_spawn_hook = _env
    """))
    try:
        hub.create_users(["slow", "flaky"], groups=["team"])
        for name in ("slow", "flaky"):
            r = hub.spawn(name, {"profile": "small"})
            assert r.status_code in (201, 202), r.text + hub.log_tail(30000)
        for name in ("slow", "flaky"):
            hub.wait_ready(name, timeout=120)
        log = hub.log_tail(10**7)
        assert "never showed up" not in log  # JupyterHub's http_timeout did not end one
        assert "slow answered" in log and "flaky stopped before it answered (start 1 of 2" in log
        with Ledger.open(url) as ledger:
            # Each kept the slice it was given: one lease each, none released.
            leases = {name: ledger.leases.history(user=name) for name in ("slow", "flaky")}
        assert {name: [x.state for x in found] for name, found in leases.items()} == {
            "slow": ["active"], "flaky": ["active"]}
    finally:
        hub.close()
