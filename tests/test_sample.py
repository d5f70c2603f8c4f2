import pytest
import torch
import torch.nn.functional as F

import lora
import model as M
import train
from conftest import randomize_adapter
from sample import Sampling, draw, find_stop, generate, left_pad, tokens_before_stop

PROMPTS = ["Question: Natalia sold clips to 48 of her friends.\nAnswer:", "Question: 3 + 4?\nAnswer:",
           "Question: Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes.\nAnswer:"]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return M.load(tiny_model)


def trained(model, rollouts):
    """The log-probs the training pass (train.sequence_logprobs) gives the rollouts' own tokens."""
    with torch.no_grad():
        logp, _ = train.sequence_logprobs(model, [r.prompt_ids + r.completion_ids for r in rollouts],
                                      [len(r.prompt_ids) for r in rollouts])
    return logp


def sampled(rollouts):
    return torch.tensor([lp for r in rollouts for lp in r.logprobs])


def test_greedy_equals_transformers_generate(tiny_model, loaded):
    from transformers import Qwen3ForCausalLM
    ours, tok = loaded
    ref = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rollouts = generate(ours, tok, PROMPTS, Sampling(max_new_tokens=12, temperature=0))
    ids, mask = left_pad([tok.encode(p) for p in PROMPTS], tok.pad_id)
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                           pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)[:, ids.shape[1]:]
    for r, row in zip(rollouts, out.tolist()):
        assert r.completion_ids == row[:len(r.completion_ids)]
        assert r.finish_reason == "eos" or len(r.completion_ids) == 12


def test_sampled_logprobs_are_the_training_passes_in_fp32(tiny_model):
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    rollouts = generate(ours, tok, PROMPTS, Sampling(n=2, max_new_tokens=10, temperature=1.0, seed=3))
    assert (sampled(rollouts) - trained(ours, rollouts)).abs().max() < 1e-4
    with lora.use_adapter(ours, None):
        assert (trained(ours, rollouts) - sampled(rollouts)).abs().max() > 0.05  # the adapter matters


def bf16_rounds_away(weight, delta):
    return torch.equal((weight.float() + delta).to(torch.bfloat16), weight)


def test_an_update_below_bf16s_spacing_survives_in_the_adapters_own_products_and_nothing_folds_it():
    # every weight of magnitude in (0.5, 1): bf16 spacing 2^-8 everywhere. A rank-1 update of
    # 0.49 of that spacing per entry, signed as a probe input's entries, adds up over the
    # 1,024 inputs to far more than the output's rounding, yet W + delta rounds back to W
    g = torch.Generator().manual_seed(0)
    weight = ((0.51 + 0.48 * torch.rand(8, 1024, generator=g)) * torch.randn(8, 1024, generator=g).sign()).bfloat16()
    x = torch.randn(1, 1024, generator=g).bfloat16()
    layer = torch.nn.Linear(1024, 8, bias=False).bfloat16()
    layer.weight.data = weight
    net = torch.nn.Sequential()
    net.add_module("q_proj", layer)
    lora.add_lora(net, rank=1, alpha=1, targets=("q_proj",))
    adapted = net.q_proj
    with torch.no_grad():
        adapted.lora_A["default"].copy_(x.float().sign())
        adapted.lora_B["default"].fill_(0.49 * 2 ** -8)
    delta = adapted.delta_weight("default")
    assert (delta.abs() < 2 ** -8 / 2).all() and bf16_rounds_away(weight, delta)  # a fold would lose it all
    with torch.no_grad():
        base, trained_output = F.linear(x, weight).float(), adapted(x).float()
        ulp = base.abs().max() * 2 ** -8
        assert ((trained_output - base).abs() > 4 * ulp).all()  # the training pass keeps the update
        with lora.folded(net):  # the sampler's context: bf16 is never folded
            assert adapted.merged is None and torch.equal(adapted(x).float(), trained_output)
        net.float()  # in fp32 the fold keeps the update, and the sampler uses it
        fp32_output = adapted(x.float())
        with lora.folded(net):
            assert adapted.merged == "default" and (adapted(x.float()) - fp32_output).abs().max() < 2e-6 * fp32_output.abs().max()
        assert adapted.merged is None and adapted.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_samples_the_policy_the_training_pass_trains_in_every_dtype(tiny_model, dtype):
    ours, tok = M.load(tiny_model, dtype=dtype)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours, scale=0.3)
    rollouts = generate(ours, tok, PROMPTS, Sampling(n=3, max_new_tokens=12, seed=1))
    gap = (sampled(rollouts) - trained(ours, rollouts)).abs().max().item()
    with lora.use_adapter(ours, None):
        base = generate(ours, tok, PROMPTS, Sampling(n=3, max_new_tokens=12, seed=1))
        noise = (sampled(base) - trained(ours, base)).abs().max().item()  # one policy, two batch shapes
        effect = (trained(ours, rollouts) - sampled(rollouts)).abs().max().item()  # what the adapter changes
    # the sampler and the trainer differ by what the same policy differs by between the two
    # passes (rounding); a bf16 fold of W + BA would add its own rounding to every weight
    bound = 1e-4 if dtype == torch.float32 else 2 * noise
    assert gap <= bound < effect / 4, (gap, noise, effect)


