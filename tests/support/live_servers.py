"""The live servers of a test hub, read from /proc: which MIG device each names in its
environment (the device is the truth), and the checks that no slice is in two servers
and no lease is lost (the crash tests', the GPU fault test's)."""

from __future__ import annotations

from pathlib import Path

from mig_spawner.ledger import Ledger


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment of a live process; None for one gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state in ("Z", "X"):
        return None
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def servers_of(tag: str) -> dict[int, dict[str, str]]:
    """PID -> environment of every live process a server of the hub ``tag`` runs."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = environ_of(int(entry.name))
        if env and "MIG_SPAWNER_LEASE_ID" in env and env.get("MIG_TEST_HUB") == tag:
            found[int(entry.name)] = env
    return found


def assert_one_server_per_slice(tag: str) -> dict[str, str]:
    """No MIG UUID in two live servers' environments (two leases: a server and its
    kernels share one; two runs of one user's server do not); returns UUID -> user."""
    holders: dict[str, set[tuple[str, str]]] = {}
    for env in servers_of(tag).values():
        server = (env["MIG_SPAWNER_LEASE_ID"], env["JUPYTERHUB_USER"])
        holders.setdefault(env["CUDA_VISIBLE_DEVICES"], set()).add(server)
    doubles = {uuid: servers for uuid, servers in holders.items() if len(servers) > 1}
    assert not doubles, f"MIG devices in two live servers: {doubles}"
    return {uuid: next(iter(servers))[1] for uuid, servers in holders.items()}


def assert_no_lease_lost(ledger: Ledger, tag: str) -> None:
    """Every live server (or kernel) holds the lease its environment names, on the
    device it uses; every held lease has a live process naming it, or is releasing."""
    held = {lease.id: lease for lease in ledger.leases.active()}
    named = set()
    for pid, env in servers_of(tag).items():
        lease = held.get(env["MIG_SPAWNER_LEASE_ID"])
        assert lease is not None, f"PID {pid} of {env['JUPYTERHUB_USER']} holds no lease"
        assert lease.mig_uuid == env["CUDA_VISIBLE_DEVICES"], (pid, lease)
        named.add(lease.id)
    lost = [lease for lease in held.values()
            if lease.id not in named and lease.state != "releasing"]
    assert not lost, f"held leases with no live holder: {lost}"
