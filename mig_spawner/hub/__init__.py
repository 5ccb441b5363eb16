"""Hub adapter: a paged, concurrent, retrying client for the JupyterHub REST API.

``models`` holds the plain data the client returns (no I/O, importable anywhere);
``client`` holds the tornado-based :class:`~mig_spawner.hub.client.HubClient`.
"""
