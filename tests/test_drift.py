import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import drift
import model as M
from conftest import ROOT
from plumbing.files import InputError


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


def prompt_paired_states(seed, prompts=60, per_prompt=4, dim=8):
    """States as drift.py samples them: each prompt gives several states in both samples,
    the prompt deciding most of where they lie."""
    g = torch.Generator().manual_seed(seed)
    centers = 2 * torch.randn(prompts, dim, generator=g)
    index = torch.arange(prompts).repeat_interleave(per_prompt)
    X = centers[index] + 0.5 * torch.randn(len(index), dim, generator=g)
    Y = centers[index] + 0.5 * torch.randn(len(index), dim, generator=g)
    return X, Y, index


def test_mmd2_with_prompts_leaves_out_same_prompt_pairs():
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(11, 3, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64) + 0.4
    px, py = [0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5], [0, 1, 1, 2, 2, 3, 6, 6]
    k = lambda a, b: math.exp(-float(((a - b) ** 2).sum()) / (2 * 1.3 ** 2))
    mean = lambda A, pa, B, pb: statistics.mean(k(a, b) for a, i in zip(A, pa) for b, j in zip(B, pb) if i != j)
    expected = mean(X, px, X, px) + mean(Y, py, Y, py) - 2 * mean(X, px, Y, py)
    got, _ = drift.mmd2_test(X, Y, 1.3, permutations=10, x_prompts=px, y_prompts=py)
    assert abs(got - expected) < 1e-9


def test_mmd2_of_the_same_states_is_zero_with_p_one():
    """A run whose adapter did not change its rollouts: every swap of a prompt's two sets
    gives the same MMD^2 up to rounding, which must not read as a significant drift."""
    for seed in range(8):  # seeds 4 and 7 sum to 2e-16, not 0
        X, _, prompts = prompt_paired_states(seed)
        stat, p = drift.mmd2_test(X, X.clone(), drift.median_bandwidth(X), permutations=20, x_prompts=prompts,
                                  y_prompts=prompts)
        assert stat == 0.0 and p == 1.0


def test_mmd2_of_prompt_paired_samples_is_unbiased_and_its_test_calibrated():
    """Two samples from one distribution, paired by prompt as drift.py's are: the plain
    estimator (every pair but a state with itself) comes out below zero with p = 1 every
    time, and misses a shift that the paired one finds. The paired estimator averages
    zero and its p-value is spread over (0, 1]."""
    plain, paired, p_values = [], [], []
    for seed in range(20):
        X, Y, prompts = prompt_paired_states(seed)
        bw = drift.median_bandwidth(X)
        plain.append(drift.mmd2_test(X, Y, bw, permutations=50))
        stat, p = drift.mmd2_test(X, Y, bw, permutations=50, x_prompts=prompts, y_prompts=prompts)
        paired.append(stat)
        p_values.append(p)
    assert all(stat < 0 and p == 1.0 for stat, p in plain)
    spread = statistics.pstdev(paired)
    assert abs(statistics.mean(paired)) < spread and spread < -statistics.mean(s for s, _ in plain)
    assert 4 <= sum(p < 0.5 for p in p_values) <= 16 and p_values.count(1.0) < 5

    X, Y, prompts = prompt_paired_states(100)
    bw = drift.median_bandwidth(X)
    shift = torch.zeros(X.shape[1])
    shift[0] = 0.4
    assert drift.mmd2_test(X, Y + shift, bw, permutations=200)[1] > 0.05
    stat, p = drift.mmd2_test(X, Y + shift, bw, permutations=200, x_prompts=prompts, y_prompts=prompts)
    assert stat > 0 and p < 0.01


def test_what_the_paired_estimator_cannot_see_and_the_unpaired_one_can():
    """A change in how an answer relates to its own question (answers shuffled across
    questions) leaves every pair of states from different prompts alike: the paired MMD^2
    stays at its null and cannot see it. The unpaired one compares same-prompt pairs too, and
    rises well above where it sits when nothing changed (below zero, by the pairing)."""
    g = torch.Generator().manual_seed(5)
    prompts = 80
    questions, answers = torch.randn(prompts, 6, generator=g), torch.randn(prompts, 6, generator=g)
    index = torch.arange(prompts)
    noise = lambda: 0.3 * torch.randn(prompts, 12, generator=g)
    base = torch.cat([questions, answers], 1) + noise()
    same = torch.cat([questions, answers], 1) + noise()
    shuffled = torch.cat([questions, answers[torch.randperm(prompts, generator=g)]], 1) + noise()
    bw = drift.median_bandwidth(base)
    paired = {name: drift.mmd2_test(base, Y, bw, 200, 0, index, index) for name, Y in (("same", same),
                                                                                        ("shuffled", shuffled))}
    unpaired = {name: drift.mmd2_test(base, Y, bw, 200)[0] for name, Y in (("same", same), ("shuffled", shuffled))}
    assert paired["shuffled"][1] > 0.05 and abs(paired["shuffled"][0]) < abs(unpaired["same"])  # blind to it
    assert unpaired["same"] < 0 and unpaired["shuffled"] - unpaired["same"] > 5 * abs(paired["same"][0])


