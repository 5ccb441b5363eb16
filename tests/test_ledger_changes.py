"""The SQLite change watch of the grant loop, closed while a worker thread reads it.

The loop reads ``PRAGMA data_version`` in a worker thread; when its task is cancelled
(the hub stops, a test ends) the watch is closed from the event loop, possibly while
that read runs. Closing an SQLite connection under a running statement crashed the
whole process (a segmentation fault took a full test run down with it), so the race
runs here in a child process, many times over.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.hub_harness import REPO

RACE = textwrap.dedent("""
    import sys, threading
    from mig_spawner.ledger import Ledger

    ledger = Ledger.open(f"sqlite:///{sys.argv[1]}/ledger.sqlite")
    for _ in range(200):
        watch = ledger.watch_changes()
        reading = threading.Event()
        stop = False

        def read():
            while not stop:
                watch.changed()
                reading.set()

        thread = threading.Thread(target=read)
        thread.start()
        reading.wait()
        watch.close()  # while the thread reads on
        stop = True
        thread.join()
        assert watch.changed() is False  # closed: no change, no error
    print("closed 200 watches under a reader")
""")


def test_closing_the_sqlite_watch_under_a_reading_thread_is_safe(tmp_path):
    child = subprocess.run([sys.executable, "-c", RACE, str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    assert "closed 200 watches" in child.stdout
