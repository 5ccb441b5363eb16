"""Pure core: catalog, policy and allocator. No I/O and no JupyterHub import here."""