def test_sliced_wasserstein_is_zero_on_itself_and_grows_with_shift():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(200, 6, generator=g)
    assert drift.sliced_wasserstein(X, X) == 0.0
    d = [drift.sliced_wasserstein(X, X + s) for s in (0.5, 1.0, 2.0)]
    assert 0 < d[0] < d[1] < d[2]
    # a pure translation by s along every axis moves each unit projection by |s * sum(u)|
    assert abs(d[1] / d[0] - 2) < 1e-6


def test_bandwidth_is_the_median_distance_between_distinct_base_states():
    X = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [6.0, 8.0]])
    # distances between distinct points: 5, 10, 10, 5, 5 and 0 (the repeated state, left out)
    assert drift.median_bandwidth(X) == pytest.approx(5.0)
    assert drift.median_bandwidth(2 * X) == pytest.approx(10.0)  # a distance, so it scales with the features
    assert drift.median_bandwidth(torch.ones(3, 2)) == 1.0  # all states alike: a neutral width, not 0


def test_sliced_wasserstein_of_a_shift_in_one_dimension_is_the_shift():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(300, 1, generator=g)
    # in one dimension every unit direction is +1 or -1, and each moves the sample by the shift
    assert drift.sliced_wasserstein(X, X + 0.7) == pytest.approx(0.7, rel=1e-6)  # X + 0.7 rounded to fp32
    Y = torch.randn(300, 5, generator=g)
    assert drift.sliced_wasserstein(3 * Y, 3 * Y + 1) == pytest.approx(3 * drift.sliced_wasserstein(Y, Y + 1 / 3), rel=1e-6)


def test_lexical_features_see_word_order_through_bigrams():
    a, b = drift.lexical_features(["the dog bit the man", "the man bit the dog"])
    assert not torch.allclose(a, b)  # the same words: only the bigrams differ
    # unigrams a, b twice each; bigrams "a b" twice, "b a" once: counts 2, 2, 2, 1 over their norm
    counts = drift.lexical_features(["a b a b"], buckets=2 ** 16)[0] * 13 ** 0.5
    assert sorted(counts[counts > 0].tolist()) == pytest.approx([1.0, 2.0, 2.0, 2.0])


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
    empty.prompt_index = 1
    states, prompt_lengths, prompts = drift.rollout_states([r, empty], 2)
    assert states == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    assert prompt_lengths == [2, 2, 2, 3]
    assert prompts == [0, 0, 0, 1]


def test_generated_embedding_reads_only_the_generated_part(tiny_model):
    """--embed generated: lexical features of y_<t alone, hidden states pooled over y_<t
    alone (the model still reads the prompt), states with nothing generated left out. The
    hidden features are checked against each state run on its own, without padding, so a
    wrong offset into the left-padded batch fails."""
    import model as M
    net, tok = M.load(tiny_model, "cpu", torch.float32)
    prompt_a, prompt_b = tok.encode("Question: 3 apples and 4 pears?"), tok.encode("Q: 12?")
    gen_a, gen_b = tok.encode(" She has 7 fruit."), tok.encode(" 12 it is")
    rollouts = dict(states=[prompt_a + gen_a, prompt_b + gen_b[:2], prompt_b],
                    prompt_lengths=[len(prompt_a), len(prompt_b), len(prompt_b)], prompts=[0, 1, 1])

    lexical, prompts = drift.featurize(net, tok, rollouts, "lexical", "generated")
    assert torch.equal(lexical, drift.lexical_features([tok.decode(gen_a), tok.decode(gen_b[:2])]))
    assert prompts == [0, 1]
    assert not torch.equal(lexical, drift.featurize(net, tok, rollouts, "lexical", "state")[0][:2])

    hidden, _ = drift.featurize(net, tok, rollouts, "hidden", "generated")
    with torch.no_grad():
        alone = [net(torch.tensor([s]), hidden_only=True)[0, n:].mean(0)
                 for s, n in zip(rollouts["states"][:2], rollouts["prompt_lengths"][:2])]
    assert hidden.shape == (2, net.config.hidden_size)
    assert torch.allclose(hidden, torch.stack(alone), atol=1e-5)
    whole, prompts = drift.featurize(net, tok, rollouts, "hidden", "state")
    assert whole.shape[0] == 3 and prompts == [0, 1, 1] and not torch.allclose(whole[:2], hidden, atol=1e-3)


