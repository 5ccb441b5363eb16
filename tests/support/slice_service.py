"""The slice service (``mig-spawner-service``) in a process of its own next to a real hub
started by :mod:`tests.support.hub_harness`: the token and scopes it runs with, the config
lines that let the harness read its metrics, and waiting on what it does."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests

from mig_spawner.service.app import REQUIRED_SCOPES
from mig_spawner.service.handlers import METRICS_SCOPE
from mig_spawner.service.metrics import PREFIX
from tests.support import reaper
from tests.support.hub_harness import (
    ADMIN_SERVICE,
    REPO,
    STOP_TIMEOUT,
    HubProcess,
    free_port,
    simulated_spawner,
)
from tests.support.polling import until

SERVICE = "mig-slices"
#: Seconds a starting service has to answer: its imports alone take most of that on a
#: loaded test machine.
START_TIMEOUT = 90
TOKEN = "slice-service-e2e-token-" + "0" * 16
#: Config lines that let the harness's admin token read the services' metrics (private
#: by default): every hub that runs the service under test adds them.
METRICS_READERS = f"""\
c.JupyterHub.custom_scopes = {{"{METRICS_SCOPE}": {{"description": "metrics"}}}}
c.JupyterHub.load_roles.append({{"name": "metrics-readers",
    "scopes": ["{METRICS_SCOPE}"], "services": ["{ADMIN_SERVICE}"]}})
"""
SCOPES = list(REQUIRED_SCOPES)
#: The histogram of sweep durations: its count is the number of sweeps ended.
SWEEP_DURATION = f"{PREFIX}_sweep_duration_seconds"
#: Config lines that register the service under test (its token and the scopes it needs)
#: and let the harness read its metrics.
SERVICE_CONFIG = f"""\
c.JupyterHub.services.append({{"name": "{SERVICE}", "api_token": "{TOKEN}"}})
c.JupyterHub.load_roles.append(
    {{"name": "{SERVICE}", "services": ["{SERVICE}"], "scopes": {SCOPES!r}}})
{METRICS_READERS}"""


def service_config_dir(workdir: Path, sim: str, extra: str) -> Path:
    """A ``jupyterhub_config.d`` in ``workdir`` for a hub on the shipped snippets with the
    MIG spawner on simulated GPUs ``sim``, servers polled every second, and the slice
    service sweeping every second (the service reads the same directory); ``extra``:
    config lines added last (a group policy)."""
    config_d = workdir / "jupyterhub_config.d"
    config_d.mkdir()
    for name in ("10-spawner.py", "20-groups.py"):
        (config_d / name).symlink_to(REPO / "jupyterhub_config.d" / name)
    (config_d / "90-test.py").write_text("\n".join((
        "c = get_config()  # noqa: F821",
        textwrap.dedent(simulated_spawner(workdir, sim)),
        "c.Spawner.poll_interval = 1",
        "c.Spawner.start_timeout = 120",
        "c.Spawner.http_timeout = 120",
        SERVICE_CONFIG,
        "c.SliceServiceApp.cull_every = 1",
        textwrap.dedent(extra),
    )))
    return config_d


class Service:
    """``mig-spawner-service`` as a process of its own, as the hub would run it."""

    def __init__(self, hub: HubProcess, config_d: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.hub = hub
        self.log_path = hub.workdir / "service.log"
        if self.log_path not in hub.beside:  # the hub's failures show this log too
            hub.beside.append(self.log_path)
        self.auth = {"Authorization": f"Bearer {hub.token}"}  # may read the metrics
        env = {**os.environ, "JUPYTERHUB_API_URL": hub.api(""),
               "JUPYTERHUB_API_TOKEN": TOKEN, "JUPYTERHUB_SERVICE_URL": self.url,
               "JUPYTERHUB_SERVICE_PREFIX": f"/services/{SERVICE}/",
               # A service slow to stop is asked where it is (close()).
               "PYTHONFAULTHANDLER": "1"}
        self.proc = reaper.start(
            [str(Path(sys.executable).parent / "mig-spawner-service"),
             f"--config-dir={config_d}", f"--proxy-url={hub.url}",
             f"--ledger-url=sqlite:///{hub.workdir}/mig_spawner_ledger.sqlite",
             "--log-level=DEBUG"],
            "the slice service", env=env, cwd=hub.workdir, stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def wait_up(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until it answers its health check (fails the test if it does not)."""
        until(self.up, timeout, "the slice service up", show=self.hub.show)

    def up(self) -> bool:
        """Whether it answers its health check (fails the test if it has exited)."""
        try:
            return self.get("/health").status_code == 200
        except requests.ConnectionError:
            if self.proc.poll() is not None:
                raise self.hub.failure(
                    f"the slice service exited with {self.proc.returncode}") from None
            return False

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, headers=self.auth, timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def counted(self, name: str, expected: float, timeout: float = 15, **labels: str) -> float:
        """:meth:`metric` once it reaches ``expected``; fails with the service's log if it
        has not after ``timeout`` seconds.

        A stop the service asked for is over in the hub (the server gone, its lease
        released) before the hub's answer reaches the service, which counts it then: on
        a loaded machine a read at once can come first."""
        until(lambda: self.metric(name, **labels) >= expected, timeout,
              f"{name} {labels} at {expected}", show=self.hub.show)
        return self.metric(name, **labels)

    def sweeps(self) -> int:
        """How many sweeps it has ended (``mig_spawner_service_sweep_duration_seconds``'s
        count, a cut-short one too)."""
        return int(self.metric(f"{SWEEP_DURATION}_count"))

    def swept(self, after: datetime | None = None, times: int = 1,
              timeout: float = 60) -> None:
        """Return once ``times`` whole sweeps have run since now, or since ``after`` (a
        wall-clock time, waited for first): each of them looked at everything as it is
        from then on. A test that checks that the service left something alone waits for
        this, then asserts, instead of sleeping."""
        if after is not None:
            until(lambda: datetime.now(UTC) >= after, timeout + _seconds_until(after),
                  f"the time {after:%H:%M:%S}", every=0.05)
        # The sweep under way now may have begun before: one more than asked.
        wanted = self.sweeps() + times + 1
        until(lambda: self.sweeps() >= wanted, timeout, f"{times} more sweep(s)",
              show=self.hub.show)

    def log(self) -> str:
        """The tail of its log, for a failed test to show."""
        return self.log_path.read_text(errors="replace")[-6000:]

    def logged(self, text: str) -> int:
        """How many times its whole log says ``text``: an event to wait for where the
        hub, which its metrics' reader needs, is down."""
        return self.log_path.read_text(errors="replace").count(text)

    def close(self) -> None:
        """Stop it, giving it the time JupyterHub gives a managed service before it
        kills it (SIGINT, 10 s, SIGTERM, 5 s); one that takes longer fails the test
        with its threads' stacks."""
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler writes every stack
            self.proc.wait(10)
            pytest.fail(f"the slice service did not stop within {STOP_TIMEOUT} s\n"
                        f"{self.log()}")


