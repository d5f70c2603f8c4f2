import math
import subprocess
import sys

import torch

import drift
from conftest import ROOT


def mmd2_double_loop(X, Y, bw):
    k = lambda a, b: math.exp(-float(((a - b) ** 2).sum()) / (2 * bw * bw))
    m, n = len(X), len(Y)
    xx = sum(k(X[i], X[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(Y[i], Y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    xy = sum(k(X[i], Y[j]) for i in range(m) for j in range(n)) / (m * n)
    return xx + yy - 2 * xy


def test_mmd2_equals_the_unbiased_formula():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64) + 0.3
    got, _ = drift.mmd2_test(X, Y, bandwidth=1.7, permutations=10)
    assert abs(got - mmd2_double_loop(X, Y, 1.7)) < 1e-6


def test_mmd2_permutation_test_separates_shift_from_noise():
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(120, 4, generator=g), torch.randn(100, 4, generator=g)
    bw = drift.median_bandwidth(X)
    same, p_same = drift.mmd2_test(X, Y, bw, permutations=200)
    assert abs(same) < 0.02 and p_same > 0.05
    shifted, p_shift = drift.mmd2_test(X, Y + 1.0, bw, permutations=200)
    assert shifted > 0.05 and p_shift < 0.05


def test_sliced_wasserstein_is_zero_on_itself_and_grows_with_shift():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(200, 6, generator=g)
    assert drift.sliced_wasserstein(X, X) == 0.0
    d = [drift.sliced_wasserstein(X, X + s) for s in (0.5, 1.0, 2.0)]
    assert 0 < d[0] < d[1] < d[2]
    # a pure translation by s along every axis moves each unit projection by |s * sum(u)|
    assert abs(d[1] / d[0] - 2) < 1e-6


def test_lexical_features_are_deterministic_across_processes():
    texts = ["She has 3 apples and buys 5 more.", "Total: $12,000 per year."]
    here = drift.lexical_features(texts)
    code = f"import sys; sys.path.insert(0, {ROOT!r}); import drift; print(drift.lexical_features({texts!r}).nonzero().tolist())"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}).stdout
        assert eval(out) == here.nonzero().tolist()
    assert torch.allclose(here.norm(dim=1), torch.ones(2))
    assert drift.jaccard_distance(["a b c"], ["a b d"]) == 0.5


def test_rollout_states_take_every_stride_and_the_end():
    from sample import Rollout
    r = Rollout([1, 2], [3, 4, 5, 6, 7], [0.0] * 5, "", "length")
    assert drift.rollout_states([r], 2) == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]]
