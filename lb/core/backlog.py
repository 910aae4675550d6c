"""Prefill work ahead on each replica, and the time to first token it predicts.

The scheduler's peer step (`lb.core.scheduler`) forwards a request to a peer region when the
TTFT predicted there plus the round trip beats the local prediction by a margin, and
`/lb/peer/status` advertises this model's inputs so that peers can predict for us
(docs/peering.md, "Forwarding by predicted TTFT").

A request pushed to a replica produces its first token once the replica has prefilled it and
the requests it took earlier that have not produced a token yet: engines prefill in admission
order (chunked prefill works through the running requests' prompts in order; a waiting
request is admitted behind the ones before it). The LB knows both for its own pushes — the
uncached prompt tokens of each, and when each first token came back — so

    TTFT(r, u) ≈ base + per_token × (ahead(r) + u)

where `ahead(r)` is the tokens of `r`'s pushes still without a first token and `u` the new
request's uncached tokens. `base` and `per_token` are fitted online (exponentially weighted
least squares over every replica's (ahead at push + u, observed TTFT) pairs): the hardware's
prefill speed, the decode share of each step and the step overhead, learned from what the
fleet does rather than read from a profile. The fit's out-of-sample error (`error_s`, each
sample predicted before it is learned) says how far one prediction can be trusted.

Pure: times are passed in. Bounded: at most `max_tracked` pushes are tracked (the oldest
is dropped), so a caller that misses an end cannot grow it.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

# EW weight of one sample: the fit follows about the last 50 first tokens, so it tracks a
# batch that grows or shrinks over minutes while one odd request moves it by 2 %.
ALPHA = 0.02
# No prediction before this many samples: a two-point line is noise, and a wrong early
# prediction would move requests across regions. Until then the peer step is SkyWalker's
# Algorithm 1 alone (forward only what nothing local can take).
MIN_SAMPLES = 20
MAX_TRACKED = 65_536
# First tokens this LB knows of that an engine's count may not have reached yet (`engine_first_tokens`)
MAX_UNEXPLAINED = 256
# The other instances' pushes remembered per target until its count or their end passes them
# (`remote_placed`): as many as `lb.core.instances` remembers for its headroom
MAX_REMOTE = 1024


@dataclass(slots=True)
class _Push:
    target: str
    tokens: float  # its own uncached prompt tokens
    x: float  # ahead of it at push, plus its own: the work before its first token
    at: float
    whole: bool = False  # its answer comes back whole: no first token of it reaches the LB
    samples: int = 1  # its parallel samples: each a request in the engine's counts


class Backlog:
    def __init__(self, alpha: float = ALPHA, min_samples: int = MIN_SAMPLES, max_tracked: int = MAX_TRACKED):
        self.alpha, self.min_samples, self.max_tracked = alpha, min_samples, max_tracked
        self.ahead: dict[str, float] = {}  # target → uncached tokens pushed and not yet answered
        self.ahead_count: dict[str, int] = {}  # target → how many pushes those are
        self._open: OrderedDict[str, _Push] = OrderedDict()  # request id → its push
        # request id → (target, samples) of the pushes whose first token came back and that have
        # not ended, and their samples per target: the engine holds them or has finished them,
        # so none of them is still on its way there (lb.core.pushing.settle_probe)
        self._answering: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.answering: dict[str, int] = {}
        # (assumed end of prefill, tiebreak, request id, its push): a heap, for pushes not streamed
        self._expiring: list[tuple[float, int, str, _Push]] = []
        self._seq = itertools.count()
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # EW sums of the fit
        self.samples = 0
        self._error: float | None = None  # EW mean |observed − predicted| TTFT, s
        self._fit: tuple[int, tuple[float, float] | None] = (-1, None)  # (samples it was fitted at, fit)
        # Engines that count their first tokens (`engine_first_tokens`): per target, its pushes
        # answered whole still ahead; the engine's count at its last report; the first tokens
        # this LB learnt of there since (streamed ones relayed, answers that came back whole
        # before the count passed them); and the first tokens it counted that none of those
        # explains yet (below 0: known ones its count had not reached)
        self._whole: dict[str, OrderedDict[str, _Push]] = {}
        self.counted: dict[str, int] = {}
        self._known: dict[str, int] = {}
        self._unexplained: dict[str, int] = {}
        self.whole_open: dict[str, int] = {}  # target → its pushes answered whole still ahead
        # target → the other instances' pushes there (request key → uncached tokens) whose first
        # token its count has not yet been taken to hold (`remote_placed`)
        self._remote: dict[str, OrderedDict[str, float]] = {}

    # -- what happens to pushes ---------------------------------------------------------
    def placed(self, request_id: str, target_id: str, tokens: float, now: float,
               expires_at: float | None = None, samples: int = 1) -> None:
        """`request_id` was pushed to `target_id` now with `tokens` uncached prompt tokens (a
        retry of the same id replaces its earlier push) and `samples` parallel samples.
        `expires_at`: when to assume its prefill done if no first token says so (a request that
        is not streamed), unless its engine counts its first tokens: then that count says so
        (`engine_first_tokens`)."""
        self._release(request_id)
        self._unanswer(request_id)
        ahead = self.ahead.get(target_id, 0.0) + tokens
        self.ahead[target_id] = ahead
        self.ahead_count[target_id] = self.ahead_count.get(target_id, 0) + 1
        push = self._open[request_id] = _Push(target_id, tokens, ahead, now, whole=expires_at is not None,
                                              samples=samples)
        if push.whole:
            self.whole_open[target_id] = self.whole_open.get(target_id, 0) + 1
        if push.whole and target_id in self.counted:  # its engine's count says when (`engine_first_tokens`)
            self._whole.setdefault(target_id, OrderedDict())[request_id] = push
        elif expires_at is not None:
            heapq.heappush(self._expiring, (expires_at, next(self._seq), request_id, push))
        while len(self._open) > self.max_tracked:
            self._release(next(iter(self._open)))

    def first_token(self, request_id: str, now: float) -> None:
        """Its first token came back now: its prefill is done, and it is a sample of the fit."""
        push = self._release(request_id)
        if push is None:
            return
        if push.target in self.counted:
            self._known[push.target] = self._known.get(push.target, 0) + 1
        self._answering[request_id] = (push.target, push.samples)
        self.answering[push.target] = self.answering.get(push.target, 0) + push.samples
        while len(self._answering) > self.max_tracked:
            self._unanswer(next(iter(self._answering)))
        if now < push.at:
            return
        y = now - push.at
        predicted = self.predict_work(push.x)
        if predicted is not None:
            miss = abs(y - predicted)
            self._error = miss if self._error is None else self._error + self.alpha * (miss - self._error)
        a = self.alpha
        self._w += a * (1.0 - self._w)
        self._x += a * (push.x - self._x)
        self._y += a * (y - self._y)
        self._xx += a * (push.x * push.x - self._xx)
        self._xy += a * (push.x * y - self._xy)
        self.samples += 1

    def engine_first_tokens(self, target_id: str, count: int | None) -> None:
        """The target's engine says how many first tokens it has produced since it started (the
        count of vLLM's TTFT histogram). Those it counted since its last report that no first
        token this LB knows of explains are taken to be this LB's pushes there answered whole
        with the fewest uncached tokens (a short prefill ends first: vLLM's step budget takes a
        short prompt beside a long one's chunks): their prefill is released now. A count beyond
        ours (other clients' requests) is not carried over to our next pushes; the pushes of
        another instance over the same replicas (`remote_placed`) stand in that line beside ours,
        so their first tokens do not pass for ours. From its first
        report on, a target's pushes answered whole wait for its count (or their end) instead of
        their predicted TTFT, which came out late by a median 145 ms on multi-turn and 314 ms on
        agents at 0.9x (simulator, seed 0). Clients that do not stream, multi-turn at 0.9x: TTFT
        p90 218 ms before, 202 with the count, as when streamed (docs/results.md). Their TTFTs
        are not fitted: paired with the pushes' work, the histogram's mean put `hot-shift`'s p90
        at 376 ms against 344. None: its probe no longer says (another endpoint answers): its
        pushes answered whole that waited for the count are taken as done."""
        if count is None:
            if self.counted.pop(target_id, None) is not None:
                self._known.pop(target_id, None)
                self._unexplained.pop(target_id, None)
                self._remote.pop(target_id, None)
                for rid in list(self._whole.pop(target_id, {})):
                    self._release(rid)
            return
        seen = self.counted.get(target_id)
        if seen == count and target_id not in self._known:
            return  # nothing new (each scheduling pass reads every view)
        self.counted[target_id] = count
        known = self._known.pop(target_id, 0)
        if seen is None or count < seen:  # the first report, or an engine that restarted
            self._unexplained[target_id] = 0
            self._remote.pop(target_id, None)
            return
        whole, remote = self._whole.get(target_id), self._remote.get(target_id)
        left = self._unexplained.get(target_id, 0) + (count - seen) - known
        if left > 0 and (whole or remote):
            ours = ((p.tokens, rid, True) for rid, p in (whole or {}).items())
            theirs = ((tokens, key, False) for key, tokens in (remote or {}).items())
            done = heapq.nsmallest(left, itertools.chain(ours, theirs), key=lambda item: item[0])
            for _, rid, own in done:
                if own:
                    self._release(rid)
                else:
                    del remote[rid]
            left -= len(done)
        # more first tokens than ours: other clients' (never carried into our next pushes); fewer:
        # known ones its count had not reached, met by its next report (bounded)
        self._unexplained[target_id] = max(-MAX_UNEXPLAINED, min(0, left))

    def remote_placed(self, key: str, target_id: str, tokens: float, count: int | None = None) -> None:
        """Another instance over the same replicas (`lb.core.instances`) pushed `key` to `target_id`,
        with `tokens` of its prompt to compute. Where the target's engine counts its first tokens,
        that push's first token is counted there too: it stands with ours in the line the count
        passes (`engine_first_tokens`), so it does not release one of our pushes early. Not ahead
        of anything here: the replica's view counts the others' prefill until a probe does.
        `count`: the engine's count as last probed, the baseline where none is set yet (an
        instance that has placed nothing since it started)."""
        if target_id not in self.counted and count is not None:
            self.engine_first_tokens(target_id, count)
        if target_id not in self.counted:
            return
        line = self._remote.setdefault(target_id, OrderedDict())
        line[key] = tokens
        while len(line) > MAX_REMOTE:
            line.popitem(last=False)

    def awaiting_count(self, target_id: str) -> dict[str, int]:
        """The pushes on `target_id` whose first token waits on its engine's count: this LB's
        answered whole, and the other instances' (`remote_placed`)."""
        return {"ours": len(self._whole.get(target_id, ())), "others": len(self._remote.get(target_id, ()))}

    def remote_ended(self, key: str, target_id: str) -> None:
        """The other instance's push `key` ended: a first token the count holds or will (an
        answer that failed before its first is rare, and met by a later count as another client's)."""
        line = self._remote.get(target_id)
        if line is not None and line.pop(key, None) is not None:
            self._known[target_id] = self._known.get(target_id, 0) + 1

    def expire(self, now: float) -> None:
        """Release the pushes whose assumed end of prefill has come."""
        heap = self._expiring
        while heap and heap[0][0] <= now:
            _, _, rid, push = heapq.heappop(heap)
            if self._open.get(rid) is push:  # not answered, nor replaced by a retry's push
                self._release(rid)
        if len(heap) > 2 * self.max_tracked:  # entries of pushes long released: rebuild
            self._expiring = [e for e in heap if self._open.get(e[2]) is e[3]]
            heapq.heapify(self._expiring)

    def ended(self, request_id: str) -> None:
        """It ended (answered, failed, cancelled): its work is no longer ahead of anyone and
        it no longer runs there. One that ended without a first token we saw teaches nothing.
        An answer that came back whole before its engine's count passed it was counted there
        (or will be): it is one of the first tokens that count holds, not another's."""
        push = self._open.get(request_id)
        if push is not None and push.whole and request_id in self._whole.get(push.target, ()):
            self._known[push.target] = self._known.get(push.target, 0) + 1
        self._release(request_id)
        self._unanswer(request_id)

    def _unanswer(self, request_id: str) -> None:
        answer = self._answering.pop(request_id, None)
        if answer is not None:
            target, samples = answer
            left = self.answering[target] - samples
            if left:
                self.answering[target] = left
            else:
                del self.answering[target]

    def forget(self, target_id: str) -> None:
        for d in (self._whole, self.counted, self._known, self._unexplained, self.whole_open, self._remote):
            d.pop(target_id, None)
        self.ahead.pop(target_id, None)
        self.ahead_count.pop(target_id, None)
        self.answering.pop(target_id, None)
        for rid in [rid for rid, p in self._open.items() if p.target == target_id]:
            del self._open[rid]
        for rid in [rid for rid, (t, _) in self._answering.items() if t == target_id]:
            del self._answering[rid]

    def _release(self, request_id: str) -> _Push | None:
        push = self._open.pop(request_id, None)
        if push is not None:
            if push.whole:
                if (whole := self._whole.get(push.target)):
                    whole.pop(request_id, None)
                if (n := self.whole_open.get(push.target, 0) - 1) > 0:
                    self.whole_open[push.target] = n
                else:
                    self.whole_open.pop(push.target, None)
            left = self.ahead.get(push.target, 0.0) - push.tokens
            count = self.ahead_count.get(push.target, 0) - 1
            if count > 0:
                self.ahead_count[push.target] = count
                self.ahead[push.target] = max(0.0, left)
            else:
                self.ahead_count.pop(push.target, None)
                self.ahead.pop(push.target, None)
        return push

    # -- predictions ----------------------------------------------------------------------
    def fit(self) -> tuple[float, float] | None:
        """(base s, per-token s) of the line through the samples; None before `min_samples`.
        Computed once per sample (every prediction and advert reads it)."""
        if self._fit[0] != self.samples:
            self._fit = (self.samples, self._line())
        return self._fit[1]

    def _line(self) -> tuple[float, float] | None:
        if self.samples < self.min_samples or self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var, cov = self._xx / self._w - mx * mx, self._xy / self._w - mx * my
        if var > 1e-9 * max(1.0, mx * mx) and cov > 0:
            per_token = cov / var
            base = my - per_token * mx
            if base >= 0:
                return base, per_token
        # no spread in the work (an idle fleet) or a negative intercept: through the origin
        return (0.0, self._xy / self._xx) if self._xx > 0 else (my, 0.0)

    @property
    def error_s(self) -> float | None:
        """How far off a prediction typically is (EW mean absolute error, out of sample)."""
        return self._error

    def predict_work(self, work_tokens: float) -> float | None:
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * work_tokens

    def predict(self, target_id: str, tokens: float) -> float | None:
        """TTFT of a request with `tokens` uncached tokens pushed to `target_id` now."""
        return self.predict_work(self.ahead.get(target_id, 0.0) + tokens)

    def advert(self, target_ids: list[str], limit: int = 16) -> dict | None:
        """What a peer needs to predict a forward's TTFT here (the `ttft` entry of
        `/lb/peer/status` for one model): the fit, its error, and the work ahead on each of
        `target_ids` (the replicas that would take a request now), least first, at most
        `limit` of them. None before the fit exists."""
        fit = self.fit()
        if fit is None:
            return None
        ahead = sorted(round(self.ahead.get(t, 0.0)) for t in target_ids)[:limit]
        return {**self._advert_fit(fit), "ahead": ahead}

    def best_case(self, tokens: float) -> tuple[float, float] | None:
        """(TTFT, error) a peer reading our advert would predict for `tokens` on a replica with
        nothing ahead: the least any advert of ours can promise. None before the fit exists."""
        fit = self.fit()
        if fit is None:
            return None
        advert = {**self._advert_fit(fit), "ahead": [0]}
        return remote_ttft(advert, tokens), advert["error_s"]

    def _advert_fit(self, fit: tuple[float, float]) -> dict:
        return {"base_s": round(fit[0], 6), "per_token_s": fit[1], "error_s": round(self._error or 0.0, 6)}


def forward_cost(rtt_s: float, remote_ttft_s: float, local_error: float, remote_error: float) -> float:
    """What a forward must beat the local prediction by, in all: the round trip, the peer's
    predicted TTFT and the two predictions' combined error (a smaller gain is noise)."""
    return rtt_s + remote_ttft_s + math.hypot(local_error, remote_error)


def remote_ttft(advert: dict, tokens: float, unseen: list[float] = ()) -> float | None:
    """A peer's predicted TTFT for a forward of `tokens` prompt tokens, from its advert and the
    tokens of our forwards its advert has not seen yet (`unseen`, in send order: each took the
    peer's least-loaded replica, as its own routing would). None when it has no replica to offer."""
    ahead = list(advert.get("ahead") or ())
    if not ahead:
        return None
    return advert["base_s"] + advert["per_token_s"] * (min(land_on_least(ahead, unseen)) + tokens)


def land_on_least(values: list[float], adds: Iterable[float]) -> list[float]:
    """`values` (a peer's replicas' work ahead, or loads) after each of `adds` landed, in
    order, on the least of them, as the peer's own routing would place our forwards its
    status has not counted yet (greedy). Changes and returns `values`."""
    for add in adds:
        i = min(range(len(values)), key=values.__getitem__)
        values[i] += add
    return values


def parse_advert(doc: object, limit: int = 16) -> dict | None:
    """A peer's `ttft` entry for one model, checked (None when malformed: a peer cannot make
    us predict from garbage, nor hold an unbounded list). `load` (its offered replicas'
    loads, for `lb.core.peering.lighter_peer`) is optional: a peer of an older version
    sends none, and a malformed one is dropped, not the advert."""
    if not isinstance(doc, dict):
        return None
    raw = doc.get("ahead") or []
    if not isinstance(raw, list):
        return None
    try:
        base, per_token, error = (float(doc.get(k, 0.0)) for k in ("base_s", "per_token_s", "error_s"))
        ahead = [float(a) for a in raw[:limit]]
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) and v >= 0 for v in (base, per_token, error, *ahead)):
        return None
    return {"base_s": base, "per_token_s": per_token, "error_s": error, "ahead": ahead,
            "load": _loads(doc.get("load"), limit)}


def _loads(raw: object, limit: int) -> list[float]:
    if not isinstance(raw, list):
        return []
    try:
        loads = [float(x) for x in raw[:limit]]
    except (TypeError, ValueError):
        return []
    return loads if all(math.isfinite(v) and v >= 0 for v in loads) else []
