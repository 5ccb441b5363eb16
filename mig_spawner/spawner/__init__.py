"""JupyterHub spawners that give each notebook server one NVIDIA MIG slice.

``c.JupyterHub.spawner_class = "mig"`` selects :class:`LocalMIGSpawner`; the mixin
(:class:`MIGSpawnerMixin`) carries everything MIG-specific for other spawners.
"""

from .local import LocalMIGSpawner, SimpleLocalMIGSpawner
from .mixin import MIGSpawnerMixin

__all__ = ["LocalMIGSpawner", "MIGSpawnerMixin", "SimpleLocalMIGSpawner"]
