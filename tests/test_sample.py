import pytest
import torch

import model as M
import sample
from conftest import randomize_adapter
from sample import draw, filter_logits, find_stop, first_max_index, generate

PROMPTS = ["Question: Natalia sold clips to 48 of her friends.\nAnswer:", "Question: 3 + 4?\nAnswer:",
           "Question: Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes.\nAnswer:"]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return M.load(tiny_model)


def scored(model, rollout):
    """The fp32 log-probs a plain forward pass over prompt + completion gives the rollout's tokens."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logp = model(ids[:, :-1])[0].float().log_softmax(-1)
    return logp[len(rollout.prompt_ids) - 1:].gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)


def test_greedy_equals_transformers_generate(tiny_model, loaded):
    from transformers import Qwen3ForCausalLM
    ours, tok = loaded
    ref = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rollouts = generate(ours, tok, PROMPTS, max_new_tokens=12, temperature=0)
    enc = [tok.encode(p) for p in PROMPTS]
    T = max(map(len, enc))
    ids = torch.tensor([[tok.pad_id] * (T - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in enc])
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                           pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)[:, T:]
    for r, row in zip(rollouts, out.tolist()):
        assert r.completion_ids == row[:len(r.completion_ids)]
        assert r.finish_reason == "eos" or len(r.completion_ids) == 12


def test_logprobs_equal_full_forward(loaded):
    ours, tok = loaded
    for r in generate(ours, tok, PROMPTS, n=2, max_new_tokens=10, temperature=1.0, seed=3):
        assert torch.allclose(torch.tensor(r.logprobs), scored(ours, r), atol=1e-4)


def test_folded_adapter_samples_what_the_adapter_samples(tiny_model):
    import lora
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    base = generate(ours, tok, PROMPTS, n=2, max_new_tokens=10, seed=3, fold_adapter=False, decode="dropping")
    with lora.use_adapter(ours, None):
        plain = generate(ours, tok, PROMPTS, n=2, max_new_tokens=10, seed=3)
    assert [r.completion_ids for r in base] != [r.completion_ids for r in plain]  # the adapter matters
    for decode in ("dropping", "fixed"):
        folded = generate(ours, tok, PROMPTS, n=2, max_new_tokens=10, seed=3, decode=decode)
        assert [r.completion_ids for r in folded] == [r.completion_ids for r in base], decode
        for a, b in zip(folded, base):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4), decode
    assert all(layer.merged is None for layer in lora.lora_layers(ours).values())


@pytest.mark.parametrize("amx", [False, True], ids=["fp32-cache", "bf16-cache"])
def test_bf16_sampling_on_the_cpu_packs_the_folded_weights_and_scores_what_the_adapter_scores(tiny_model,
                                                                                               packed_products,
                                                                                               bf16_packing,
                                                                                               monkeypatch, amx):
    import lora
    monkeypatch.setattr(M, "cpu_has_amx", lambda: amx)  # without AMX the KV cache is fp32 (kv_cache_dtype)
    ours, tok = M.load(tiny_model, dtype="bf16")
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours, scale=0.3)
    calls = packed_products
    for decode in ("dropping", "fixed"):
        calls.clear()
        rollouts = generate(ours, tok, PROMPTS, n=2, max_new_tokens=8, seed=3, decode=decode)
        # prefill and every decode step: four packed products per layer, over the folded weights
        assert len(calls) >= 4 * ours.config.num_hidden_layers * 8, decode
        calls.clear()
        unpacked = [scored(ours, r) for r in rollouts]  # the adapter's own products, nothing folded or packed
        assert calls == []
        error = max((torch.tensor(r.logprobs) - u).abs().max() for r, u in zip(rollouts, unpacked))
        with lora.use_adapter(ours, None):  # how far off the base model would be
            base = [scored(ours, r) for r in rollouts]
        adapter_effect = max((b - u).abs().max() for b, u in zip(base, unpacked))
        # folding rounds W + BA to bf16: 0.09 here with or without packing, 0.02 unfolded
        assert error < 0.15 < 5 * 0.15 < adapter_effect, (decode, error, adapter_effect)
    assert all(layer.self_attn.packed == {} for layer in ours.model.layers)
    assert all(layer.merged is None for layer in lora.lora_layers(ours).values())


def test_seed_reproduces_and_shared_prefill_equals_separate_calls(loaded):
    ours, tok = loaded
    a = generate(ours, tok, PROMPTS, n=4, max_new_tokens=16, seed=11)
    b = generate(ours, tok, PROMPTS, n=4, max_new_tokens=16, seed=11)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    c = generate(ours, tok, PROMPTS, n=4, max_new_tokens=16, seed=12)
    assert [r.completion_ids for r in a] != [r.completion_ids for r in c]
    # sample j of prompt i draws from seed + i*n + j, so one call with n=4 equals four calls with n=1
    for i, prompt in enumerate(PROMPTS):
        for j in range(4):
            alone = generate(ours, tok, [prompt], n=1, max_new_tokens=16, seed=11 + i * 4 + j)[0]
            shared = a[i * 4 + j]
            assert (shared.prompt_index, shared.sample_index) == (i, j)
            assert alone.completion_ids == shared.completion_ids


def test_prompt_groups_gather_consecutive_prompts_with_a_long_common_opening_under_the_longest():
    n = sample.SHARED_PROMPT_MIN
    shots = list(range(100, 100 + n + 4))
    prompts = [shots + [1, 2], shots + [3], shots[:n] + [4, 5], [7] * (n + 3), [7] * (n + 3), shots + [1, 2], shots[:n]]
    # the first three share n tokens or more with the one before; then an identical pair;
    # the last two: a prompt and a prefix of it, as a rollout's cuts are
    assert sample.prompt_groups(prompts) == ([0, 0, 0, 1, 1, 2, 2], [0, 3, 5])
    rollout = list(range(200, 240))
    assert sample.prompt_groups([rollout[:t] for t in (n, n + 5, 40)]) == ([0, 0, 0], [2])
    assert sample.prompt_groups([rollout[:n - 1], rollout]) == ([0, 1], [0, 1])  # one token too few


def prompts_opening_alike(tok):
    """Two 1-shot GSM8K prompts, a prompt of its own, and a rollout cut at three points."""
    import data
    shot = dict(question="Janet has 3 apples and buys 5 more. How many apples does she have?", answer="3 + 5 = 8. #### 8")
    rollout = tok.encode(PROMPTS[1]) + tok.encode(" She earns 12 / 60 = 0.2 a minute")
    return ([data.gsm8k_prompt(q, [shot]) for q in ("What is 2 + 2?", "A pen costs 4 dollars. What do 3 cost?")]
            + [PROMPTS[0]] + [rollout[:t] for t in (len(rollout) - 9, len(rollout) - 4, len(rollout))])


def test_prompts_sharing_a_prefix_prefill_it_once_and_sample_what_each_alone_samples(loaded, monkeypatch):
    ours, tok = loaded
    prompts = prompts_opening_alike(tok)
    first_pass, plain_forward, shared_min = [], ours.forward, sample.SHARED_PROMPT_MIN
    monkeypatch.setattr(ours, "forward", lambda ids, **k: first_pass.append(ids.shape) or plain_forward(ids, **k))
    for decode in ("dropping", "fixed"):
        for kwargs in (dict(temperature=0), dict(n=2, seed=4)):
            first_pass.clear()
            shared = generate(ours, tok, prompts, max_new_tokens=10, decode=decode, **kwargs)
            # the two few-shot prompts, the lone prompt, the rollout's three cuts: one row each
            assert first_pass[0][0] == 3
            monkeypatch.setattr(sample, "SHARED_PROMPT_MIN", 10 ** 6)
            first_pass.clear()
            alone = generate(ours, tok, prompts, max_new_tokens=10, decode=decode, **kwargs)
            assert first_pass[0][0] == len(prompts)
            monkeypatch.setattr(sample, "SHARED_PROMPT_MIN", shared_min)
            for s, a in zip(shared, alone):
                assert (s.prompt_ids, s.completion_ids, s.finish_reason) == (a.prompt_ids, a.completion_ids, a.finish_reason)
                assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(a.logprobs), atol=1e-5)
            for r in shared:  # and they are the model's own log-probs of its tokens
                assert torch.allclose(torch.tensor(r.logprobs), scored(ours, r), atol=1e-4)


def test_decode_steps_read_common_prompts_once_and_sample_what_every_rows_copy_gives(loaded, monkeypatch):
    import torch.nn.functional as F
    ours, tok = loaded
    prompts = prompts_opening_alike(tok)
    groups, plain = [], M.shared_prefix_attention
    monkeypatch.setattr(M, "shared_prefix_attention", lambda *args: groups.append(len(args[-1].groups)) or plain(*args))
    free = generate(ours, tok, prompts, n=2, max_new_tokens=10, seed=4)
    stop = (next(r for r in free if len(r.text) > 8).text[4:7],)
    groups.clear()
    once = generate(ours, tok, prompts, n=2, max_new_tokens=10, seed=4, stop=stop)
    # three groups of prompts, their samples with them, and rows that stopped early leaving them
    assert set(groups) == {3} and {r.finish_reason for r in once} >= {"stop", "length"}
    monkeypatch.setattr(M, "shared_prefix_attention", lambda q, k, v, mask, shared: F.scaled_dot_product_attention(
        q.to(k.dtype), k, v, attn_mask=mask, enable_gqa=True))
    every_copy = generate(ours, tok, prompts, n=2, max_new_tokens=10, seed=4, stop=stop)
    for a, b in zip(once, every_copy):
        assert (a.completion_ids, a.finish_reason) == (b.completion_ids, b.finish_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_text_is_cut_at_the_earliest_of_the_stop_strings():
    import data
    # GSM8K's two stop strings both occur here; the blank line before "Question" comes first
    text = "The answer is 12.\n\nQuestion: what next?"
    assert find_stop(text, data.GSM8K_STOP) == text.index("\n\n")
    assert find_stop(text, ("next", "answer")) == text.index("answer")
    assert find_stop(text, ("nowhere",)) == -1 and find_stop(text, ()) == -1


def test_stop_strings_cut_text_and_finished_rows_stay(loaded):
    ours, tok = loaded
    free = generate(ours, tok, PROMPTS, max_new_tokens=30, seed=5)
    # pick a piece of text the model really produces, and stop on it
    target = next(r for r in free if len(r.text) > 6)
    stop_string = target.text[3:6]
    stopped = generate(ours, tok, PROMPTS, max_new_tokens=30, seed=5, stop=(stop_string,))
    for f, s in zip(free, stopped):
        assert f.completion_ids[:len(s.completion_ids)] == s.completion_ids  # same samples up to the stop
        if s.finish_reason == "stop":
            assert stop_string not in s.text and stop_string in tok.decode(s.completion_ids)
            assert f.text.startswith(s.text)
    assert stopped[free.index(target)].finish_reason == "stop"


def test_eos_ends_a_row_and_is_kept(loaded):
    ours, tok = loaded
    # make end-of-text the most likely token everywhere by biasing the output layer
    with torch.no_grad():
        saved = ours.lm_head.weight[tok.eos_id].clone()
        ours.lm_head.weight[tok.eos_id] = ours.model.norm.weight * 50
        try:
            r = generate(ours, tok, PROMPTS[:1], max_new_tokens=8, temperature=0)[0]
        finally:
            ours.lm_head.weight[tok.eos_id] = saved
    assert r.finish_reason == "eos" and r.completion_ids.index(tok.eos_id) == len(r.completion_ids) - 1 < 7


def test_filter_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    assert not torch.isinf(filter_logits(logits, top_k=2)[0, :2]).any()
    p = logits.softmax(-1)[0]
    kept = ~torch.isinf(filter_logits(logits, top_p=float(p[0]) + 0.01)[0])
    assert kept.tolist() == [True, True, False, False]
    assert (~torch.isinf(filter_logits(logits, top_p=0.01)[0])).sum() == 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 1.0), (1.3, 0, 0.9)])
def test_draw_equals_softmax_sampling(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g) * 3
    uniforms = torch.rand(64, generator=g)
    tokens, logprobs = draw(logits, temperature, top_k, top_p, uniforms)
    # the plain path: normalised probabilities of the tempered, filtered logits, inverse CDF
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    assert torch.equal(tokens, torch.searchsorted(cdf, uniforms[:, None]).squeeze(-1).clamp(max=999))
    # recorded log-probs are the model's own: temperature 1, unfiltered
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)
    greedy, greedy_logprobs = draw(logits, 0.0)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.allclose(greedy_logprobs, logits.log_softmax(-1).amax(-1), atol=1e-5)


def test_draw_never_picks_a_token_of_weight_zero_even_at_the_ends_of_the_unit_interval():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(3, 1)
    # top_k=2 leaves tokens 2 and 3; u = 0, the middle and the largest u below 1
    for top_k, allowed in ((2, {2, 3}), (0, {0, 1, 2, 3})):
        tokens, _ = draw(logits, 1.0, top_k=top_k, uniforms=torch.tensor([0.0, 0.5, 1 - 2 ** -24]))
        assert set(tokens.tolist()) <= allowed
    # weights that underflow to zero after the largest logit is subtracted
    tokens, _ = draw(torch.tensor([[-200.0, 0.0, -200.0, 0.0]]), 1.0, uniforms=torch.tensor([0.0]))
    assert tokens.tolist() == [1]


@pytest.mark.parametrize("vocab", [151_936, 5_000, 2_048, 1_000])
def test_first_max_index_is_argmax_with_ties_nans_and_a_short_last_block(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-5, 3, (6, vocab), generator=g).float()  # many equal maxima in every row
    logits[1, -1] = 10.0  # the maximum in the last (short) block
    logits[2, 0] = 10.0
    logits[3, vocab // 2] = logits[3, vocab // 3] = float("nan")
    logits[4] = 1.0  # all equal
    assert torch.equal(first_max_index(logits), logits.argmax(-1))
    assert torch.equal(first_max_index(logits[:, :vocab - 7]), logits[:, :vocab - 7].argmax(-1))  # strided rows


def test_draw_without_uniforms_follows_the_tempered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40_000, 4)
    tokens, _ = draw(logits, temperature=0.5, top_k=3)
    frequencies = torch.bincount(tokens, minlength=4) / len(tokens)
    expected = torch.tensor([2.0, 1.0, 0.0]).div(0.5).softmax(-1)
    assert frequencies[3] == 0 and (frequencies[:3] - expected).abs().max() < 0.01


# the CUDA graph variant runs where a GPU is present (bench/all.sh's machine); the eager
# fixed-shape loop is the same code minus the capture and runs everywhere
FIXED_SHAPE_MODES = ["fixed"] + ([pytest.param("graph", id="cuda-graph")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("mode", FIXED_SHAPE_MODES)
def test_fixed_shape_decode_equals_dropping_finished_rows(tiny_model, loaded, mode):
    ours, tok = loaded if mode == "fixed" else M.load(tiny_model, device="cuda", dtype=torch.float32)
    free = generate(ours, tok, PROMPTS, n=2, max_new_tokens=24, seed=7, top_p=0.9)
    target = next(r for r in free if len(r.text) > 8)
    stop = (target.text[4:7],)
    for kwargs in (dict(temperature=0), dict(seed=7, top_p=0.9)):
        dropping = generate(ours, tok, PROMPTS, n=2, max_new_tokens=24, stop=stop, decode="dropping", **kwargs)
        fixed = generate(ours, tok, PROMPTS, n=2, max_new_tokens=24, stop=stop, decode=mode, **kwargs)
        for d, f in zip(dropping, fixed):
            assert (d.completion_ids, d.finish_reason, d.text) == (f.completion_ids, f.finish_reason, f.text)
            assert torch.allclose(torch.tensor(d.logprobs), torch.tensor(f.logprobs), atol=1e-5)
    # the sampled run had rows that stopped early beside rows that ran to the end, so the
    # fixed-shape loop really decoded past finished rows
    assert {r.finish_reason for r in fixed} >= {"stop", "length"}
    if mode == "fixed":
        with pytest.raises(ValueError, match="needs a CUDA device"):
            generate(ours, tok, PROMPTS, max_new_tokens=2, decode="graph")


def test_decode_steps_reusing_the_prefills_logits_memory_equal_fresh_logits(tiny_model, bf16_packing, monkeypatch):
    # packed bf16 logits are converted into the prefill's fp32 logits, first rows once rows
    # dropped out; draw writes into one scratch buffer (and never into the logits)
    ours, tok = M.load(tiny_model, dtype="bf16")
    free = generate(ours, tok, PROMPTS, n=2, max_new_tokens=16, seed=5)
    stop = (next(r for r in free if len(r.text) > 8).text[4:7],)
    reused = generate(ours, tok, PROMPTS, n=2, max_new_tokens=16, seed=5, stop=stop)
    plain_logits, plain_draw = ours.next_token_logits, sample.draw
    given = []
    monkeypatch.setattr(ours, "next_token_logits", lambda hidden, out=None: given.append(out) or plain_logits(hidden))
    monkeypatch.setattr(sample, "draw", lambda *args, scratch=None: plain_draw(*args))
    fresh = generate(ours, tok, PROMPTS, n=2, max_new_tokens=16, seed=5, stop=stop)
    assert {r.finish_reason for r in reused} >= {"stop", "length"}  # rows dropped out on the way
    assert len({len(o) for o in given if o is not None}) > 1  # fewer rows of the memory once they did
    for a, b in zip(reused, fresh):
        assert (a.completion_ids, a.logprobs, a.finish_reason) == (b.completion_ids, b.logprobs, b.finish_reason)


def test_garbage_in_the_caches_unwritten_memory_never_reaches_a_sample(loaded, monkeypatch):
    # the cache's memory is not zeroed when made; fixed-shape decoding reads the unwritten
    # positions behind a mask, and a NaN there would turn its attention output into NaN
    ours, tok = loaded
    clean = {decode: generate(ours, tok, PROMPTS, n=2, max_new_tokens=6, seed=1, decode=decode)
             for decode in ("dropping", "fixed")}
    new_cache = ours.new_cache

    def nan_filled(*args, **kwargs):
        cache = new_cache(*args, **kwargs)
        for t in cache.k_memory + cache.v_memory:
            t.fill_(float("nan"))
        return cache
    monkeypatch.setattr(ours, "new_cache", nan_filled)
    for decode, rollouts in clean.items():
        dirty = generate(ours, tok, PROMPTS, n=2, max_new_tokens=6, seed=1, decode=decode)
        assert [(r.completion_ids, r.logprobs) for r in dirty] == [(r.completion_ids, r.logprobs) for r in rollouts]


def test_draw_into_a_scratch_buffer_draws_what_a_new_one_draws_and_leaves_the_logits():
    g = torch.Generator().manual_seed(0)
    logits, uniforms = torch.randn(6, 50, generator=g) * 3, torch.rand(6, generator=g)
    kept = logits.clone()
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 0.9)):
        new = draw(logits, temperature, top_k, top_p, uniforms)
        reused = draw(logits, temperature, top_k, top_p, uniforms, scratch=torch.full_like(logits, float("nan")))
        assert all(torch.equal(a, b) for a, b in zip(new, reused)), (temperature, top_k, top_p)
        assert torch.equal(logits, kept)


def test_states_decode_overrides_the_default_loop(loaded, monkeypatch):
    ours, tok = loaded
    monkeypatch.setenv("STATES_DECODE", "graph")
    with pytest.raises(ValueError, match="needs a CUDA device"):  # the variable was read
        generate(ours, tok, PROMPTS, max_new_tokens=2)
    monkeypatch.setenv("STATES_DECODE", "fast")
    with pytest.raises(ValueError, match="STATES_DECODE"):
        generate(ours, tok, PROMPTS, max_new_tokens=2)
    monkeypatch.setenv("STATES_DECODE", "fixed")
    assert [r.completion_ids for r in generate(ours, tok, PROMPTS, max_new_tokens=6, temperature=0)] == \
        [r.completion_ids for r in generate(ours, tok, PROMPTS, max_new_tokens=6, temperature=0, decode="dropping")]


def test_an_empty_prompt_is_refused_by_name_and_no_prompts_give_no_rollouts(loaded):
    ours, tok = loaded
    with pytest.raises(ValueError, match="empty prompt: every prompt needs at least one token"):
        generate(ours, tok, [PROMPTS[0], []], max_new_tokens=2)
    assert generate(ours, tok, [], n=4, max_new_tokens=2) == []  # it stopped with max()'s ValueError
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\), expected \(1, 2\)"):
        ours(torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 3))
