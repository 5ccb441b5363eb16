"""``mig-spawner demo``: a real JupyterHub on http://127.0.0.1:8000 sharing MIG slices.

Starts JupyterHub and configurable-http-proxy with the repository's own config
snippets (``jupyterhub_config.d/10-spawner.py``, ``20-groups.py`` and
``30-slice-service.py``), demo users in four groups who log in with one shared
password, the MIG spawner in pool mode, and the slice service beside the hub with
limits short enough to watch it cull (``--kernel-idle``, ``--server-idle``); the
demo admin (a hub admin) opens its slice map. With ``--simulate`` the GPUs are the NVML simulator
(a pre-partitioned 3 x H200 by default, shared with ``mig-spawner status -f
.demo/demo_config.py``); without it, the real driver. Servers run as the hub's own user
(``mig-simple``): a demo, not a deployment (docs/admin-install.md). ``--isolation``
confines each server to its slice's device nodes (root and a device cgroup needed); with
simulated GPUs the nodes are stand-ins under the demo's folder, which no driver backs:
opening one's own gives "No such device or address", another slice's "Operation not
permitted".
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from traitlets.config import Config

from mig_spawner.config import setting_value
from mig_spawner.core.durations import DurationError, parse_duration
from mig_spawner.core.kinds import Kind

#: Every profile 20-groups.py offers exists here (``doctor`` on the demo passes): small,
#: medium, large and 1g.35gb on the first two H200, the whole-GPU instance on the third.
DEMO_SPEC = ("h200x1:layout=1g.18gb*4,2g.35gb,1g.35gb+h200x1:layout=3g.71gb,2g.35gb,1g.18gb*2"
             "+h200x1:layout=7g.141gb")
#: One user or two in each group that 20-groups.py has a policy for.
DEMO_GROUPS = {
    "analysts": ["ana", "ben"],
    "ml-team": ["mia", "max"],
    "research": ["rui"],
    "admins": ["ada"],
}
#: Named servers per user: one more than any group's max_slices_per_user (2), so that
#: the per-user limit can be tried.
NAMED_SERVER_LIMIT = 3
DEFAULT_PASSWORD = "mig-demo-pass"
#: JupyterHub's shared-password login lets hub admins in only with a password of their
#: own, 32 characters or more.
DEFAULT_ADMIN_PASSWORD = "mig-demo-admin-pass-for-this-demo-only"
SNIPPETS = ("10-spawner.py", "20-groups.py", "30-slice-service.py")
#: The slice service's name in 30-slice-service.py, and where its slice map is served.
SLICE_SERVICE = "mig-slices"
SLICEMAP_PATH = f"/services/{SLICE_SERVICE}/slices"
#: The demo's limits, in every group: short enough to watch the slice service work.
#: ``warn_before`` must stay shorter than the idle limit while someone waits (half of
#: ``server_idle``); the hub's start-up check refuses it otherwise.
DEMO_LIMITS = {"kernel_idle": "2m", "server_idle": "10m", "warn_before": "3m",
               "max_wait": "15m", "sweep_every": "15s"}


def config_dir() -> Path:
    """The repository's jupyterhub_config.d (the demo runs from a checkout)."""
    here = Path(__file__).resolve().parents[2] / "jupyterhub_config.d"
    if not all((here / name).is_file() for name in SNIPPETS):
        raise SystemExit(
            f"error: {here} with {', '.join(SNIPPETS)} not found; run the demo from a "
            "checkout of the mig-spawner repository (make demo)"
        )
    return here


def find_proxy() -> str:
    """configurable-http-proxy from PATH or the checkout's node_modules."""
    local = Path(__file__).resolve().parents[2] / "node_modules" / ".bin"
    found = shutil.which("configurable-http-proxy") or shutil.which(
        "configurable-http-proxy", path=str(local)
    )
    if not found:
        raise SystemExit(
            "error: configurable-http-proxy not found; install it with "
            "'npm install configurable-http-proxy' (make setup does)"
        )
    return found


def free_port() -> int:
    """A TCP port free a moment ago: the demo's internal ports must not clash with
    another hub (or another demo) on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def point_service(c: Config, name: str, url: str, config_file: str) -> None:
    """Move the hub-managed service ``name`` (defined in a loaded snippet) to ``url``
    and make it read ``config_file`` instead of the snippet's own directory.

    For a hub config that loads ``30-slice-service.py`` but keeps its settings
    elsewhere (the demo's generated file, a test's). Raises ValueError if no
    service ``name`` was loaded.
    """
    services = setting_value(c.JupyterHub, "services", [])
    if not any(service.get("name") == name for service in services):
        raise ValueError(f"no service {name!r} in c.JupyterHub.services: load "
                         "jupyterhub_config.d/30-slice-service.py first")
    c.JupyterHub.services = [
        {**service, "url": url, "command": [
            *(arg for arg in service["command"] if not arg.startswith("--config-dir=")),
            f"--config-dir={config_file}",
        ]} if service.get("name") == name else service
        for service in services
    ]


def seconds(value: str) -> float:
    """argparse type: a duration ("20s", "2m") as seconds, or a clear error."""
    try:
        return parse_duration(value, unlimited_ok=False)
    except DurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def workdir_config(workdir: Path) -> Path:
    """The demo's hub config in its folder: what ``mig-spawner <command> -f`` reads."""
    return workdir / "demo_config.py"


