"""`pdserve.heap.freeze_startup_heap`: what is alive at the call leaves the collector's walk, what
start-up left as garbage is collected first (not frozen for good), and what comes later is
collected as before, its pauses counted (`GC_PAUSES`, what the step log writes). Run in a child
process: a freeze is for the whole process."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, weakref
from pdserve.heap import freeze_startup_heap

class Node:
    pass

kept = [Node()]                              # alive at the freeze: frozen
garbage = Node(); garbage.self = garbage     # a cycle nobody holds: collected by the freeze's gc
dead = weakref.ref(garbage); del garbage
frozen = freeze_startup_heap()
tracked = gc.get_objects()
later = Node(); later.self = later           # made after: the collector walks it and frees it
gone = weakref.ref(later); del later
gc.collect()
from pdserve.heap import GC_PAUSES
print(frozen, gc.get_freeze_count(), any(o is kept for o in tracked), dead() is None, gone() is None,
      GC_PAUSES.count[2], GC_PAUSES.seconds[2] > 0)
"""


def test_freeze_moves_the_live_heap_out_of_the_walk_and_collects_start_up_garbage() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    frozen, count, kept_tracked, start_up_garbage_freed, later_garbage_freed, full, timed = out.split()
    assert int(frozen) == int(count) > 1000  # the interpreter's and pdserve's own objects
    assert kept_tracked == "False"  # frozen: no longer among the collector's objects
    assert start_up_garbage_freed == "True"
    assert later_garbage_freed == "True"
    assert (full, timed) == ("1", "True")  # the pauses after the freeze are counted: the one collect
