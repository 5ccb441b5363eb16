"""A real Kubernetes control plane for the tests, built from upstream (scripts/kube-build.sh).

etcd (its data on tmpfs), kube-apiserver (RBAC, service-account token signing, the
feature gates the version needs for partitionable devices), kube-scheduler,
kube-controller-manager and KWOK for fake nodes; and, in the supervising process
itself, the cluster's GPU side (tests/support/kube_agents.py): a device plugin and
NVIDIA's DRA driver publishing each test GPU node's MIG devices, a MIG Manager acting
on ``nvidia.com/mig.config``, and the one node whose "kubelet" really runs the pods
bound to it as local processes.

One cluster per test run, shared by the pytest-xdist workers: the first worker to need
it starts a supervisor (``python -m tests.support.kube_cluster serve DIR``, detached)
under a file lock, every worker registers its pid, and the supervisor stops everything
once no registered worker is alive, so that an interrupted run (Ctrl-C, kill -9 of a
worker or of pytest) leaves no process behind (the test reaper, which ends what the
run marked, would too). Every process it starts dies with it
(``PR_SET_PDEATHSIG``). Tests isolate themselves by namespace and by node labels
(tests/support/kube_fixture.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "kube-build.sh"
#: The annotation that hands a node to KWOK (every fake GPU node but the process one).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
#: The node whose pods really run, as processes on loopback addresses.
PROCESS_NODE = "proc-node"
ADMIN = "admin"
#: How long the supervisor waits for the control plane to come up.
START_TIMEOUT = 180


@dataclass(frozen=True)
class ClusterInfo:
    """What a test needs to reach the cluster (cluster.json in the run's folder)."""

    server: str
    ca: str
    admin_token: str
    version: str
    etcd: str
    folder: str
    started_in: float

    def credentials(self, token: str | None = None):  # -> kube_rest.Credentials
        from tests.support.kube_rest import Credentials

        return Credentials(self.server, token or self.admin_token, self.ca)

    def kubeconfig(self, path: Path, token: str | None = None, namespace: str = "default",
                   server: str | None = None) -> str:
        """A kubeconfig file for ``token`` (the admin's by default) at ``server`` (the
        API server; a tap proxy's URL may stand in)."""
        url = server or self.server
        cluster = {"server": url}
        if url.startswith("https:"):
            cluster["certificate-authority"] = self.ca
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "user", "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user",
                                                      "namespace": namespace}}],
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return str(path)


# --- building and finding the binaries -------------------------------------------------


def binaries() -> Path:
    """The folder of the built programs; builds them first when they are missing
    (scripts/kube-build.sh, niced, with its progress on stderr)."""
    out = subprocess.run(["bash", str(BUILD), "--print-bin"], check=True, stdout=subprocess.PIPE,
                         text=True)
    return Path(out.stdout.strip().splitlines()[-1])


# --- certificates ----------------------------------------------------------------------


