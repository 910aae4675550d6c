"""lb.core.hung: a request is hung only on evidence (probes idle for the whole stretch)."""
from lb.core.hung import idle_since, is_hung


def fold(samples):
    idle = None
    for at, busy in samples:
        idle = idle_since(idle, busy, at)
    return idle


def test_idle_stretch_starts_at_the_first_idle_probe_and_resets_on_work():
    assert fold([(1, True), (2, False), (3, False)]) == 2
    assert fold([(1, False), (2, True)]) is None
    assert fold([(1, False), (2, None), (3, False)]) == 3  # cannot tell: no stretch


def test_hung_needs_the_whole_stretch_after_the_last_sign_of_life():
    assert not is_hung(last_sign_at=10, idle_from=None, last_probe_at=100, after_s=5)  # busy
    assert is_hung(last_sign_at=10, idle_from=5, last_probe_at=15, after_s=5)
    assert not is_hung(last_sign_at=10, idle_from=5, last_probe_at=14.9, after_s=5)
    assert not is_hung(last_sign_at=10, idle_from=12, last_probe_at=16, after_s=5)  # idle only since 12
    assert is_hung(last_sign_at=10, idle_from=12, last_probe_at=17, after_s=5)
    assert not is_hung(last_sign_at=20, idle_from=5, last_probe_at=24, after_s=5)  # a byte came at 20
    assert not is_hung(last_sign_at=0, idle_from=0, last_probe_at=1e9, after_s=0)  # off
