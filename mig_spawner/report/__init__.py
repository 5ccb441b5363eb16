"""``mig-spawner report``: usage per profile and group, and layout advice from a replay.

* :mod:`.demand`: requests, refusals, hold time, idle share, peak concurrency;
* :mod:`.replay`: the history played through the allocator on a given layout;
* :mod:`.advise`: the layout that would have refused fewest, as a mig-parted config;
* :mod:`.render`: the table, JSON and PNG plots.
"""
