"""The training pass (train.py): log-probs of shared prefixes equal each sequence's own, micro-
batches weighed by their tokens, the cross-process sum, the schedule and the optimizer step."""
import json

import pytest
import torch

import model as M
import opd
import rl
import train
from plumbing import processes
from conftest import (DEVICES, MAINS, TINY_CONFIGS, adapter_tensors, common, randomize_adapter, read_log, short_run,
                      two_sequences)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_sequence_logprobs_give_each_sequence_what_it_has_alone(tiny_models, name):
    import lora
    ours, tok = M.load(tiny_models[name])
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    a, b = two_sequences(tok)
    # a prompt's samples share it, a rollout's continuations share it up to their cuts, and a
    # sequence may lie inside another; short or unshared ones keep rows of their own
    samples = [a + tok.encode(f" {n} apples") for n in (7, 12, 400)]
    cuts = [a + tok.encode(" She had 3") + tok.encode(t) for t in (" pens", " and 5 more", "")]
    sequences = [b, *samples, *cuts, a[:20], a[:7] + b]
    starts = [len(b) - 2, *[len(a)] * 3, *[len(a) + 2] * 3, 18, 7]
    rows, _, _ = train.shared_rows(sequences)
    assert len(rows) < len(sequences) and sum(map(len, rows)) < sum(map(len, sequences))
    logp, which = train.sequence_logprobs(ours, sequences, starts)
    assert which.tolist() == [b for b, (s, st) in enumerate(zip(sequences, starts)) for _ in range(st, len(s))]
    grads = torch.autograd.grad(logp.sum(), lora.lora_parameters(ours))
    alone, alone_grads = [], [torch.zeros_like(g) for g in grads]
    for s, start in zip(sequences, starts):
        with torch.no_grad():
            expected = ours(torch.tensor([s]))[0].log_softmax(-1)
        alone.append(expected[torch.arange(start - 1, len(s) - 1), torch.tensor(s[start:])])
        lp, _ = train.sequence_logprobs(ours, [s], [start])
        for acc, g in zip(alone_grads, torch.autograd.grad(lp.sum(), lora.lora_parameters(ours))):
            acc += g
    assert (logp - torch.cat(alone)).abs().max() < 1e-5
    assert all((g - e).abs().max() <= 1e-5 * e.abs().max() for g, e in zip(grads, alone_grads))
    with pytest.raises(ValueError, match=r"sequence 1: start 0 outside \[1, 3\]"):
        train.sequence_logprobs(ours, [a, [1, 2, 3]], [2, 0])


