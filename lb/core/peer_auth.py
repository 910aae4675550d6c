"""Peer request signatures: what is signed, and which signed calls are refused.

A peer call carries its region, a wall-clock timestamp, a random nonce and an HMAC-SHA256
under the shared secret over: region, timestamp, nonce, method, path, the SHA-256 of the
body, and the identity headers it carries (user, session, app, interaction, tier, residency,
hop count), so a captured call can be neither re-bodied nor re-labelled. A call is refused
when its timestamp is not a finite number within `max_skew_s` of our clock, when its
signature does not match, or when its nonce was already seen inside that window (a replay).
Nonces are remembered only for the window, and at most `max_nonces` at once.
Pure: the caller passes the clock in.
"""
from __future__ import annotations

import hashlib
import hmac
import math
from collections import OrderedDict

STREAMED = "streamed"  # the body hash of an upload streamed on as it arrives (not known up front)


def body_hash(body: bytes | None) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def signature(secret: str, *, region: str, ts: str, nonce: str, method: str, path: str, body_sha256: str,
              identity: dict[str, str]) -> str:
    ident = "\n".join(f"{k.lower()}:{identity[k]}" for k in sorted(identity, key=str.lower))
    msg = "\n".join((region, ts, nonce, method.upper(), path, body_sha256, ident)).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class PeerAuthError(ValueError):
    pass


def check_timestamp(ts: str, now: float, max_skew_s: float) -> float:
    """The timestamp as a number, or PeerAuthError (not a number, not finite, too far off)."""
    try:
        t = float(ts)
    except ValueError:
        raise PeerAuthError("timestamp is not a number") from None
    if not math.isfinite(t):
        raise PeerAuthError("timestamp is not finite")
    if abs(now - t) > max_skew_s:
        raise PeerAuthError(f"signed {abs(now - t):.0f}s away from our clock")
    return t


class Nonces:
    """Nonces of accepted calls, each kept until its timestamp leaves the skew window."""

    def __init__(self, max_skew_s: float, max_nonces: int):
        self.max_skew_s, self.max_nonces = max_skew_s, max_nonces
        self._until: OrderedDict[str, float] = OrderedDict()  # nonce -> forget after (about time order)

    def __len__(self) -> int:
        return len(self._until)

    def use(self, nonce: str, ts: float, now: float) -> None:
        """Record `nonce` (of a call signed at `ts`), or PeerAuthError if it is a replay or the
        window already holds `max_nonces` (refusing beats forgetting one that could be replayed)."""
        while self._until and next(iter(self._until.values())) < now:
            self._until.popitem(last=False)
        if not nonce or len(nonce) > 64:
            raise PeerAuthError("nonce missing or longer than 64 characters")
        if nonce in self._until:
            raise PeerAuthError("nonce already used (a replayed call)")
        if len(self._until) >= self.max_nonces:
            raise PeerAuthError(f"more than {self.max_nonces} peer calls inside the skew window; try again shortly")
        self._until[nonce] = ts + self.max_skew_s