def test_seed_reproduces_and_a_prompts_samples_are_those_of_separate_calls(loaded):
    ours, tok = loaded
    a = generate(ours, tok, PROMPTS, Sampling(n=4, max_new_tokens=16, seed=11))
    b = generate(ours, tok, PROMPTS, Sampling(n=4, max_new_tokens=16, seed=11))
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    c = generate(ours, tok, PROMPTS, Sampling(n=4, max_new_tokens=16, seed=12))
    assert [r.completion_ids for r in a] != [r.completion_ids for r in c]
    # sample j of prompt i draws from seed + i*n + j: one call with n=4 and one prefill per
    # prompt gives what four calls with n=1 give
    for i, prompt in enumerate(PROMPTS):
        for j in range(4):
            alone = generate(ours, tok, [prompt], Sampling(n=1, max_new_tokens=16, seed=11 + i * 4 + j))[0]
            shared = a[i * 4 + j]
            assert (shared.prompt_index, shared.sample_index) == (i, j)
            assert alone.completion_ids == shared.completion_ids
            assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(shared.logprobs), atol=1e-5)


def test_one_prefill_serves_a_prompts_samples(loaded, monkeypatch):
    ours, tok = loaded
    passes, forward = [], ours.forward
    monkeypatch.setattr(ours, "forward", lambda ids, **k: passes.append(tuple(ids.shape)) or forward(ids, **k))
    generate(ours, tok, PROMPTS, Sampling(n=5, max_new_tokens=3, seed=0))
    width = max(len(tok.encode(p)) for p in PROMPTS)
    assert passes[0] == (3, width) and all(shape[1] == 1 for shape in passes[1:])  # 3 prompt rows, then steps


@pytest.mark.parametrize("decode", ["dropping", "fixed"])
def test_prompts_that_open_a_longer_one_read_its_prefill_and_sample_as_alone(loaded, monkeypatch, decode):
    ours, tok = loaded
    long = tok.encode(PROMPTS[2])
    # OPD's cuts of one trajectory (and a repeat), beside a prompt of their own
    prompts = [long[:9], long, tok.encode(PROMPTS[1]), long[:20], long[:9]]
    passes, forward = [], ours.forward
    monkeypatch.setattr(ours, "forward", lambda ids, **k: passes.append(tuple(ids.shape)) or forward(ids, **k))
    for kwargs in (dict(temperature=0), dict(seed=4)):
        passes.clear()
        together = generate(ours, tok, prompts, Sampling(n=2, max_new_tokens=10, **kwargs), decode=decode)
        assert passes[0] == (2, len(long))  # one prefill row for the four openings of long, one for the other
        for r, shared in enumerate(together):
            seed = dict(seed=kwargs["seed"] + r) if "seed" in kwargs else {}
            alone = generate(ours, tok, [prompts[r // 2]], Sampling(max_new_tokens=10, **{**kwargs, **seed}),
                             decode=decode)[0]
            assert (shared.prompt_ids, shared.prompt_index, shared.sample_index) == (prompts[r // 2], r // 2, r % 2)
            assert alone.completion_ids == shared.completion_ids
            assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(shared.logprobs), atol=1e-5)


def test_text_is_cut_at_the_earliest_of_the_stop_strings():
    import data
    # GSM8K's two stop strings both occur here; the blank line before "Question" comes first
    text = "The answer is 12.\n\nQuestion: what next?"
    assert find_stop(text, data.GSM8K_STOP) == text.index("\n\n")
    assert find_stop(text, ("next", "answer")) == text.index("answer")
    assert find_stop(text, ("nowhere",)) == -1 and find_stop(text, ()) == -1


def test_tokens_before_stop_are_those_whose_text_comes_before_it(loaded):
    import data
    _, tok = loaded
    ids = tok.encode(" so 5 + 7 = 12.\n#### 12\n\nQuestion: Tom has")
    kept = tokens_before_stop(tok, ids, data.GSM8K_STOP)
    assert ids[:len(kept)] == kept and tok.decode(kept) == " so 5 + 7 = 12.\n#### 12"[:len(tok.decode(kept))]
    assert len(tok.decode(kept)) >= len(" so 5 + 7 = 12.\n#### 12") - 1  # at most a token that straddles the cut
    assert find_stop(tok.decode(kept), data.GSM8K_STOP) == -1
    assert tokens_before_stop(tok, ids[:5], data.GSM8K_STOP) == ids[:5]  # no stop string: every token


def test_stop_strings_cut_text_and_end_a_row(loaded):
    ours, tok = loaded
    free = generate(ours, tok, PROMPTS, Sampling(max_new_tokens=30, seed=5))
    target = next(r for r in free if len(r.text) > 6)  # a piece of text the model really produces
    stop_string = target.text[3:6]
    stopped = generate(ours, tok, PROMPTS, Sampling(max_new_tokens=30, seed=5, stop=(stop_string,)))
    for f, s in zip(free, stopped):
        assert f.completion_ids[:len(s.completion_ids)] == s.completion_ids  # same samples up to the stop
        if s.finish_reason == "stop":
            assert stop_string not in s.text and stop_string in tok.decode(s.completion_ids)
            assert f.text.startswith(s.text)
    assert stopped[free.index(target)].finish_reason == "stop"


def test_eos_ends_a_row_and_is_kept(loaded):
    ours, tok = loaded
    with torch.no_grad():  # end-of-text the most likely token everywhere
        saved = ours.lm_head.weight[tok.eos_id].clone()
        ours.lm_head.weight[tok.eos_id] = ours.model.norm.weight * 50
        try:
            r = generate(ours, tok, PROMPTS[:1], Sampling(max_new_tokens=8, temperature=0))[0]
        finally:
            ours.lm_head.weight[tok.eos_id] = saved
    assert r.finish_reason == "eos" and r.completion_ids.index(tok.eos_id) == len(r.completion_ids) - 1 < 7


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_draw_equals_softmax_sampling(temperature):
    g = torch.Generator().manual_seed(0)
    logits, uniforms = torch.randn(64, 1000, generator=g) * 3, torch.rand(64, generator=g)
    tokens, logprobs = draw(logits, temperature, uniforms)
    cdf = (logits / temperature).softmax(-1).cumsum(-1)  # inverse CDF of the tempered distribution
    assert torch.equal(tokens, torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:]).squeeze(-1))
    # the recorded log-probs are the model's own: temperature 1
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)
    greedy, greedy_logprobs = draw(logits, 0.0, None)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.allclose(greedy_logprobs, logits.log_softmax(-1).amax(-1), atol=1e-5)


