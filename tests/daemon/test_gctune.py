"""`lb.daemon.gctune.settle`: start-up's objects leave every later pass, the young generation
collects less often, every pass is timed into the histogram, and cycles made afterwards are
still collected. Run in this process, then undone (freeze, threshold, callback)."""
import gc

from prometheus_client import CollectorRegistry, Histogram

from lb.daemon import gctune


class Node:
    def __init__(self):
        self.other = None


def test_settle_freezes_startup_raises_the_young_threshold_and_times_each_pass():
    before_threshold = gc.get_threshold()
    before_callbacks = list(gc.callbacks)
    from_startup = Node()  # a tracked object that exists before settle
    pauses = Histogram("lb_gc_pause_seconds", "", ["generation"], registry=CollectorRegistry())
    try:
        gctune.settle(pauses)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == gctune.GEN0_THRESHOLD
        assert not any(o is from_startup for o in gc.get_objects())  # frozen: no pass walks it

        a, b = Node(), Node()  # a cycle made after settle, then dropped
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # still found and freed

        counts = {s.labels["generation"]: s.value for m in pauses.collect() for s in m.samples
                  if s.name.endswith("_count")}
        assert counts["2"] >= 1  # the collect above was timed
        gc.collect(0)
        counts_after = {s.labels["generation"]: s.value for m in pauses.collect() for s in m.samples
                        if s.name.endswith("_count")}
        assert counts_after["0"] == counts.get("0", 0) + 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before_threshold)
        gc.callbacks[:] = before_callbacks
