# JupyterHub config for mig-spawner: this file only loads jupyterhub_config.d/*.py.
#
# Each concern lives in its own small snippet (hub, spawner, groups, slice service), loaded
# in sorted file-name order, so a later file can override an earlier one. This is the same
# convention as The Littlest JupyterHub and the zero-to-jupyterhub images: to change a
# setting, edit or add a snippet (e.g. 99-local.py) instead of this file.
#
# Run:  jupyterhub -f /path/to/jupyterhub_config.py
from pathlib import Path

c = get_config()  # noqa: F821  (provided by JupyterHub's config loader)

_snippets = Path(__file__).resolve().parent / "jupyterhub_config.d"
for _path in sorted(_snippets.glob("*.py")):
    load_subconfig(str(_path))  # noqa: F821

# Refuse to start with a wrong GPU policy (a misspelt key, a profile these GPUs lack),
# naming each group and key, instead of failing spawns later.
from mig_spawner.spawner.startup import check_hub_config  # noqa: E402

check_hub_config(c)
