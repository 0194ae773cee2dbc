"""Python's cyclic garbage collector, set for a long-running process of many small objects.

CPython collects its youngest generation after every 700 net allocations of container
objects, and each collection walks every object of that generation. prismd allocates a
few hundred per message (records, dicts, tasks, events), almost all freed by reference
counting at once; with the default threshold the collector ran some 140 times a second
in the pipeline bench, and its older generations, which hold every route and binding,
took 2-27 ms a pass (4% of the instructions of a message under callgrind).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Net container allocations between two collections of the youngest generation (default
700). Garbage in cycles waits at most this many allocations longer: a few MB at most."""


def tune_collector() -> None:
    """Freeze what is alive now (modules, classes, the configuration: never garbage,
    never walked again) and collect the youngest generation every
    :data:`YOUNG_THRESHOLD` net allocations. Called by ``prismd run``, ``prismd bench``
    and ``prismd soak`` right before their Trio run; the older generations keep their
    ratios (10 and 10 by default)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
