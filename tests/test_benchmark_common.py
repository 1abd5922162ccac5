"""benchmarks/common.py's learning-rate rule, which every benchmark script chooses by: the best dev score wins,
a tie goes to the rate listed first, whatever the direction of the score."""

from __future__ import annotations

from conftest import load_benchmark


def test_best_rate_takes_the_best_score_and_breaks_ties_by_listing_order():
    best_rate = load_benchmark("common").best_rate
    assert best_rate({1e-4: 0.7, 1e-3: 0.8, 3e-3: 0.75}) == 1e-3
    assert best_rate({1e-4: 0.8, 1e-3: 0.8}) == 1e-4
    assert best_rate({1e-3: 0.8, 3e-4: 0.8}) == 1e-3  # an a-priori rate listed first keeps a tie
    assert best_rate({1e-4: 0.5, 1e-3: 0.2, 3e-3: 0.9}, lower_is_better=True) == 1e-3
    assert best_rate({3e-3: 0.2, 1e-3: 0.2}, lower_is_better=True) == 3e-3