def write_config(args: argparse.Namespace, workdir: Path) -> Path:
    """The hub config for the demo: shipped snippets plus demo users, ports, paths and
    short limits. The slice service reads this same file."""
    bin_dir = Path(sys.executable).parent
    users = sorted(u for members in DEMO_GROUPS.values() for u in members)
    groups = {name: {"users": members} for name, members in DEMO_GROUPS.items()}
    path = workdir_config(workdir)
    short = {key: getattr(args, key) for key in DEMO_LIMITS}
    lines = [
        "# Written by 'mig-spawner demo'; every run rewrites it.",
        "c = get_config()  # noqa: F821",
        *(f"load_subconfig({str(config_dir() / n)!r})  # noqa: F821" for n in SNIPPETS),
        f'c.JupyterHub.bind_url = "http://{args.ip}:{args.port}"',
        f'c.JupyterHub.db_url = "sqlite:///{workdir}/jupyterhub.sqlite"',
        f'c.JupyterHub.cookie_secret_file = "{workdir}/jupyterhub_cookie_secret"',
        f'c.JupyterHub.pid_file = "{workdir}/jupyterhub.pid"',
        f"c.JupyterHub.hub_port = {free_port()}",
        f'c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{free_port()}"',
        f"c.ConfigurableHTTPProxy.command = [{find_proxy()!r}]",
        'c.JupyterHub.authenticator_class = "shared-password"',
        f"c.SharedPasswordAuthenticator.user_password = {args.password!r}",
        f"c.SharedPasswordAuthenticator.admin_password = {args.admin_password!r}",
        f"c.Authenticator.allowed_users = {set(users)!r}",
        # The demo admin is a hub admin too (/hub/admin: start and stop anyone's server).
        f"c.Authenticator.admin_users = {set(DEMO_GROUPS['admins'])!r}",
        "c.JupyterHub.allow_named_servers = True",
        f"c.JupyterHub.named_server_limit_per_user = {NAMED_SERVER_LIMIT}",
        f"c.JupyterHub.load_groups = {groups!r}",
        'c.JupyterHub.spawner_class = "mig-simple"',
        f'c.SimpleLocalMIGSpawner.home_dir_template = "{workdir}/home/{{username}}"',
        f"c.Spawner.cmd = [{str(bin_dir / 'jupyterhub-singleuser')!r}]",
        # Users land in JupyterLab (the 'demo' extra installs it).
        'c.Spawner.default_url = "/lab"',
        "# Short limits in every group, to see the slice service cull within minutes;",
        "# a full GPU puts a spawn on the wait list (queue) instead of refusing it, and",
        "# while someone waits for a size, its idle servers go after half the idle limit.",
        "c.MIGPolicyConfig.group_policies = {",
        "    name: {**policy, "
        f'"kernel_idle_timeout": {short["kernel_idle"]}, '
        f'"server_idle_timeout": {short["server_idle"]}, '
        f'"server_idle_timeout_when_unwaited": {short["server_idle"]}, '
        f'"server_idle_timeout_when_waited": {short["server_idle"] / 2}, '
        f'"warn_before": {short["warn_before"]}, "queue": True, '
        f'"max_wait": {short["max_wait"]}}}',
        "    for name, policy in c.MIGPolicyConfig.group_policies.items()",
        "}",
        f"c.SliceServiceApp.cull_every = {short['sweep_every']}",
        f"c.SliceServiceApp.slice_idle_after = {short['kernel_idle']}",
        "c.SliceServiceApp.slicemap_refresh = 5",
        "# The slice service on a free port, reading this file: the demo's users, GPUs,",
        "# ledger and limits, not only the repository's snippets.",
        "from mig_spawner.cli.demo import point_service  # noqa: E402",
        f"point_service(c, {SLICE_SERVICE!r}, 'http://127.0.0.1:{free_port()}', __file__)",
    ]
    if os.geteuid() == 0:
        lines.append('c.Spawner.args = ["--ServerApp.allow_root=True"]')
    if args.simulate:
        lines += [
            f"c.MIGSettings.simulate = {args.simulate!r}",
            f'c.MIGSettings.sim_state_file = "{workdir}/sim-gpus.json"',
        ]
    if args.isolation:
        lines.append("c.LocalMIGSpawner.isolation = True")
        if args.simulate:
            lines.append(f'c.LocalMIGSpawner.device_dir = "{stand_in_dir(workdir)}"')
    lines += [
        "# The hub's start-up check, as the shipped jupyterhub_config.py runs it.",
        "from mig_spawner.spawner.startup import check_hub_config  # noqa: E402",
        "check_hub_config(c)",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def stand_in_dir(workdir: Path) -> Path:
    """Where ``--isolation --simulate`` makes the simulated GPUs' device nodes."""
    return workdir / "dev"


def check_isolation(args: argparse.Namespace) -> None:
    """``--isolation`` on a host that cannot confine servers: one error line, exit 2."""
    from mig_spawner.device_cgroup import host_support

    support = host_support()
    if args.isolation and support.mechanism is None:
        raise SystemExit(f"error: --isolation: this host cannot confine servers: "
                         f"{support.why} (mig-spawner doctor)")


#: Stand-in nodes get device numbers of the mem driver that it does not back (it has
#: minors 1-11): a confined server's open of its own node fails with ENXIO, of another
#: slice's with EPERM, and no stand-in is a real device.
STAND_IN_MAJOR, STAND_IN_FIRST_MINOR = 1, 64


def make_stand_ins(args: argparse.Namespace, workdir: Path) -> list[str]:
    """The device nodes the simulated GPUs would have under :func:`stand_in_dir`
    (control nodes, every GPU's own, a GPU with MIG off included, and the GI and CI
    capabilities of every MIG device), made with mknod; returns their paths."""
    import stat

    from mig_spawner.gpu import connect

    from ..core.isolation import device_rules, gpu_rules

    adapter = connect(simulate=args.simulate, state_file=str(workdir / "sim-gpus.json"))
    try:
        inventory = adapter.inventory()
    finally:
        adapter.close()
    dev = stand_in_dir(workdir)
    shutil.rmtree(dev, ignore_errors=True)
    rules = [rule for g in inventory.gpus for rule in gpu_rules(g.minor, str(dev))]
    rules += [rule for g in inventory.gpus for d in g.mig_devices
              for rule in device_rules(g.minor, d.gi_id, d.ci_id, str(dev))]
    paths = sorted({rule.path for rule in rules})
    for i, path in enumerate(paths):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, 0o666 | stat.S_IFCHR,
                 os.makedev(STAND_IN_MAJOR, STAND_IN_FIRST_MINOR + i))
    return paths


