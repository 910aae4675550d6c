"""`lb.daemon.gctune.settle`: start-up's objects leave every later pass, the young generation
collects less often, every pass is timed into the histogram, and cycles made afterwards are
still collected (run in this process, then undone: freeze, threshold, callback). And
`lb.daemon.loopwatch.watch` sees the event loop held."""
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


def test_the_loop_watch_sees_a_stall_of_the_event_loop():
    import asyncio
    import time

    from lb.daemon import loopwatch

    class Seen:
        def __init__(self):
            self.lags = []

        def observe(self, s):
            self.lags.append(s)

    seen = Seen()

    async def main():
        task = asyncio.get_running_loop().create_task(loopwatch.watch(seen, interval_s=0.02))
        await asyncio.sleep(0.1)
        time.sleep(0.2)  # a callback that holds the loop
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert max(seen.lags) >= 0.2 - 0.02  # the timer due during the stall ran that much late
    assert len(seen.lags) >= 5
