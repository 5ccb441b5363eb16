# The slice service: culls idle kernels and servers by each group's limits (20-groups.py)
# and repairs leases, so slices return to the pool without anyone acting.
#
# JupyterHub starts it beside the hub as a managed service with its own API token and
# exactly the scopes below. It reads this same directory, so the group limits, the ledger
# and the GPU settings are the spawner's. It stops servers through the hub's REST API
# (never by killing processes); the spawner then gives the slice back (pool mode) or
# destroys the instance (dynamic mode). Guide: docs/culling.md.
#
# It also draws the slice map for admins: every GPU, its MIG slices, who holds each,
# for how long and how long idle (docs/operations.md), at /services/mig-slices/slices.
import sys
from pathlib import Path

c = get_config()  # noqa: F821  (provided by the config loader)

SERVICE = "mig-slices"
# Scopes of our own: JupyterHub's built-in ones cannot say "may see the slice map" or
# "may read the metrics" (both name who holds which slice).
SLICEMAP_SCOPE = "custom:mig-spawner:slicemap"
METRICS_SCOPE = "custom:mig-spawner:metrics"
c.JupyterHub.custom_scopes.update({
    SLICEMAP_SCOPE: {
        "description": "See every MIG slice, who holds it, its age and idle time.",
    },
    METRICS_SCOPE: {
        "description": "Read the slice service's Prometheus metrics (who holds which slice).",
    },
})

c.JupyterHub.services.append(
    {
        "name": SERVICE,
        "command": [
            sys.executable, "-m", "mig_spawner.service",
            f"--config-dir={Path(__file__).resolve().parent}",
        ],
        # Where it serves /health, Prometheus /metrics and the slice map; the hub's
        # proxy also routes /services/mig-slices/ here. /health says only "ok" or not;
        # /metrics needs a token with METRICS_SCOPE (see the end of this file).
        "url": "http://127.0.0.1:10101",
        # Admins open the slice map through the hub's login (OAuth). The service may ask
        # for this scope only, so its cookie can do nothing else in the admin's name,
        # and there is no "authorize this service?" page for what the hub itself runs.
        "oauth_client_allowed_scopes": [SLICEMAP_SCOPE],
        "oauth_no_confirm": True,
    }
)
c.JupyterHub.load_roles.append(
    {
        "name": SERVICE,
        "services": [SERVICE],
        "scopes": [
            "list:users", "read:users:groups",      # who has servers, and their groups
            "read:users:activity", "read:servers",  # last activity, started, pending
            "delete:servers",                       # stop a server
            "access:servers",                       # read and shut down idle kernels
        ],
    }
)

# Who may see the slice map: the members of the JupyterHub group "admins" (created if
# missing; manage its members on /hub/admin). Being a hub admin is not enough:
# JupyterHub's own "admin" role cannot take extra scopes, so put your hub admins
# (c.Authenticator.admin_users in 00-hub.py) in the group, or list them under "users"
# here. Anyone else who opens the map gets a 403 that names the scope.
c.JupyterHub.load_roles.append(
    {
        "name": "mig-slicemap-viewers",
        "description": "Open the MIG slice map of the slice service.",
        "scopes": [SLICEMAP_SCOPE, f"access:services!service={SERVICE}"],
        "groups": ["admins"],
    }
)

# Someone outside those groups is refused by the hub before the service (at its OAuth
# step); with these, the hub's 403 page (mig-spawner's hub templates, added in
# 10-spawner.py) says which scope to ask a hub admin for.
c.JupyterHub.template_vars.update(
    {"mig_slicemap_service": SERVICE, "mig_slicemap_scope": SLICEMAP_SCOPE}
)

# Who may read /metrics: a token with METRICS_SCOPE. For Prometheus, make it a service
# of its own whose token is in a file only Prometheus can read, then scrape with
# "authorization: {credentials_file: /etc/prometheus/mig-metrics.token}"
# (docs/operations.md). Uncomment and fill in:
# c.JupyterHub.services.append({
#     "name": "prometheus",
#     "api_token": open("/srv/jupyterhub/prometheus.token").read().strip(),
# })
# c.JupyterHub.load_roles.append(
#     {"name": "mig-metrics-scrapers", "scopes": [METRICS_SCOPE], "services": ["prometheus"]}
# )

# How often to sweep, and whether to only log what it would do (try dry_run first).
c.SliceServiceApp.cull_every = "1m"
c.SliceServiceApp.dry_run = False
# A lease whose server the hub does not run for this long is released (crash leftovers).
c.SliceServiceApp.orphan_grace = "5m"
# The slice map draws a held slice as idle after this long without activity in its server.
c.SliceServiceApp.slice_idle_after = "15m"
