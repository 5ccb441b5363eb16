"""The ``mig-spawner`` command line: status, doctor, demo, report."""