def test_a_state_several_sequences_share_gets_the_same_gradient_on_every_pass(tiny_model):
    """RL's samples of a prompt all train on its last token's state: on two CPU threads the
    sum of their gradients there must come out the same every time (a run repeats itself)."""
    import lora
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    a, _ = two_sequences(tok)
    g = torch.Generator().manual_seed(0)
    samples = [a + torch.randint(3, tok.tok.get_vocab_size(), (40,), generator=g).tolist()
               for _ in range(48)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def gradient():
            logp, _ = train.sequence_logprobs(ours, samples, [len(a)] * len(samples))
            return torch.cat([x.flatten() for x in torch.autograd.grad(
                logp.sum(), lora.lora_parameters(ours))])
        first = gradient()
        assert all(torch.equal(gradient(), first) for _ in range(10))
    finally:
        torch.set_num_threads(threads)


def test_learner_nll_takes_the_samplers_log_probs_where_the_learner_drew_the_trajectory(tiny_model):
    """state_nll: an OPD step whose states are the student's own rollouts reads them from the
    sampler (no second forward); gold or teacher trajectories (None) are read by the learner."""
    import lora
    from sample import Sampling, generate
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    ours.train()  # as amid a step: the measure is the eval-mode learner, dropout or not
    rollouts = generate(ours.eval(), tok, ["Question: 3 + 4?", "Question: 12 apples"], Sampling(max_new_tokens=6, seed=1))
    ours.train()
    sequences, starts = [r.prompt_ids + r.completion_ids for r in rollouts], [len(r.prompt_ids) for r in rollouts]
    sampled = [r.logprobs for r in rollouts]
    forward = train.learner_nll(ours, sequences, starts, [None, None])
    nll, n = train.learner_nll(ours, sequences, starts, sampled)
    assert n == forward[1] == sum(map(len, sampled)) and abs(nll - forward[0]) < 1e-4
    # rows with log-probs are taken as given, the others read by a forward
    zeros = [[0.0] * len(sampled[0]), None]
    assert train.learner_nll(ours, sequences, starts, zeros) == (
        train.learner_nll(ours, sequences[1:], starts[1:], [None])[0], n)
    assert ours.training


def test_shared_rows_lay_each_common_prefix_out_once_and_short_sequences_side_by_side():
    trunk = list(range(100, 130))
    sequences = [trunk[:20] + [1, 2], trunk, trunk[:25] + [3], list(range(200, 210)), trunk[:15] + [4], [7] * 12]
    rows, parents, placed = train.shared_rows(sequences)
    # the longest first; what opens with 20 or 25 of its tokens adds only the rest to its row
    assert rows[0] == trunk + [3, 1, 2] and parents[0] == [-1, *range(29), 24, 19, 31]
    assert placed[0] == (0, list(range(20)) + [31, 32]) and placed[2] == (0, list(range(25)) + [30])
    # one sharing 15 (below SHARED_MIN) would take the row past the longest's length (30):
    # a row of its own (16), which the twelve 7s join (28); the last ten fit neither
    assert [len(row) for row in rows] == [33, 28, 10] and placed[4][0] == placed[5][0] == 1 and placed[3][0] == 2
    for s, (r, columns) in zip(sequences, placed):
        assert [rows[r][c] for c in columns] == s
        assert all(parents[r][c] == (columns[i - 1] if i else -1) for i, c in enumerate(columns))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_pass_computes_what_fp32_on_the_cpu_does(tiny_models, device, dtype):
    import lora
    reference, tok = M.load(tiny_models["untied"])
    ours, _ = M.load(tiny_models["untied"], device, dtype)
    for m in (reference, ours):
        lora.add_lora(m, rank=4, alpha=8)
        randomize_adapter(m)
    a, b = two_sequences(tok)
    sequences = [a, b, a + b, a + a]  # the last two share a's tokens: rows with branches
    expected, _ = train.sequence_logprobs(reference, sequences, [2, 2, len(a), len(a)])
    got, _ = train.sequence_logprobs(ours, sequences, [2, 2, len(a), len(a)])
    tolerance = 1e-4 if dtype == torch.float32 else 0.1  # bf16 rounds activations to 3 significant digits
    assert got.dtype == torch.float32 and (got.cpu() - expected).abs().max() < tolerance


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_opd_token_kl_and_its_gradient_equal_the_plain_formula(tiny_model, direction):
    student, _ = M.load(tiny_model)
    g = torch.Generator().manual_seed(0)
    hidden, vocab = student.config.hidden_size, student.config.vocab_size
    student_h, teacher_h = torch.randn(7, hidden, generator=g), torch.randn(7, hidden, generator=g)
    teacher_head = student.lm_head.weight + 0.5 * torch.randn(student.lm_head.weight.shape, generator=g)
    h1, h2 = student_h.clone().requires_grad_(True), student_h.clone().requires_grad_(True)
    got = train.token_kl(student, h1, teacher_h, teacher_head, direction, chunk_logits=3 * vocab)  # uneven chunks
    log_s, log_t = student.lm_head(h2).log_softmax(-1), (teacher_h @ teacher_head.T).log_softmax(-1)
    p, log_p, log_q = (log_t.exp(), log_t, log_s) if direction == "forward" else (log_s.exp(), log_s, log_t)
    expected = (p * (log_p - log_q)).sum(-1)  # KL(p || q) as autograd differentiates it
    assert expected.min() > 0.01 and torch.allclose(got, expected, atol=1e-6)
    weights = torch.linspace(-1.0, 2.0, 7)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6)


def test_micro_batches_put_like_lengths_together_under_the_token_bound():
    lengths = [5, 9, 3, 3, 12, 4, 4, 4]
    # without a bound, --grad-accum alone: that many passes of the sequences, longest first
    assert train.micro_batches(lengths, 1, 0) == [[4, 1, 0, 5, 6, 7, 2, 3]]
    assert train.micro_batches(lengths, 3, 0) == [[4, 1], [0, 5, 6], [7, 2, 3]]
    # a pass holds its rows times its longest row: 12 | 9 5 | 4 4 4 3 | 3 under 18 tokens
    assert train.micro_batches(lengths, 1, 18) == [[4], [1, 0], [5, 6, 7, 2], [3]]
    for bound in range(1, 60):
        passes = train.micro_batches(lengths, 2, bound)
        assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
        assert len(passes) >= 2
        # a sequence longer than the bound runs alone rather than not at all
        assert all(len(p) * lengths[p[0]] <= bound or len(p) == 1 for p in passes)
        assert all(lengths[p[0]] == max(lengths[i] for i in p) for p in passes)
    assert train.micro_batches([], 2, 10) == [] and train.micro_batches([7], 4, 0) == [[0]]


