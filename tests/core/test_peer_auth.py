"""lb.core.peer_auth: timestamps, nonces (bounded, forgotten after the window), what is signed."""
import pytest

from lb.core.peer_auth import Nonces, PeerAuthError, body_hash, check_timestamp, signature


def test_timestamps_must_be_finite_and_near():
    assert check_timestamp("100.5", 110.0, 30.0) == 100.5
    for ts in ("nan", "inf", "-inf", "1e999", "x", ""):
        with pytest.raises(PeerAuthError):
            check_timestamp(ts, 100.0, 30.0)
    with pytest.raises(PeerAuthError):
        check_timestamp("50", 100.0, 30.0)


def test_a_nonce_is_accepted_once_inside_the_window_and_memory_is_bounded():
    n = Nonces(max_skew_s=30.0, max_nonces=3)
    n.use("a", ts=100.0, now=100.0)
    with pytest.raises(PeerAuthError, match="already used"):
        n.use("a", ts=100.0, now=110.0)
    n.use("b", ts=100.0, now=100.0)
    n.use("c", ts=100.0, now=100.0)
    with pytest.raises(PeerAuthError, match="more than 3"):
        n.use("d", ts=100.0, now=101.0)  # full: refused rather than forgetting a live one
    n.use("d", ts=140.0, now=140.0)  # a, b, c left the window (100 + 30 < 140)
    assert len(n) == 1


def test_the_signature_covers_body_and_identity():
    base = dict(region="us", ts="1", nonce="n", method="POST", path="/v1/chat/completions",
                body_sha256=body_hash(b"{}"), identity={"x-lb-user": "alice"})
    sig = signature("s", **base)
    assert signature("s", **{**base, "body_sha256": body_hash(b"{ }")}) != sig
    assert signature("s", **{**base, "identity": {"x-lb-user": "bob"}}) != sig
    assert signature("s", **{**base, "nonce": "m"}) != sig
    assert signature("s", **{**base, "identity": {"X-LB-User": "alice"}}) == sig  # header names: any case
