# The slice service: culls idle kernels and servers by each group's limits (20-groups.py)
# and repairs leases, so slices return to the pool without anyone acting.
#
# JupyterHub starts it beside the hub as a managed service with its own API token and
# exactly the scopes below. It reads this same directory, so the group limits, the ledger
# and the GPU settings are the spawner's. It stops servers through the hub's REST API
# (never by killing processes); the spawner then gives the slice back (pool mode) or
# destroys the instance (dynamic mode). Guide: docs/culling.md.
import sys
from pathlib import Path

c = get_config()  # noqa: F821  (provided by the config loader)

c.JupyterHub.services.append(
    {
        "name": "mig-slices",
        "command": [
            sys.executable, "-m", "mig_spawner.service",
            f"--config-dir={Path(__file__).resolve().parent}",
        ],
        # Where it serves /health and Prometheus /metrics. /metrics has no login: keep
        # it on 127.0.0.1 and let Prometheus scrape it there.
        "url": "http://127.0.0.1:10101",
    }
)
c.JupyterHub.load_roles.append(
    {
        "name": "mig-slices",
        "services": ["mig-slices"],
        "scopes": [
            "list:users", "read:users:groups",      # who has servers, and their groups
            "read:users:activity", "read:servers",  # last activity, started, pending
            "delete:servers",                       # stop a server
            "access:servers",                       # read and shut down idle kernels
        ],
    }
)

# How often to sweep, and whether to only log what it would do (try dry_run first).
c.SliceServiceApp.cull_every = "1m"
c.SliceServiceApp.dry_run = False
# A lease whose server the hub does not run for this long is released (crash leftovers).
c.SliceServiceApp.orphan_grace = "5m"