@pytest.mark.parametrize("split", [["--grad-accum", 2], ["--micro-batch-tokens", 1]])
@pytest.mark.parametrize("script", ["sft", "rl", "opd", "opd-logits", "opd-sampled"])
def test_micro_batches_train_the_same_adapter_as_one_batch(tiny_models, data_dir, tmp_path, script, split, monkeypatch):
    tiny_model, main = tiny_models["tied"], MAINS[script.split("-")[0]]
    opd_flags = ["--prompts-per-step", 3, "--max-new-tokens", 6, "--max-steps", 2, "--continuation-tokens", 4, "--lr", 1e-3]
    extra = {"sft": ["--train-limit", 8, "--batch-size", 4, "--lora-dropout", 0, "--max-steps", 2],
             "rl": ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 6, "--max-steps", 2, "--lr", 1e-3],
             "opd": ["--teacher", tiny_model, *opd_flags],
             # another model as the teacher: with the student's own base the KL is zero, and nothing trains
             "opd-logits": ["--teacher", tiny_models["untied"], *opd_flags, "--signal", "logits"],
             "opd-sampled": ["--teacher", tiny_models["untied"], *opd_flags, "--signal", "sampled"]}[script]
    if script != "sft":
        # a random model writes to the token limit every time; cut its completions to unequal
        # lengths, so that micro-batches hold unequal numbers of the step's tokens
        module, plain_generate = (rl, rl.generate) if script == "rl" else (opd, opd.generate)

        def uneven(*args, **kwargs):
            rollouts = plain_generate(*args, **kwargs)
            for i, r in enumerate(rollouts):
                keep = 1 + i % len(r.completion_ids)
                r.completion_ids, r.logprobs = r.completion_ids[:keep], r.logprobs[:keep]
            return rollouts
        monkeypatch.setattr(module, "generate", uneven)
    passes = []  # how many sequences each training pass (a pass with a gradient) runs
    plain_states = train.sequence_states

    def counted_states(model, sequences, *rest):
        if torch.is_grad_enabled():
            passes.append(len(sequences))
        return plain_states(model, sequences, *rest)
    monkeypatch.setattr(train, "sequence_states", counted_states)
    main(common(tiny_model, data_dir, tmp_path / "one", *extra))
    assert len(passes) == 2  # one pass a step: the default bound does not split these small batches
    whole = passes[0]
    passes.clear()
    main(common(tiny_model, data_dir, tmp_path / "split", *extra, *split))
    if split[0] == "--grad-accum":
        assert len(passes) == 4 and max(passes) == -(-whole // 2)
    else:  # a bound below every sequence's length: each sequence in a pass of its own
        assert set(passes) == {1} and len(passes) == 2 * whole
    # the same loss and gradient, each micro-batch weighed by its share of the step's tokens
    la, lb = read_log(tmp_path / "one"), read_log(tmp_path / "split")
    assert len(la) == len(lb) == 2
    assert all(x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7) for x, y in zip(la, lb)), (la, lb)
    assert all(x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5, abs=1e-7) for x, y in zip(la, lb)), (la, lb)
    # Adam moves a parameter by lr g / (|g| + 1e-8): by the whole lr (1e-3) whatever the rounding
    # of g, except where g is within a few hundred times 1e-8, and there rounding shows (in rl's
    # uneven split about 1e-5: a gradient near 8e-8, a sum of nearly cancelling terms rounded
    # otherwise, moved its entry by 0.88 lr)
    a, b = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "split")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)


