"""``mig-spawner demo --simulate`` end to end, as a person trying it would use it.

One demo for the module, started as ``make demo`` starts it (with free ports, a temp
folder and a kernel idle limit of seconds): users log in through the hub's login form
with the demo password, each group's user sees its own menu, an analyst starts a
server and a kernel and leaves it idle, the slice service beside the hub shuts the
kernel down at the limit, the demo admin opens the slice map through the hub's OAuth
and sees the analyst's slice, and SIGTERM stops the demo with everything it started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from mig_spawner.cli.demo import (
    DEFAULT_ADMIN_PASSWORD,
    DEFAULT_PASSWORD,
    DEMO_GROUPS,
    SLICEMAP_PATH,
)
from tests.support import reaper
from tests.support.hub_harness import VENV_BIN, free_port
from tests.support.polling import until

pytestmark = pytest.mark.hub

KERNEL_IDLE = 10  # seconds, the demo's --kernel-idle here
SWEEP = 2  # seconds, --sweep-every
SMALL_ON_H200 = "1g.18gb"  # what the "small" class is on the demo's GPUs


@dataclass
class Demo:
    proc: subprocess.Popen
    url: str
    workdir: Path

    def log(self, chars: int = 6000) -> str:
        return (self.workdir / "demo.log").read_text(errors="replace")[-chars:]

    def login(self, name: str) -> requests.Session:
        """A browser-like session, logged in through the login form (cookie and _xsrf)."""
        browser = requests.Session()
        browser.get(f"{self.url}/hub/login", timeout=30).raise_for_status()
        r = browser.post(
            f"{self.url}/hub/login",
            data={"username": name, "password": DEFAULT_ADMIN_PASSWORD
                  if name in DEMO_GROUPS["admins"] else DEFAULT_PASSWORD,
                  "_xsrf": browser.cookies.get("_xsrf", path="/hub/")},
            timeout=30, allow_redirects=False,
        )
        assert r.status_code == 302, f"login of {name}: {r.status_code}\n{self.log()}"
        return browser

    def api(self, browser: requests.Session, method: str, path: str, **kw) -> requests.Response:
        """The hub's REST API with the browser's cookie, which needs its XSRF token."""
        headers = {"X-XSRFToken": browser.cookies.get("_xsrf", path="/hub/")}
        return browser.request(method, f"{self.url}/hub/api{path}", headers=headers,
                               timeout=60, **kw)


def _up(demo: Demo) -> bool:
    assert demo.proc.poll() is None, f"the demo exited\n{demo.log()}"
    try:
        # Up once the hub answers and the slice service (through the proxy) has swept.
        return requests.get(f"{demo.url}/services/mig-slices/health", timeout=2).ok
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    port = free_port()
    with (workdir / "demo.log").open("wb") as log:
        proc = reaper.start(
            [str(VENV_BIN / "mig-spawner"), "demo", "--simulate", "--port", str(port),
             "--dir", str(workdir), "--kernel-idle", f"{KERNEL_IDLE}s",
             "--sweep-every", f"{SWEEP}s"], "mig-spawner demo",
            stdout=log, stderr=subprocess.STDOUT,
        )
    running = Demo(proc, f"http://127.0.0.1:{port}", workdir)
    until(lambda: _up(running), 90, "the demo up", show=running.log)
    yield running
    if proc.poll() is None:  # a test failed before stopping it
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def menu(demo: Demo, browser: requests.Session) -> list[str]:
    form = browser.get(f"{demo.url}/hub/spawn", timeout=30)
    form.raise_for_status()
    return re.findall(r'name="profile"[^>]*?value="([^"]+)"', form.text)


def test_the_banner_names_the_limits_and_the_slice_map(demo):
    text = demo.log(chars=10**7)
    assert f"a kernel idle {KERNEL_IDLE} s is shut down" in text
    assert f"Slice map (log in as ada, group admins): {demo.url}{SLICEMAP_PATH}" in text


def test_doctor_on_the_demos_config_passes_as_the_banner_says(demo):
    text = demo.log(chars=10**7)
    command = re.search(r"from this folder: (\S+ doctor -f \S+)", text).group(1)
    # As typed in a shell that has not got .venv/bin on its PATH (make demo's has).
    out = subprocess.run(f"{command} --json", shell=True, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["name"]: c["status"] for c in json.loads(out.stdout)["checks"]}
    # It read the demo's simulated GPUs and its policies, not "no NVML".
    assert checks["NVML"] == checks["offered profiles"] == checks["hub settings"] == "pass"
    assert "warn" not in checks.values(), out.stdout


def test_each_group_sees_its_own_menu(demo):
    menus = {name: menu(demo, demo.login(name)) for name in ("ben", "mia", "rui", "ada")}
    assert menus["ben"] == ["small", "medium"]  # analysts
    assert menus["mia"] == ["medium", "large", "1g.35gb"]  # ml-team
    assert menus["rui"] == ["large", "full"]  # research
    assert set(menus["ada"]) == {"small", "medium", "large", "full", "1g.35gb"}  # admins


def test_an_idle_kernel_is_shut_down_at_the_demo_limit_and_the_server_keeps_its_slice(demo):
    ana = demo.login("ana")
    r = ana.post(f"{demo.url}/hub/spawn", data={
        "profile": "small", "_xsrf": ana.cookies.get("_xsrf", path="/hub/")},
        timeout=60, allow_redirects=False)
    assert r.status_code == 302, r.text

    def ready() -> bool:
        server = demo.api(ana, "GET", "/users/ana").json()["servers"].get("")
        return bool(server and server["ready"])
    until(ready, 60, "ana's server ready", show=demo.log)

    # Jupyter's REST API with a token ana makes for herself (as on /hub/token).
    token = demo.api(ana, "POST", "/users/ana/tokens", json={"note": "test"}).json()["token"]
    jupyter = requests.Session()
    jupyter.headers["Authorization"] = f"token {token}"
    kernels = f"{demo.url}/user/ana/api/kernels"
    r = jupyter.post(kernels, json={"name": "python3"}, timeout=60)
    assert r.status_code == 201, r.text
    kernel_id, started = r.json()["id"], time.monotonic()

    until(lambda: all(k["id"] != kernel_id for k in jupyter.get(kernels, timeout=30).json()),
          KERNEL_IDLE + 6 * SWEEP + 15, "the idle kernel culled", show=demo.log, every=0.5)
    assert time.monotonic() - started >= KERNEL_IDLE - 1  # not before its limit
    assert f"culling kernel {kernel_id} of ana (group analysts): kernel_idle" in demo.log(
        chars=10**7)
    assert ready()  # the server, and so its slice, stay
    # A fresh server in use is not warned of a stop, with the demo's own limits (it was
    # warned "stops in about 9m" seconds after it started, its warn_before being as
    # long as its idle limit).
    assert demo.api(ana, "GET", "/mig-spawner/warnings").json() == {"warnings": []}
    assert "warned ana" not in demo.log(chars=10**7)


def test_the_admin_sees_the_analysts_slice_on_the_map_and_an_analyst_may_not(demo):
    ada = demo.login("ada")
    page = ada.get(demo.url + SLICEMAP_PATH, timeout=30)  # through the hub's OAuth
    assert page.status_code == 200 and page.url == demo.url + SLICEMAP_PATH, page.text[:500]
    data = ada.get(demo.url + SLICEMAP_PATH + ".json", timeout=30).json()
    held = [s for gpu in data["gpus"] for s in gpu["slices"] if s["user"] == "ana"]
    assert [s["profile"] for s in held] == [SMALL_ON_H200]
    assert held[0]["state"] in ("leased", "idle") and held[0]["group"] == "analysts"
    # The hub's Services menu links to the service's root: it leads to the map.
    assert ada.get(f"{demo.url}/services/mig-slices/", timeout=30).url == demo.url + SLICEMAP_PATH

    denied = demo.login("ben").get(demo.url + SLICEMAP_PATH, timeout=30)
    assert denied.status_code == 403

    # ada is a hub admin too: the admin page, and every user's servers over the API.
    admin_page = ada.get(f"{demo.url}/hub/admin", timeout=30)
    assert admin_page.status_code == 200 and admin_page.url.endswith("/hub/admin")
    assert demo.api(ada, "GET", "/users/ana").json()["servers"][""]["ready"]


def test_sigterm_stops_the_hub_proxy_service_and_servers(demo):
    started = psutil.Process(demo.proc.pid).children(recursive=True)
    commands = " ".join(" ".join(p.cmdline()) for p in started)
    for part in ("jupyterhub -f", "configurable-http-proxy", "mig_spawner.service",
                 "jupyterhub-singleuser"):
        assert part in commands, commands
    demo.proc.send_signal(signal.SIGTERM)
    assert demo.proc.wait(60) == 0, demo.log()
    _, alive = psutil.wait_procs(started, timeout=15)
    assert alive == [], [p.cmdline() for p in alive]
