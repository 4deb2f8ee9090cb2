"""The calibration metrics of examples/lm/calibration.py against brute-force definitions."""

import itertools
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (apt-get install python3-torch)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lm"))
import calibration  # noqa: E402


def test_auroc_is_the_pairwise_probability():
    rng = np.random.default_rng(0)
    score = rng.integers(0, 6, 40).astype(float)  # many ties
    positive = rng.random(40) < 0.4
    pairs = [(a, b) for a, b in itertools.product(score[positive], score[~positive])]
    brute = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert calibration.auroc(score, positive) == pytest.approx(brute, abs=1e-12)


def test_metrics_by_their_definitions():
    rng = np.random.default_rng(1)
    n, V = 300, 7
    logits = rng.normal(size=(n, V)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    targets = rng.integers(0, V, n)
    m = calibration.metrics(probs, targets)
    conf, pred = probs.max(1), probs.argmax(1)
    right = pred == targets
    ece = 0.0
    for b in range(15):
        lo, hi = b / 15, (b + 1) / 15
        sel = [i for i in range(n) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0)]
        if sel:
            ece += len(sel) / n * abs(right[sel].mean() - conf[sel].mean())
    assert m["accuracy"] == pytest.approx(right.mean())
    assert m["ece"] == pytest.approx(ece, abs=1e-12)
    assert m["nll"] == pytest.approx(-np.mean([math.log(probs[i, targets[i]]) for i in range(n)]))
    brier = np.mean([sum((probs[i, c] - (c == targets[i])) ** 2 for c in range(V)) for i in range(n)])
    assert m["brier"] == pytest.approx(brier)


def test_temperature_fit_minimises_the_nll():
    rng = np.random.default_rng(2)
    n, V = 2000, 5
    logits = rng.normal(size=(n, V)) * 3
    true_p = np.exp(logits / 3) / np.exp(logits / 3).sum(1, keepdims=True)  # T = 3 is right
    targets = np.array([rng.choice(V, p=p) for p in true_p])
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    t = calibration.fit_temperature(probs, targets)

    def nll(T):
        z = logits / T
        z = z - z.max(1, keepdims=True)
        return -np.mean(z[np.arange(n), targets] - np.log(np.exp(z).sum(1)))

    grid = np.exp(np.linspace(math.log(0.25), math.log(4), 2001))
    best = grid[np.argmin([nll(T) for T in grid])]
    assert t == pytest.approx(best, rel=5e-3)
    assert 2.5 < t < 3.5