def _certificates(folder: Path) -> None:
    """A CA, the API server's serving certificate for 127.0.0.1, and the service
    accounts' signing key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.TraditionalOpenSSL,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mig-spawner-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                       "kubernetes.default.svc")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.0.0.1")]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "apiserver.crt": cert.public_bytes(serialization.Encoding.PEM),
        "apiserver.key": pem_key(key),
        "sa.key": pem_key(sa),
        "sa.pub": sa.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)


# --- the processes ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For ``preexec_fn``: the child gets SIGKILL when the process that started it dies."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def feature_gates(version: str) -> str:
    """The gates each version needs: partitionable devices (dynamic MIG's counters) are
    beta, on by default, from 1.36; alpha before."""
    minor = int(version.lstrip("v").split(".")[1])
    return "" if minor >= 36 else "DRAPartitionableDevices=true"


class Plane:
    """The control plane's processes, started in order and stopped in reverse."""

    def __init__(self, folder: Path, bin_dir: Path) -> None:
        self.folder = folder
        self.bin = bin_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.version = (bin_dir.parent.name if bin_dir.parent.name.startswith("v")
                        else "v1.36.0")

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.folder / f"{name}.log").open("ab")
        proc = subprocess.Popen([str(self.bin / argv[0]), *argv[1:]], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent, cwd=self.folder)
        log.close()
        self.procs.append((name, proc))
        return proc

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def start(self, data: Path) -> ClusterInfo:
        started = time.monotonic()
        f = self.folder
        _certificates(f)
        token = os.urandom(16).hex()
        (f / "tokens.csv").write_text(f'{token},{ADMIN},{ADMIN}-uid,"system:masters"\n')
        client, peer = _free_port(), _free_port()
        etcd = f"http://127.0.0.1:{client}"
        self.spawn("etcd", [
            "etcd", "--name=test", f"--data-dir={data / 'etcd'}",
            f"--listen-client-urls={etcd}", f"--advertise-client-urls={etcd}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
        ])
        port = _free_port()
        server = f"https://127.0.0.1:{port}"
        gates = feature_gates(self.version)
        self.spawn("kube-apiserver", [
            "kube-apiserver", f"--etcd-servers={etcd}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={f / 'apiserver.crt'}",
            f"--tls-private-key-file={f / 'apiserver.key'}",
            f"--client-ca-file={f / 'ca.crt'}", f"--cert-dir={f / 'certs'}",
            f"--token-auth-file={f / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={f / 'sa.pub'}",
            f"--service-account-signing-key-file={f / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24", "--profiling=false",
            "--endpoint-reconciler-type=none", "--v=1",
            *([f"--feature-gates={gates}"] if gates else []),
        ])
        info = ClusterInfo(server=server, ca=str(f / "ca.crt"), admin_token=token,
                           version=self.version, etcd=etcd, folder=str(f), started_in=0.0)
        kubeconfig = info.kubeconfig(f / "admin.kubeconfig")
        self._wait_ready(info)
        common = [f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--secure-port=0"]
        self.spawn("kube-scheduler", ["kube-scheduler", *common, "--v=1",
                                      *([f"--feature-gates={gates}"] if gates else [])])
        self.spawn("kube-controller-manager", [
            "kube-controller-manager", *common, "--v=1",
            f"--service-account-private-key-file={f / 'sa.key'}",
            f"--root-ca-file={f / 'ca.crt'}", "--use-service-account-credentials=false",
            # No cloud, no node networking; nodes' health comes from their leases
            # (KWOK's, and the process node's agent).
            "--controllers=*,-service-lb-controller,-node-route-controller,"
            "-cloud-node-lifecycle-controller,-node-ipam-controller",
            "--concurrent-gc-syncs=5", "--concurrent-namespace-syncs=5",
            *([f"--feature-gates={gates}"] if gates else []),
        ])
        self.spawn("kwok", [
            "kwok", f"--kubeconfig={kubeconfig}", "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            "--cidr=10.244.0.0/16", "--node-ip=10.240.0.1", "--node-port=0",
            "--server-address=", f"--config={REPO / 'tests' / 'support' / 'kwok-stages.yaml'}",
        ])
        time.sleep(0.2)
        self.check()
        return ClusterInfo(**{**asdict(info), "started_in": time.monotonic() - started})

    def _wait_ready(self, info: ClusterInfo) -> None:
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=info.ca)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            self.check()
            try:
                request = urllib.request.Request(
                    info.server + "/readyz",
                    headers={"Authorization": f"Bearer {info.admin_token}"})
                with urllib.request.urlopen(request, context=context, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready in {START_TIMEOUT} s")
            time.sleep(0.2)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# --- the supervisor --------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone for our purpose.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def serve(folder: Path) -> None:
    """Run the cluster until no registered user of it is alive (or SIGTERM/SIGINT)."""
    from tests.support import kube_agents

    (folder / "supervisor.pid").write_text(str(os.getpid()))
    users = folder / "users"
    data = Path(tempfile.mkdtemp(prefix="mig-kube-etcd-", dir="/dev/shm"
                                 if Path("/dev/shm").is_dir() else None))
    plane = Plane(folder, binaries())
    stopping = asyncio.Event()

    def stop(*_: object) -> None:
        stopping.set()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, stop)
        try:
            info = await asyncio.to_thread(plane.start, data)
            agents = kube_agents.Agents(info, folder)
            started = time.monotonic()
            await agents.start()
            info = ClusterInfo(**{**asdict(info),
                                  "started_in": info.started_in + time.monotonic() - started})
            tmp = folder / "cluster.json.tmp"
            tmp.write_text(json.dumps(asdict(info)))
            tmp.rename(folder / "cluster.json")
            seen = False
            while not stopping.is_set():
                plane.check()
                agents.check()
                pids = [int(p.name) for p in users.iterdir()] if users.is_dir() else []
                live = [p for p in pids if _alive(p)]
                for p in set(pids) - set(live):
                    (users / str(p)).unlink(missing_ok=True)
                seen = seen or bool(pids)
                if seen and not live:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 0.5)
            await agents.stop()
        except Exception as e:
            (folder / "failed").write_text(f"{type(e).__name__}: {e}")
            raise
        finally:
            await asyncio.to_thread(plane.stop)

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(data, ignore_errors=True)
        (folder / "stopped").write_text("")


# --- the client side: acquire and release -------------------------------------------------


def run_folder(run_id: str) -> Path:
    base = Path(os.environ.get("MIG_SPAWNER_KUBE_RUNS", tempfile.gettempdir()))
    folder = base / f"mig-spawner-kube-{os.getuid()}-{run_id}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with (folder / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def acquire(run_id: str, timeout: float = 900) -> ClusterInfo:
    """The run's cluster, started by the first caller; this process is registered as a
    user until :func:`release` (or its death)."""
    folder = run_folder(run_id)
    with _locked(folder):
        (folder / "users").mkdir(exist_ok=True)
        (folder / "users" / str(os.getpid())).write_text("")
        pid_file = folder / "supervisor.pid"
        running = pid_file.exists() and _alive(int(pid_file.read_text() or 0)) and not (
            folder / "stopped").exists()
        if not running:
            for stale in ("cluster.json", "failed", "stopped", "supervisor.pid"):
                (folder / stale).unlink(missing_ok=True)
            # Detached (setsid -f: a session of its own, no parent but init): no worker
            # that ends before the others takes it down with its descendants (the test
            # reaper); it ends when its last user has gone.
            with (folder / "supervisor.log").open("ab") as log:
                subprocess.run(["setsid", "-f", sys.executable, "-m",
                                "tests.support.kube_cluster", "serve", str(folder)],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, check=True)
        deadline = time.monotonic() + timeout
        while not (folder / "cluster.json").exists():
            if (folder / "failed").exists() or (folder / "stopped").exists():
                log = (folder / "supervisor.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the test cluster did not start:\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster did not start in {timeout} s")
            time.sleep(0.2)
        return ClusterInfo(**json.loads((folder / "cluster.json").read_text()))


def release(run_id: str) -> None:
    """This process no longer uses the run's cluster (the last user's release stops it)."""
    folder = run_folder(run_id)
    (folder / "users" / str(os.getpid())).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kube_cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve").add_argument("folder", type=Path)
    up = sub.add_parser("up", help="start a cluster and keep it until Ctrl-C (for poking)")
    up.add_argument("--run", default=f"manual{os.getpid()}")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.folder)
        return
    info = acquire(args.run)
    print(json.dumps(asdict(info), indent=2), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()
    release(args.run)


if __name__ == "__main__":
    main()
