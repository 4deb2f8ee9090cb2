"""effattn.kv_press: every press against NumPy float64 softmax attention over the rows it keeps,
its budget, determinism, and errors."""

import numpy as np
import pytest

import effattn
from conftest import rel_err, softmax_attention

PRESSES = ["drop", "streaming", "uniform", "knorm", "snapkv", "observed", "wildcat", "vcc"]


def prompt(rng, m=160, d=16, w=24, dtype=np.float32):
    k = rng.standard_normal((m, d)).astype(dtype)
    v = rng.standard_normal((m, d)).astype(dtype)
    q = rng.standard_normal((w, d)).astype(dtype)
    return k, v, q


@pytest.mark.parametrize("press", PRESSES)
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
def test_keep_one_is_exact(rng, press, dtype, tol):
    k, v, q = prompt(rng, dtype=dtype)
    cache = effattn.kv_press(k, v, press, keep=1.0, q=q)
    assert cache.size == 160 and cache.dtype == np.dtype(dtype).name
    qn = rng.standard_normal((5, 16)).astype(dtype)
    out = effattn.weighted_attention(qn, cache).output
    assert rel_err(out, softmax_attention(qn, k, v)[0]) < tol


@pytest.mark.parametrize("press", ["streaming", "uniform", "knorm", "snapkv", "observed"])
def test_selection_is_exact_over_its_rows(rng, press):
    k, v, q = prompt(rng, dtype=np.float64)
    cache = effattn.kv_press(k, v, press, keep=0.25, q=q)
    rows = cache.pivots
    assert len(rows) == 40 and np.all(np.diff(rows) > 0)
    np.testing.assert_array_equal(cache.keys, k[rows])
    qn = rng.standard_normal((5, 16))
    out = effattn.weighted_attention(qn, cache).output
    assert rel_err(out, softmax_attention(qn, k[rows], v[rows])[0]) < 1e-13


def test_budget_rows_and_drop(rng):
    k, v, q = prompt(rng)
    assert effattn.kv_press(k, v, "knorm", rows=7).size == 7
    assert effattn.kv_press(k, v, "drop", keep=0.5).size == 0
    assert effattn.kv_press(k, v, "wildcat", keep=0.1, q=q).size <= 16
    vcc = effattn.kv_press(k, v, "vcc", keep=0.2, q=q)
    assert vcc.size <= 32 and np.isclose(np.exp(vcc.log_scale).sum(), 160)


def test_seeded(rng):
    k, v, q = prompt(rng)
    a = effattn.kv_press(k, v, "uniform", keep=0.2, seed=3).pivots
    b = effattn.kv_press(k, v, "uniform", keep=0.2, seed=3).pivots
    c = effattn.kv_press(k, v, "uniform", keep=0.2, seed=4).pivots
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_errors(rng):
    k, v, q = prompt(rng)
    with pytest.raises(ValueError, match="unknown press 'h2o'"):
        effattn.kv_press(k, v, "h2o", keep=0.5)
    with pytest.raises(ValueError, match="keep must be in"):
        effattn.kv_press(k, v, "knorm", keep=1.5)
    with pytest.raises(ValueError, match="keep must be in"):
        effattn.kv_press(k, v, "knorm")
    with pytest.raises(ValueError, match="pass Q"):
        effattn.kv_press(k, v, "snapkv", keep=0.5)
    with pytest.raises(ValueError, match="unknown option 'window'"):
        effattn.kv_press(k, v, "snapkv", keep=0.5, q=q, window=3)
