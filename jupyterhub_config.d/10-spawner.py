# The MIG spawner: one MIG slice per notebook server.
#
# Each server the hub starts gets exactly one MIG slice chosen on the spawn form among
# those the user's groups allow (20-groups.py). The slice is leased in a ledger before the
# server starts, given back when it stops, crashes or fails to start, and the server sees
# only its slice through CUDA_VISIBLE_DEVICES=MIG-<uuid>. Guide: docs/admin-install.md.

c = get_config()  # noqa: F821  (provided by the config loader)

# "mig" = mig_spawner.spawner.local:LocalMIGSpawner (servers run as each user's Unix
# account, like JupyterHub's default spawner).
c.JupyterHub.spawner_class = "mig"

# pool:    lease the MIG instances you created beforehand (nvidia-smi mig -cgi ... -C, or
#          NVIDIA mig-parted). The hub needs no GPU privilege. Recommended to start with.
# dynamic: create a GPU+compute instance at each spawn, at the placement that keeps the
#          GPU least fragmented, and destroy it when the server ends. The hub needs root
#          or read access to /dev/nvidia-caps/nvidia-cap1 (the MIG config capability).
c.LocalMIGSpawner.mig_mode = "pool"

# Which GPU gets the next server: "pack" fills the busiest GPU first, so whole GPUs stay
# free for big slices; "spread" uses the least busy GPU first.
c.LocalMIGSpawner.strategy = "pack"

# Where leases are kept, for the hub, the slice service (30-slice-service.py) and the
# mig-spawner command alike: set it here, as c.MIGSettings, and nowhere else (the hub
# refuses to start when a spawner or service class sets its own). Empty = a SQLite file
# beside the hub database; for PostgreSQL see docs/ledger.md.
c.MIGSettings.ledger_url = ""

# CUDA_VISIBLE_DEVICES only asks CUDA to use the slice; a user can change it. The kernel
# enforces it: with the real driver, each server (and all it starts) can open only its
# own slice's device nodes, through a cgroup v1 devices group or, on cgroup v2, a systemd
# scope. Needs the hub to run as root; protects servers that do not run as root.
# Unset (the default): on wherever this host can (`mig-spawner doctor` says how, or why
# not), off with simulated GPUs. True: on, or every spawn fails. False: off.
# c.LocalMIGSpawner.isolation = True

# A class pressing Start at once: each starting server gets as much CPU as the whole hub,
# whose pages and API then answer in seconds. 10 starts the servers (and their session's
# scheduling group) behind the hub; they lose nothing while the CPU is not short.
# 0 (default): the hub's own priority. docs/admin-install.md, "A class starts at once".
# c.LocalMIGSpawner.nice = 10

# No GPU on this machine? Try everything with the NVML simulator instead (shared, like
# the ledger, by the hub, the slice service and the mig-spawner command):
# c.MIGSettings.simulate = "h200x2:layout=1g.18gb*4,2g.35gb,1g.35gb"
# c.MIGSettings.sim_state_file = "/srv/jupyterhub/sim-gpus.json"

# The warning before the slice service stops a server ("Keep my server"): on the hub's
# home page (a template extending home.html, and two hub API endpoints) and inside
# JupyterLab (a server extension the spawner enables in each server). Per-group timing:
# warn_before / extend_by / max_extensions in 20-groups.py; see docs/culling.md.
from mig_spawner.spawner.warnings import configure_hub  # noqa: E402

configure_hub(c)