def test_a_run_that_samples_as_the_base_does_has_no_drift(tiny_model, data_dir, tmp_path):
    # a fresh adapter (B = 0) is the base model; sample i of every model draws from the same
    # seed, so its rollouts are the base's, token for token, and every distance is zero
    import lora
    run = tmp_path / "fresh"
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    lora.save_adapter(m, str(run), base_model=tiny_model)
    # each call after the first finds the base's rollouts of the one before cached under other
    # settings (the token budget, the dtype, other prompts from another data folder): made again
    other_data = tmp_path / "other-data" / "gsm8k"
    other_data.mkdir(parents=True)
    test_lines = (Path(data_dir) / "gsm8k" / "test.jsonl").read_text().splitlines(keepends=True)
    (other_data / "test.jsonl").write_text("".join(test_lines[6:12]))
    (other_data / "train.jsonl").write_text("".join(test_lines[:6]))  # where the reference is measured
    for tokens, dtype, folder in (("12", "fp32", data_dir), ("20", "fp32", data_dir), ("20", "bf16", data_dir),
                                  ("20", "bf16", other_data.parent)):
        drift.main([str(run), "--model", tiny_model, "--data-dir", str(folder), "--out", str(tmp_path / "out"),
                    "--prompts", "6", "--max-new-tokens", tokens, "--stride", "4", "--permutations", "20",
                    "--dtype", dtype])
        result = json.loads((run / "drift.json").read_text())
        assert result["settings"]["max_new_tokens"] == int(tokens)
        assert result["settings"]["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
        assert result["mmd2"] == result["mmd"] == 0.0 and result["p_value"] == 1.0, result
        assert result["mmd2_unpaired"] < 0 and result["p_value_unpaired"] == 1.0  # the pairing's pull below zero
        assert result["centroid"] == 0.0 and result["sliced_wasserstein"] == 0.0 and result["jaccard"] == 0.0
        assert result["n_states_run"] == result["n_states_base"] >= 6
        assert result["kl_to_base"] == 0.0 and result["state_nll_reference"] > 0 and "state_nll_gold" not in result
    with pytest.raises(InputError, match="--prompts 7: the GSM8K test split holds 6 questions; pass --prompts 6 or fewer"):
        drift.main([str(run), "--model", tiny_model, "--data-dir", str(other_data.parent), "--out", str(tmp_path / "out"),
                    "--prompts", "7"])


def test_a_runs_drift_is_measured_as_its_studys_base_rollouts_were_unless_a_flag_says_otherwise(
        tiny_model, data_dir, tmp_path, capsys):
    import lora
    out, study = tmp_path / "out", ["--prompts", "4", "--max-new-tokens", "10", "--stride", "3",
                                    "--temperature", "0.5", "--seed", "3"]
    m, _ = M.load(tiny_model)
    lora.add_lora(m, rank=2, alpha=4)
    for name in ("mild", "opd-rl"):
        lora.save_adapter(m, str(out / name), base_model=tiny_model)
    flags = ["--model", tiny_model, "--data-dir", str(data_dir), "--permutations", "5"]
    drift.main([str(out / "mild"), *flags, *study])  # the study's drift: the base's rollouts cached
    cache = (out / "drift_base.json").read_text()
    capsys.readouterr()
    drift.main([str(out / "opd-rl"), *flags])  # a run of that study, no rollout flag
    said = capsys.readouterr().out
    assert all(f"{k} {v} (from {out / 'drift_base.json'})" in said for k, v in zip(study[::2], study[1::2]))
    assert (out / "drift_base.json").read_text() == cache  # the study's base rollouts, read again
    mild, new = (json.loads((out / name / "drift.json").read_text()) for name in ("mild", "opd-rl"))
    assert new["settings"] == mild["settings"] and new["fingerprint"] == mild["fingerprint"]
    drift.main([str(out / "opd-rl"), *flags, "--max-new-tokens", "6"])  # a flag given wins
    assert json.loads((out / "opd-rl" / "drift.json").read_text())["settings"]["max_new_tokens"] == 6


def test_drift_cli_names_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        drift.main(["out/stress", "--prompts", "1"])
    assert e.value.code == 2
    assert "argument --prompts: must be at least 2, got 1: MMD^2 compares states of different prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        drift.main(["out/stress", "--save-as", "out/d.json"])
    assert "argument --save-as: 'out/d.json': give a file name ending in .json" in capsys.readouterr().err


def test_offpolicy_gap_is_the_bases_nll_of_gold_answers_and_of_its_own_samples(tiny_model, data_dir):
    """Measured with the adapter off, whatever adapter is active: each NLL is checked against a
    plain forward pass of the base per sequence, and the own samples against generate's."""
    import data
    import lora
    from conftest import randomize_adapter
    from sample import Sampling, generate
    net, tok = M.load(tiny_model, "cpu", torch.float32)
    base, _ = M.load(tiny_model, "cpu", torch.float32)
    lora.add_lora(net, rank=2, alpha=4)
    randomize_adapter(net)
    rows = data.load_gsm8k("train", data_dir)[:4]
    gold, own = drift.offpolicy_gap(net, tok, rows, max_new_tokens=12, seed=3)

    def nll(pairs):  # (prompt ids, continuation ids): the base's mean per-token NLL of the continuations
        total, n = 0.0, 0
        for prompt, rest in pairs:
            with torch.no_grad():
                logp = base(torch.tensor([prompt + rest]))[0, len(prompt) - 1:-1].float().log_softmax(-1)
            total -= logp.gather(1, torch.tensor(rest)[:, None]).sum().item()
            n += len(rest)
        return total / n
    assert abs(gold - nll([data.gsm8k_gold_ids(tok, r) for r in rows])) < 1e-4
    samples = generate(base, tok, [data.gsm8k_prompt(r["question"]) for r in rows], Sampling(max_new_tokens=12, temperature=1.0, stop=data.GSM8K_STOP, seed=3))
    assert abs(own - nll([(s.prompt_ids, s.completion_ids) for s in samples])) < 1e-4
    assert abs(own + sum(map(sum, (s.logprobs for s in samples))) / sum(len(s.logprobs) for s in samples)) < 1e-4
    assert abs(gold - own) > 0.1  # a random model does not write GSM8K's solutions


def test_kl_to_base_is_rl_razors_kl_from_the_base_over_the_vocabulary(tiny_model):
    """KL(pi_base || pi) at every state of each rollout, summed over the rollout, averaged over
    rollouts (an empty one counts as zero): against a plain per-sequence computation; the
    other direction gives another number, and an adapter that computes the base gives 0."""
    import lora
    from conftest import randomize_adapter
    net, tok = M.load(tiny_model, "cpu", torch.float32)
    lora.add_lora(net, rank=2, alpha=4, name="run")
    lora.add_lora(net, rank=2, alpha=4, name="fresh")  # B = 0: the base itself
    randomize_adapter(net, "run", scale=0.3)
    prompts = [tok.encode("Question: 3 apples and 4 pears?\nAnswer:"), tok.encode("Question: 12?\nAnswer:")]
    rollouts = [(prompts[0] + tok.encode(" 3 + 4 = 7 fruit."), len(prompts[0])),
                (prompts[1] + tok.encode(" 12"), len(prompts[1])), (prompts[1], len(prompts[1]))]

    def plain(first, second):  # sum over states of KL(first || second), mean over rollouts
        total = 0.0
        for ids, start in rollouts:
            logp = {}
            for name in (first, second):
                with lora.use_adapter(net, name), torch.no_grad():
                    logp[name] = net(torch.tensor([ids]))[0, start - 1:-1].float().log_softmax(-1)
            total += (logp[first].exp() * (logp[first] - logp[second])).sum().item()
        return total / len(rollouts)
    got = drift.kl_to_base(net, "run", rollouts, batch_size=2)
    assert abs(got - plain(None, "run")) < 1e-5 and got > 1e-3
    assert abs(got - plain("run", None)) > 1e-4  # KL(run || base) is another number
    assert drift.kl_to_base(net, "fresh", rollouts) == 0.0
    # the base's side kept from one run's call for the next (drift.main's runs): the same numbers
    kept = {}
    one = drift.kl_to_base(net, "run", rollouts, batch_size=1)
    assert drift.kl_to_base(net, "run", rollouts, batch_size=1, base_states=kept) == one and len(kept) == 2
    assert drift.kl_to_base(net, "fresh", rollouts, batch_size=1, base_states=kept) == 0.0
