"""See the slices: who holds which MIG slice now, as rows, metrics and an admin map.

* :mod:`.slice_state`: the pure join of a GPU inventory, the ledger's held leases and
  the group policy into one row per slice (free, leased, idle or orphan);
* :mod:`.source`: builds that map from the GPU adapter and the ledger, cached briefly;
* :mod:`.gpu_metrics`: a Prometheus collector that exports those rows;
* :mod:`.slicemap`: tornado handlers for the admin slice map (HTML, table, JSON),
  behind JupyterHub OAuth and a custom scope.

Nothing here changes a GPU or a lease: it only reads.
"""