def who_sees_what(args: argparse.Namespace, workdir: Path) -> str:
    """A table: each demo user, their groups, and what their spawn form offers now."""
    from mig_spawner.config import MIGPolicyConfig, load_config_files
    from mig_spawner.core.catalog import model
    from mig_spawner.gpu import connect

    from ..spawner import form
    from ..spawner.decide import free_now

    policies = MIGPolicyConfig(config=load_config_files(config_dir() / "20-groups.py")).build()
    state = str(workdir / "sim-gpus.json") if args.simulate else None
    adapter = connect(simulate=args.simulate, state_file=state)
    try:
        inventory = adapter.inventory()
    finally:
        adapter.close()
    models = [model(g.model_key) for g in inventory.gpus if g.model_key]
    free = free_now(inventory, [], Kind.POOL)
    rows = []
    for group, members in DEMO_GROUPS.items():
        mine = policies.for_user([group])
        offers = form.build_choices(mine, models, free, lambda offer, compute: None)
        seen = ", ".join(
            f"{c.key} ({c.free} free)" if c.available else f"{c.key} (none free)" for c in offers
        )
        rows.append(f"  {', '.join(members):<10} {group:<9} {seen}")
    gpus = ", ".join(f"GPU {g.index} {g.product}" for g in inventory.gpus)
    return "\n".join([f"GPUs: {gpus}", "  users      group     sees on the spawn form", *rows])