def test_draw_never_picks_a_token_of_weight_zero_even_at_the_ends_of_the_unit_interval():
    tokens, _ = draw(torch.tensor([[-200.0, 0.0, -200.0, 0.0]]).repeat(3, 1), 1.0,
                     torch.tensor([0.0, 0.5, 1 - 2 ** -24]))  # weights that underflow to zero
    assert set(tokens.tolist()) <= {1, 3}
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40_000, 4)
    tokens, _ = draw(logits, 0.5, torch.rand(40_000))
    frequencies = torch.bincount(tokens, minlength=4) / len(tokens)
    assert (frequencies - (logits[0] / 0.5).softmax(-1)).abs().max() < 0.01


# the CUDA graph runs where a GPU is present; the eager fixed-shape loop is the same code
# without the capture, and runs everywhere
FIXED_SHAPE_MODES = ["fixed"] + ([pytest.param("graph", id="cuda-graph")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("mode", FIXED_SHAPE_MODES)
def test_fixed_shape_decode_equals_dropping_finished_rows(tiny_model, loaded, mode):
    ours, tok = loaded if mode == "fixed" else M.load(tiny_model, "cuda", torch.float32)
    free = generate(ours, tok, PROMPTS, Sampling(n=2, max_new_tokens=24, seed=7))
    stop = (next(r for r in free if len(r.text) > 8).text[4:7],)
    for kwargs in (dict(temperature=0), dict(seed=7)):
        dropping = generate(ours, tok, PROMPTS, Sampling(n=2, max_new_tokens=24, stop=stop, **kwargs), decode="dropping")
        fixed = generate(ours, tok, PROMPTS, Sampling(n=2, max_new_tokens=24, stop=stop, **kwargs), decode=mode)
        for d, f in zip(dropping, fixed):
            assert (d.completion_ids, d.finish_reason, d.text) == (f.completion_ids, f.finish_reason, f.text)
            assert torch.allclose(torch.tensor(d.logprobs), torch.tensor(f.logprobs), atol=1e-5)
    # rows that stopped early beside rows that ran to the end: the fixed loop decoded past finished rows
    assert {r.finish_reason for r in fixed} >= {"stop", "length"}


def test_states_decode_overrides_the_default_loop_and_bad_loops_are_named(loaded, monkeypatch):
    ours, tok = loaded
    monkeypatch.setenv("STATES_DECODE", "graph")
    with pytest.raises(ValueError, match="'graph' on CUDA"):  # the variable was read
        generate(ours, tok, PROMPTS, Sampling(max_new_tokens=2))
    monkeypatch.setenv("STATES_DECODE", "fast")
    with pytest.raises(ValueError, match="STATES_DECODE"):
        generate(ours, tok, PROMPTS, Sampling(max_new_tokens=2))
    monkeypatch.setenv("STATES_DECODE", "fixed")
    assert [r.completion_ids for r in generate(ours, tok, PROMPTS, Sampling(max_new_tokens=6, temperature=0))] == \
        [r.completion_ids for r in generate(ours, tok, PROMPTS, Sampling(max_new_tokens=6, temperature=0), decode="dropping")]


def test_an_empty_prompt_is_refused_by_name_and_no_prompts_give_no_rollouts(loaded):
    ours, tok = loaded
    with pytest.raises(ValueError, match="empty prompt: every prompt needs at least one token"):
        generate(ours, tok, [PROMPTS[0], []], Sampling(max_new_tokens=2))
    assert generate(ours, tok, [], Sampling(n=4, max_new_tokens=2)) == []
