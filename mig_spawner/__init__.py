"""mig-spawner: share NVIDIA MIG-capable GPUs between JupyterHub users, one slice per server."""

__version__ = "0.1.0"