def shown(path: Path) -> str:
    """``path`` as the shell the demo was started in reaches it: relative to the
    current folder where it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def cli_command() -> str:
    """This package's ``mig-spawner``, as a command that works as typed in the shell the
    demo was started from: by its path, since ``make demo`` puts ``.venv/bin`` on its own
    PATH only, never on the shell's (the checkout's ``.venv/bin/mig-spawner``)."""
    script = Path(sys.executable).parent / "mig-spawner"
    name = shown(script)
    return name if "/" in name else f"./{name}"  # a bare name would be looked up on PATH


def _human(secs: float) -> str:
    return f"{secs / 60:g} min" if secs >= 60 else f"{secs:g} s"


def banner(args: argparse.Namespace, workdir: Path) -> str:
    """What to open, who logs in how, the demo's limits, where the slice map is, and how
    to stop the demo (its PID for SIGTERM)."""
    url = f"http://{args.ip}:{args.port}"
    admins = ", ".join(DEMO_GROUPS["admins"])
    return "\n".join([
        f"Open {url} and log in as any user above with the password {args.password!r} "
        f"({admins}: {args.admin_password!r}).",
        f"Limits (every group, demo only): a kernel idle {_human(args.kernel_idle)} is shut "
        f"down, a server idle {_human(args.server_idle)} is stopped "
        f"({_human(args.server_idle / 2)} while someone waits for its size), after a "
        f"warning {_human(args.warn_before)} before; a spawn waits at most "
        f"{_human(args.max_wait)} for a slice (max_wait); the slice service checks every "
        f"{_human(args.sweep_every)}.",
        f"Slice map (log in as {admins}, group admins): {url}{SLICEMAP_PATH}",
        f"Hub admin page ({admins}): {url}/hub/admin. Named servers are on (up to "
        f"{NAMED_SERVER_LIMIT} a user), so each group's per-user limit can be tried.",
        "The CLI on the demo's GPUs, ledger and policies, from this folder: "
        f"{cli_command()} doctor -f {shown(workdir_config(workdir))} (also status, report, "
        "budget, layout).",
        *([f"Isolation: each server can open only its slice's device nodes "
           f"({stand_in_dir(workdir) if args.simulate else '/dev'}/nvidia-caps/...; "
           "servers run as the hub's user, and a root server could leave its cgroup)."]
          if args.isolation else []),
        f"State and logs: {workdir}.",
        # In the background (``make demo &``, nohup) SIGINT is ignored: Ctrl-C cannot
        # reach the demo there, SIGTERM (run() passes it on to the hub) can.
        "To stop the demo (the hub, the slice service and every server): Ctrl-C, or "
        f"'kill {os.getpid()}' (SIGTERM to the demo's PID) from another shell, "
        "which also works when it runs in the background, where Ctrl-C does not reach it.",
    ])


def run(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in ("config_dir", "sim_state", "ledger_url")
             if getattr(args, name, None)]
    if given:
        raise SystemExit(f"error: demo writes its own config, GPUs and ledger in --dir; it "
                         f"takes no {', '.join(given)}")
    check_isolation(args)
    workdir = Path(args.dir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # Each demo starts from freshly partitioned GPUs (the last run's servers are gone),
    # and may use another --simulate spec than the last run.
    (workdir / "sim-gpus.json").unlink(missing_ok=True)
    config = write_config(args, workdir)
    if args.isolation and args.simulate:
        make_stand_ins(args, workdir)
    print(who_sees_what(args, workdir))
    print(f"\n{banner(args, workdir)}\n", flush=True)
    hub = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyterhub"), "-f", str(config)], cwd=workdir
    )
    # The hub stops with the demo, however the demo is stopped, and with it its proxy,
    # the slice service and the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: hub.send_signal(signum))
    try:
        return hub.wait()
    except KeyboardInterrupt:
        hub.terminate()
        return hub.wait()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``demo`` on the ``mig-spawner`` command line."""
    p = sub.add_parser(
        "demo",
        help="run a JupyterHub that shares MIG slices between demo users (Ctrl-C stops)",
    )
    p.add_argument(
        "--simulate",
        metavar="SPEC",
        nargs="?",
        const=DEMO_SPEC,
        # Nothing unless given here: 'mig-spawner --simulate SPEC demo' is kept.
        default=argparse.SUPPRESS,
        help=f"use simulated GPUs (default spec: {DEMO_SPEC}); without it, the real driver",
    )
    p.add_argument(
        "--isolation",
        action="store_true",
        help="confine each server to its slice's device nodes (needs root and a device "
             "cgroup; with --simulate, on stand-in nodes in the demo's folder)",
    )
    p.add_argument("--ip", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default: %(default)s)")
    p.add_argument("--dir", default=".demo",
                   help="folder for the hub's state and logs (default: %(default)s)")
    p.add_argument("--password", default=DEFAULT_PASSWORD, help="shared demo password")
    p.add_argument("--admin-password", default=DEFAULT_ADMIN_PASSWORD,
                   help="the demo admins' password (32 characters or more)")
    for key, what in (("kernel_idle", "shut down a kernel idle this long"),
                      ("server_idle", "stop a server idle this long (half of it while "
                                      "someone waits for its size)"),
                      ("warn_before", "warn the user this long before a stop (shorter "
                                      "than half of --server-idle)"),
                      ("max_wait", "how long a spawn may wait for a slice"),
                      ("sweep_every", "how often the slice service checks")):
        p.add_argument(f"--{key.replace('_', '-')}", type=seconds, default=DEMO_LIMITS[key],
                       metavar="DURATION",
                       help=f"{what}, in every group (default {DEMO_LIMITS[key]})")
    p.set_defaults(func=run)
