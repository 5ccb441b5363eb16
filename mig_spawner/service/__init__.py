"""The slice service: a JupyterHub service that culls idle kernels and servers per group
policy, releases orphan leases, and exports metrics (``mig-spawner-service``)."""
