"""``python -m mig_spawner.service``: the same as ``mig-spawner-service``."""

from mig_spawner.service.app import main

if __name__ == "__main__":
    main()
