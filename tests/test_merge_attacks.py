"""Poisoned merges on real pseudo-gradients (docs/trust.md §5): 4 learners of the project's
byte-level GPT (default config) take 24 AdamW steps from one Θ on their own data shards; their
Δ, poisoned as in ``bench/merge_attacks.py``, are merged per fragment by an honest reducer with
``robust_merge(own=reducer)`` (every honest member in turn, the worst figure asserted)."""

from __future__ import annotations

import pytest

from bench.merge_attacks import Round, measure


@pytest.fixture(scope="module")
def figures() -> dict[str, dict[str, float]]:
    rnd = Round(pre=0, steps=24, max_bytes=200_000)
    return {"own": measure(rnd, (0, 1, 2)), "off": measure(rnd, (0,), policy="off")}


def test_claimed_tokens_never_raise_a_weight_above_the_median(figures):
    assert figures["own"]["tokens1000"] <= 1.0
    assert figures["off"]["tokens1000"] > 1e5  # the attack does work on a plain merge


def test_one_steering_poisoner_of_four_does_not_steer(figures):
    own, off = figures["own"], figures["off"]
    assert own["steer_random"] <= 0.3 and own["steer_negative"] <= 0.3
    assert off["steer_random"] > 0.3  # the plain merge follows it


def test_two_colluders_sending_minus_twice_their_delta_do_not_stall_progress(figures):
    own, off = figures["own"], figures["off"]
    assert own["flip2"] >= 0.8 and own["flip2_tokens"] >= 0.8
    assert off["flip2"] < 0.8 and off["flip2_tokens"] < 0


def test_a_scaled_delta_barely_moves_the_merged_norm(figures):
    assert figures["own"]["scale1000"] <= 1.1
    assert figures["off"]["scale1000"] > 100


def test_an_honest_group_merges_as_the_paper_does(figures):
    own = figures["own"]
    assert own["honest_cosine"] >= 0.99 and abs(own["honest_norm"] - 1) <= 0.02
