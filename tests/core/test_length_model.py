"""Online response-length prediction from cheap request features."""
from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from lb.core.length_model import LengthModel, QuantileSketch
from lb.core.types import RequestFacts


def facts(app=None, stage=None, prompt=100, max_tokens=None, rid="r") -> RequestFacts:
    return RequestFacts(request_id=rid, model="m", app=app, interaction_stage=stage,
                        prompt_tokens=prompt, max_tokens=max_tokens)


def test_sketch_quantiles_within_relative_error():
    sk = QuantileSketch()
    for v in range(1, 1001):
        sk.add(v)
    assert sk.quantile(0.5) == pytest.approx(500, rel=0.05)
    assert sk.quantile(0.9) == pytest.approx(900, rel=0.05)
    assert sk.mean() == pytest.approx(500.5)
    assert sk.mean_above(800) == pytest.approx(900, rel=0.05)
    assert sk.mean_above(5000) is None


def test_sketch_forgets_old_behaviour():
    sk = QuantileSketch(max_weight=200)
    for _ in range(1000):
        sk.add(10)
    for _ in range(400):
        sk.add(1000)
    assert sk.quantile(0.5) == pytest.approx(1000, rel=0.05)


def test_prior_until_learned_and_max_tokens_caps():
    lm = LengthModel(prior_tokens=256, min_samples=4)
    p = lm.predict(facts(app="chat"))
    assert (p.expected, p.level) == (256, "prior")
    assert lm.predict(facts(app="chat", max_tokens=50)).expected == 50


def test_apps_and_prompt_lengths_are_told_apart():
    lm = LengthModel(min_samples=8)
    rng = random.Random(1)
    for i in range(400):
        lm.observe(facts(app="chat", stage=0, prompt=rng.randint(50, 200)), rng.randint(300, 500))
        lm.observe(facts(app="classify", stage=0, prompt=rng.randint(50, 200)), rng.randint(1, 5))
        # summaries: output grows with the prompt
        prompt = rng.choice([256, 4096])
        lm.observe(facts(app="sum", stage=1, prompt=prompt), prompt // 8)
    chat, cls = lm.predict(facts(app="chat", stage=0)), lm.predict(facts(app="classify", stage=0))
    assert chat.level == "app+stage+len"
    assert 350 < chat.expected < 450 and cls.expected < 6
    assert chat.p50 <= chat.p90
    short, long = lm.predict(facts(app="sum", stage=1, prompt=300)), lm.predict(facts(app="sum", stage=1, prompt=5000))
    assert short.expected == pytest.approx(32, rel=0.1) and long.expected == pytest.approx(512, rel=0.1)
    # an unseen stage backs off to the app; an unseen app to the prompt-length bucket
    assert lm.predict(facts(app="chat", stage=9)).level == "app"
    unknown = lm.predict(facts(app="new", prompt=4096))
    assert unknown.level == "len" and unknown.expected == pytest.approx(512, rel=0.1)
    assert lm.predict(facts(prompt=3)).level == "all"


def test_refine_predicts_beyond_what_was_generated():
    lm = LengthModel(min_samples=4)
    for v in (100, 200, 300, 400):
        lm.observe(facts(app="a"), v)
    assert lm.refine(facts(app="a"), 250) == pytest.approx(350, rel=0.05)  # mean of {300, 400}
    assert lm.refine(facts(app="a"), 500) == 500 * 1.5 + 16  # past everything seen
    assert lm.refine(facts(app="a", max_tokens=420), 500) == 501  # never below generated + 1
    assert lm.refine(facts(app="a", max_tokens=320), 250) == 320


AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "azure" / "conv_2023_first30min.csv"


def test_prompt_length_buckets_beat_the_global_median_on_the_azure_trace():
    rows = list(csv.DictReader(AZURE.open()))
    lm, err_model, err_global = LengthModel(), 0.0, 0.0
    for i, row in enumerate(rows):
        f = facts(prompt=int(row["ContextTokens"]), rid=str(i))
        out = int(row["GeneratedTokens"])
        if i >= 500:  # learned online: predict, then observe
            err_model += abs(lm.predict(f).p50 - out)
            err_global += abs(lm.sketches[("all",)].quantile(0.5) - out)
        lm.observe(f, out)
    assert err_model < 0.7 * err_global  # measured 60.5 vs 136 tokens MAE