def _seconds_until(when: datetime) -> float:
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def end_lease_at(hub: HubProcess, lease_id: str, when: datetime) -> None:
    """Move a lease's end (``expires_at``) to ``when`` in the ledger of the service under
    test, as an extension moves it: to a time the hub knows nothing about, and one that
    a slow start on a loaded machine cannot have passed."""
    with sqlite3.connect(hub.workdir / "mig_spawner_ledger.sqlite") as db:
        db.execute("UPDATE leases SET expires_at = ? WHERE id = ?",
                   (when.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" "), lease_id))


def new_kernel(hub: HubProcess, user: str, *, booted: bool = False) -> str:
    """Start a kernel in ``user``'s server through the proxy and return its id; with
    ``booted``, once it has booted and answered a client (``HubProcess.greet_kernel``): a
    kernel's first status message is activity, and on a loaded machine it comes seconds
    after the request."""
    r = hub.session.post(f"{hub.url}/user/{user}/api/kernels", json={"name": "python3"},
                         timeout=60)
    r.raise_for_status()
    kernel = r.json()["id"]
    if booted:
        hub.greet_kernel(user, kernel)
    return kernel


def kernels(hub: HubProcess, user: str) -> dict[str, str]:
    """``user``'s kernels and their execution states, read through the proxy."""
    r = hub.session.get(f"{hub.url}/user/{user}/api/kernels", timeout=10)
    r.raise_for_status()
    return {k["id"]: k["execution_state"] for k in r.json()}