@pytest.mark.parametrize("script", ["sft", "rl", "opd"])
def test_recompute_trains_the_same_adapter(tiny_model, data_dir, tmp_path, script, monkeypatch):
    main = MAINS[script]
    recomputed_layers = []
    plain_checkpoint = M.checkpoint
    monkeypatch.setattr(M, "checkpoint", lambda fn, *a, **k: (
        recomputed_layers.append(fn) if isinstance(fn, M.DecoderLayer) else None) or plain_checkpoint(fn, *a, **k))
    extra = [*short_run(script, tiny_model), "--max-steps", 2]
    main(common(tiny_model, data_dir, tmp_path / "plain", *extra))
    assert not recomputed_layers
    main(common(tiny_model, data_dir, tmp_path / "recompute", *extra, "--recompute"))
    assert recomputed_layers  # the flag reached the model's training passes
    a, b = adapter_tensors(tmp_path / "plain"), adapter_tensors(tmp_path / "recompute")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)
    assert json.loads((tmp_path / "recompute" / "run.json").read_text())["recompute"] is True


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_zero():
    peak, total = 1e-3, 100
    lr = [train.lr_at(step, total, peak, 0.1) for step in range(total + 1)]  # 10 warmup steps
    assert lr[0] == pytest.approx(peak / 10)  # the first step already learns
    assert lr[4] == pytest.approx(peak / 2) and lr[9] == pytest.approx(peak)
    assert lr[10] == pytest.approx(peak)  # the decay starts from the peak
    assert lr[55] == pytest.approx(peak / 2)  # halfway through the 90 decay steps
    assert lr[100] == pytest.approx(0, abs=1e-18)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert train.lr_at(0, total, peak, 0.0) == peak  # no warmup: the first step at the peak
    assert train.lr_at(1, 2, peak, 0.0) == pytest.approx(peak / 2)


@pytest.mark.parametrize("grad_clip,expected", [(1.0, [-0.6, -0.8]), (10.0, [-3.0, -4.0]), (0.0, [-3.0, -4.0])])
def test_optimizer_step_clips_the_gradient_norm_before_the_step(grad_clip, expected):
    # plain SGD with lr 1, so the update is the gradient as clipped (AdamW would hide the scale)
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([3.0, 4.0])
    lr, grad_norm = train.optimizer_step(optimizer, 0, 10, 1.0, warmup=0.0, grad_clip=grad_clip)
    assert lr == 1.0 and grad_norm == pytest.approx(5.0)  # the norm before clipping, as logged
    assert torch.allclose(p.detach(), torch.tensor(expected)) and p.grad is None


def test_backward_weighs_each_micro_batch_by_its_share_of_the_steps_tokens(monkeypatch):
    """Whatever the split into micro-batches, one step's gradient is the token mean over the
    whole step; under torchrun the mean is over every process's tokens (the gradients are then
    summed by optimizer_step), so each process divides by the step's tokens, not its own."""
    w = torch.ones(2, requires_grad=True)
    sequences, starts = [[0] * 5, [0] * 3, [0] * 9, [0] * 2], [1, 1, 1, 1]  # 4, 2, 8 and 1 trained tokens
    slope = [1.0, 2.0, 3.0, 4.0]  # each sequence's loss per token, per unit of w

    # per token, each sequence's slope and its place in the step: backward hands each pass its share
    slopes = [torch.full((len(s) - st,), slope[i]) for i, (s, st) in enumerate(zip(sequences, starts))]
    places = [torch.full((len(s) - st,), float(i)) for i, (s, st) in enumerate(zip(sequences, starts))]

    def loss_of(seqs, sts, slopes, places):  # summed over the pass's trained tokens, as the scripts' losses are
        part = places.unique_consecutive().long().tolist()
        assert seqs == [sequences[i] for i in part] and len(slopes) == sum(len(s) - st for s, st in zip(seqs, sts))
        return slopes.sum() * w.sum(), {"seen": len(slopes), "places": places}

    mean = (4 * 1.0 + 2 * 2.0 + 8 * 3.0 + 1 * 4.0) / 15
    for grad_accum, bound in ((1, 0), (3, 0), (1, 9), (4, 4)):
        w.grad = None
        loss, metrics, n_tokens = train.backward(loss_of, sequences, starts, train.Passes(grad_accum, bound), slopes=slopes,
                                                 places=places)
        assert n_tokens == 15 and metrics["seen"] == 1.0
        assert sorted(metrics["places"].tolist()) == sorted(torch.cat(places).tolist())  # joined, not summed
        assert loss == pytest.approx(2 * mean) and torch.allclose(w.grad, torch.full((2,), mean))
    # a second process with as many tokens of its own: this one's gradient is half the step's
    monkeypatch.setattr(processes, "summed", lambda *values: [2 * v for v in values])
    w.grad = None
    train.backward(loss_of, sequences, starts, train.Passes(2, 0), slopes=slopes, places=places)
    assert torch.allclose(w.grad, torch.full((2,), mean / 2))
