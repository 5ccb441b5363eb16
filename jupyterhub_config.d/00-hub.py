# The hub itself: where it listens, where it keeps its database, who may log in.
#
# The values below are for one GPU host with local Unix users. Keep the hub database on
# a local disk: mig-spawner's lease ledger defaults to a SQLite file beside it
# (mig_spawner_ledger.sqlite), so both are backed up together.

c = get_config()  # noqa: F821  (provided by the config loader)

# Public address. Put a TLS-terminating reverse proxy (nginx, Caddy) in front, or set
# c.JupyterHub.ssl_cert / ssl_key here.
c.JupyterHub.bind_url = "http://127.0.0.1:8000"

# The hub's own state: users, groups, servers, tokens. A SQLite file is fine for one
# host; use PostgreSQL (postgresql://...) when the hub has hundreds of users.
c.JupyterHub.db_url = "sqlite:////srv/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"

# Who may log in: local Unix accounts (PAM) in these Unix groups. The *JupyterHub* groups
# of the same names drive the GPU policy (20-groups.py); manage their members on the
# hub's admin page (/hub/admin) or through the REST API.
c.JupyterHub.authenticator_class = "pam"
c.LocalAuthenticator.allowed_groups = {"analysts", "ml-team", "research", "admins"}
c.Authenticator.admin_users = {"root"}

# A server that does not come up in time gives its slice back (see 10-spawner.py), so
# keep these generous enough for a cold start on a busy host, but not unbounded.
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 60

# Many analysts clicking "Start" at 9:00: queue spawns instead of starting all at once.
c.JupyterHub.concurrent_spawn_limit = 20

# Leave servers running when the hub restarts (upgrades, config changes): their leases
# stay held, and a server that died meanwhile frees its slice when the hub comes back.
c.JupyterHub.cleanup_servers = False
