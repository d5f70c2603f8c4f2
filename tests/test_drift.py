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
    empty = Rollout([8, 9, 10], [], [], "", "eos")
    states, prompt_lengths = drift.rollout_states([r, empty], 2)
    assert states == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    assert prompt_lengths == [2, 2, 2, 3]


def test_generated_embedding_reads_only_the_generated_part(tiny_model):
    """--embed generated: lexical features of y_<t alone, hidden states pooled over y_<t
    alone (the model still reads the prompt), states with nothing generated left out. The
    hidden features are checked against each state run on its own, without padding, so a
    wrong offset into the left-padded batch fails."""
    import model as M
    net, tok = M.load(tiny_model, "cpu", "fp32")
    prompt_a, prompt_b = tok.encode("Question: 3 apples and 4 pears?"), tok.encode("Q: 12?")
    gen_a, gen_b = tok.encode(" She has 7 fruit."), tok.encode(" 12 it is")
    rollouts = dict(states=[prompt_a + gen_a, prompt_b + gen_b[:2], prompt_b],
                    prompt_lengths=[len(prompt_a), len(prompt_b), len(prompt_b)])

    lexical = drift.featurize(net, tok, rollouts, "lexical", "generated")
    assert torch.equal(lexical, drift.lexical_features([tok.decode(gen_a), tok.decode(gen_b[:2])]))
    assert not torch.equal(lexical, drift.featurize(net, tok, rollouts, "lexical", "state")[:2])

    hidden = drift.featurize(net, tok, rollouts, "hidden", "generated")
    with torch.no_grad():
        alone = [net(torch.tensor([s]), hidden_only=True)[0, n:].mean(0)
                 for s, n in zip(rollouts["states"][:2], rollouts["prompt_lengths"][:2])]
    assert hidden.shape == (2, net.config.hidden_size)
    assert torch.allclose(hidden, torch.stack(alone), atol=1e-5)
    whole = drift.featurize(net, tok, rollouts, "hidden", "state")
    assert whole.shape[0] == 3 and not torch.allclose(whole[:2], hidden, atol=1e-3)
