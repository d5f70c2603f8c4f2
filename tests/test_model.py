import argparse
import copy
import errno
import json
import os
import re
import shutil
import sys

import pytest
import torch

import data
import model as M
from conftest import (DEVICES, ONEDNN_MISSING, PACKED_AS, SHARED_CONFIG, TINY_CONFIGS, pack_bf16_as, randomize_adapter,
                      save_hf_model)


def every_fp32_weight_to_onednn(monkeypatch):
    """fp32 products as an AMD CPU multiplies Qwen3-0.6B's weights (oneDNN's, row-major),
    for the tiny test models' weights too."""
    monkeypatch.setattr(M, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(M, "ONEDNN_MIN_WEIGHT", 0)


def hf_model(folder):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def two_sequences(tok):
    a = tok.encode("Question: Janet has 3 apples and buys 5 more. How many?\nAnswer:")
    b = tok.encode("Question: 2 + 2?\nAnswer:")
    return a, b


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_match_transformers(tiny_models, name):
    ours, tok = M.load(tiny_models[name])
    ref = hf_model(tiny_models[name])
    a, b = two_sequences(tok)
    ids, mask = M.left_pad([a, b], tok.pad_id)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
        # the real positions of each row are what matter; padding positions carry no meaning
        assert (got - expected)[mask.bool()].abs().max() < 1e-4
        full = ours(torch.tensor([a]))
        assert (full - ref(input_ids=torch.tensor([a])).logits).abs().max() < 1e-4


def test_sharded_checkpoint_loads(workdir, tokenizer_path, tiny_model):
    folder = save_hf_model(str(workdir / "sharded"), tokenizer_path, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    ours, tok = M.load(folder)
    ids = torch.tensor([tok.encode("Answer: 42")])
    with torch.no_grad():
        assert (ours(ids) - hf_model(folder)(input_ids=ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_kv_cache_and_left_padding(tiny_models, name):
    ours, tok = M.load(tiny_models[name])
    a, b = two_sequences(tok)
    with torch.no_grad():
        full = ours(torch.tensor([a]))
        cache = ours.new_cache(1, len(a))
        # a chunk of several tokens after cached ones attends causally among its own tokens
        steps = [ours(torch.tensor([a[:5]]), cache=cache), ours(torch.tensor([a[5:8]]), cache=cache)]
        steps += [ours(torch.tensor([[t]]), cache=cache) for t in a[8:]]
        assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4
        with pytest.raises(ValueError, match="KV cache full"):
            ours(torch.tensor([a[:1]]), cache=cache)
        ids, mask = M.left_pad([a, b], tok.pad_id)
        batch = ours(ids, attention_mask=mask)
        alone_b = ours(torch.tensor([b]))
        assert (batch[1, -len(b):] - alone_b[0]).abs().max() < 1e-4
        assert (batch[0] - full[0]).abs().max() < 1e-4
        # padded prefill then token-by-token decode with the mask
        cache = ours.new_cache(2, ids.shape[1] + 3)
        ours(ids, attention_mask=mask, cache=cache)
        nxt = torch.tensor([[7], [9]])
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        step = ours(nxt, attention_mask=mask2, cache=cache)
        ref_b = ours(torch.tensor([b + [9]]))[0, -1]
        assert (step[1, -1] - ref_b).abs().max() < 1e-4


def attend_under_the_mask(runs, q, k, v, gqa):
    """RowRuns.attend as off the CPU: one attention call under the dense mask of the runs."""
    return M.attend(q, k, v, runs.dense()[:, None], gqa)


def test_attention_by_query_blocks_equals_one_pass_over_every_key(tiny_model, monkeypatch):
    # a long masked pass attends by blocks of queries, each over the keys up to its last
    # one (model.attend); here blocks of 4, so that the test's short sequences take them
    import torch.nn.functional as F
    import lora
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours)
    a, b = two_sequences(tok)
    ids, mask = M.left_pad([a, b], tok.pad_id)
    sequences = [a, b, a[:9], b[:5]]  # the short ones share a row: a mask of who sees whom
    plain_sdpa, queries = F.scaled_dot_product_attention, []
    monkeypatch.setattr(M.F, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: queries.append(q.shape[2]) or plain_sdpa(q, *args, **kwargs))

    def passes():
        with torch.no_grad():
            padded = ours(ids, attention_mask=mask)
            cache = ours.new_cache(2, ids.shape[1])
            ours(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
            after_cache = ours(ids[:, 5:], attention_mask=mask, cache=cache)  # queries after cached keys
        ours.zero_grad()
        with monkeypatch.context() as patch:  # a training pass under a mask, as off the CPU, not run by run
            patch.setattr(M.RowRuns, "attend", attend_under_the_mask)
            logp, _ = M.sequence_logprobs(ours, sequences, [1] * len(sequences))
        logp.sum().backward()
        return padded, after_cache, logp.detach(), [p.grad.clone() for p in lora.lora_parameters(ours)]

    whole = passes()
    assert ids.shape[1] in queries and 4 not in queries
    queries.clear()
    monkeypatch.setattr(M, "QUERY_BLOCK", 4)
    blocked = passes()
    # the 5-token prefill stays whole (fewer than two blocks); the longer passes go by blocks
    assert max(queries) == 5 and queries.count(4) >= 3 * 3 * ours.config.num_hidden_layers
    for x, y in zip(whole[:3], blocked[:3]):
        assert (x - y).abs().max() < 1e-5
    for x, y in zip(whole[3], blocked[3]):
        assert (x - y).abs().max() <= 1e-5 * x.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_run_by_run_equals_attention_under_the_mask_of_who_sees_whom(dtype, monkeypatch):
    """On the CPU a training row attends run by run (model.RowRuns), each run of a
    sequence's own tokens over its prefix's columns and itself: values and gradients as
    one attention call under the dense mask of the same layout, through a run without a
    prefix, runs on a prompt's columns, a prefix through two runs, and padding."""
    import torch.nn.functional as F
    n = M.SHARED_PREFIX_MIN
    prompt, x, y = list(range(100, 100 + n)), list(range(200, 230)), list(range(300, 320))
    sequences = [prompt + x,  # laid out first, the longest
                 prompt + x[:4] + y,  # a run on the prompt and x's first tokens: contiguous
                 prompt + x[:4] + y[:10] + [7, 8, 9],  # its prefix runs through the two runs above
                 prompt + [5, 5, 5],
                 list(range(400, 425))]  # shares nothing: its run sees itself alone
    rows, placed = M.pack_rows(sequences, row_tokens=200)
    L = len(rows[0]) + 3  # three columns of padding
    runs = M.RowRuns(sequences, placed, len(rows), L)
    # in column order: sequences 0, 1, 2, 4, 3 (longest first), then the padding
    assert len(rows) == 1 and [len(p) > 0 for _, _, p in runs.runs[0]] == [False, True, True, False, True, False]
    assert runs.runs[0][2][2] == placed[2][1][:n + 14]  # the prefix of sequence 2: through two runs
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, L, 8, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 2, L, 8, generator=g).to(dtype).requires_grad_() for _ in range(2))
    visible = runs.dense()
    for b, (r, columns) in enumerate(placed):  # each sequence's tokens see its earlier tokens alone
        for i, c in enumerate(columns):
            assert visible[r, c].nonzero().flatten().tolist() == sorted(columns[:i + 1])
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible[:, None], enable_gqa=True)
    expected_grads = torch.autograd.grad(expected[:, :, :len(rows[0])].square().sum(), (q, k, v))
    calls = []
    plain_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(M.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((q.shape[2], k.shape[2], kw.get("is_causal", False)))
                        or plain_sdpa(q, k, v, **kw))
    got = M.attend(q, k, v, runs, gqa=True)
    grads = torch.autograd.grad(got[:, :, :len(rows[0])].float().square().sum(), (q, k, v))
    # a query reads the keys it sees alone: the prefix's and its run's; a run without a prefix by the causal kernel
    assert calls == [(hi - lo, len(prefix) + hi - lo, not prefix) for lo, hi, prefix in runs.runs[0]]
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got[:, :, :len(rows[0])].float() - expected[:, :, :len(rows[0])]).abs().max() < bound
    for x, y in zip(grads, expected_grads):
        assert (x.float() - y).abs().max() < bound * 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_shared_columns_once_per_group_equals_attention_over_every_rows_copy(dtype):
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    rows, heads, kv, d, width, length = 6, 4, 2, 8, 7, 12
    group = [0, 0, 1, 1, 1, 2]  # the last row alone in its group
    k, v = (torch.randn(rows, kv, length, d, generator=g).to(dtype) for _ in range(2))
    for t in (k, v):
        for r, source in enumerate(group):  # a group's rows hold copies of its first row's columns
            t[r, :, :width] = t[group.index(source), :, :width]
    q = torch.randn(rows, heads, 1, d, generator=g).to(dtype)
    mask = torch.rand(rows, 1, 1, length, generator=g) > 0.3  # some shared columns masked for some rows
    mask[:, :, :, -1] = True
    mask[1, :, :, width:] = False  # a row that sees shared columns only
    mask[2, :, :, :width] = False  # and one that sees none
    shared = M.SharedColumns(width, group)
    got = M.shared_prefix_attention(q, k, v, mask, shared)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert got.dtype == torch.float32 and (got - expected).abs().max() < 1e-5
    # the columns are read from each group's first row alone: the others' copies do not count
    for t in (k, v):
        t[[1, 3, 4], :, :width] = float("nan")
    assert torch.equal(M.shared_prefix_attention(q, k, v, mask, shared), got)
    assert shared.any_shared and not M.SharedColumns(width, range(rows)).any_shared
    assert shared.pay(3 * width - 1) and not shared.pay(3 * width)  # shared columns more than a third
    assert not M.SharedColumns(width, range(rows)).pay(width)


@pytest.mark.parametrize("batch, index, in_place", [
    (3, [0, 0, 1, 1, 2, 2], True),  # repeating prompts for their samples: from the last row back
    (6, [0, 5, 2, 4], True),  # rows 1 and 3 left out, their places taken by the last rows kept
    (6, [1, 3, 4], True),  # rows left out, the rest kept in order: from the first row on
    (6, [2, 1, 0], False),  # rows 0 and 2 swapped: either order overwrites one before reading it
    (3, [0, 0, 0, 1, 1, 1, 2], False),  # more rows than the memory holds
])
def test_select_rows_gives_each_row_its_source_rows_written_positions(batch, index, in_place):
    config = argparse.Namespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=4)
    cache = M.KVCache(config, batch, max_len=9, device="cpu", dtype=torch.float32, rows=6)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        cache.update(layer, torch.randn(batch, 2, 5, 4, generator=g), torch.randn(batch, 2, 5, 4, generator=g))
    cache.length = 5
    expected = [t[:, :, :5].index_select(0, torch.tensor(index)) for t in cache.k + cache.v]
    memory = cache.k_memory[0].data_ptr()
    cache.select_rows(torch.tensor(index))
    assert all(t.shape == (len(index), 2, 9, 4) for t in cache.k + cache.v)
    assert all(torch.equal(t[:, :, :5], e) for t, e in zip(cache.k + cache.v, expected))
    assert (cache.k_memory[0].data_ptr() == memory) == in_place


@pytest.mark.parametrize("amx", [False, True], ids=["fp32-cache", "bf16-cache"])
def test_bf16_decoding_over_the_cache_is_as_close_to_fp32_as_the_full_pass(tiny_model, monkeypatch, amx):
    # bf16 on a CPU without AMX keeps the cache in fp32 and attends over it in fp32 (kv_cache_dtype)
    monkeypatch.setattr(M, "cpu_has_amx", lambda: amx)
    ours, tok = M.load(tiny_model, dtype="bf16")
    exact = copy.deepcopy(ours).float()  # the same bf16 weights, computed in fp32
    a, b = two_sequences(tok)
    ids, mask = M.left_pad([a, b], tok.pad_id)
    new = torch.tensor([[7, 11, 13, 17], [9, 10, 12, 14]])
    with torch.no_grad():
        cache = ours.new_cache(2, ids.shape[1] + new.shape[1])
        assert cache.k[0].dtype == cache.v[0].dtype == (torch.bfloat16 if amx else torch.float32)
        steps = [ours(ids, attention_mask=mask, cache=cache)]
        for i in range(new.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            steps.append(ours(new[:, i:i + 1], attention_mask=mask, cache=cache))
        cached = torch.cat(steps, 1)
        full = ours(torch.cat([ids, new], 1), attention_mask=mask)
        reference = exact(torch.cat([ids, new], 1), attention_mask=mask)
    assert cached.dtype == full.dtype == torch.bfloat16
    real = mask.bool()
    error, full_error = ((x.float() - reference)[real].abs().max() for x in (cached, full))
    # a few bf16 roundings of logits of this size, as the plain pass has; a position or
    # conversion gone wrong would be off by the logits' own size
    assert error <= max(2 * full_error, 2 ** -6 * reference.abs().max()), (error, full_error)


def test_token_logprobs_equal_log_softmax(tiny_model):
    ours, tok = M.load(tiny_model)
    ids = torch.tensor([tok.encode("Question: what is 6 times 7?\nAnswer: 42")])
    hidden = ours(ids[:, :-1], hidden_only=True)[0]
    targets = ids[0, 1:]
    expected = ours(ids[:, :-1])[0].log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    got = ours.token_logprobs(hidden, targets, chunk_size=3)
    assert torch.allclose(got, expected, atol=1e-5)
    # both gradient paths equal plain autograd, under an uneven upstream gradient: the frozen
    # output layer (HeadLogprob) and the trainable one (checkpointed chunks, weight grad too)
    weights = torch.linspace(-1.0, 2.0, len(targets))
    for trainable_head in (False, True):
        ours.lm_head.weight.requires_grad_(trainable_head)
        h1 = hidden.detach().requires_grad_(True)
        (ours.token_logprobs(h1, targets, chunk_size=4) * weights).sum().backward()
        w_grad = ours.lm_head.weight.grad
        ours.lm_head.weight.grad = None
        h2 = hidden.detach().requires_grad_(True)
        (ours.lm_head(h2).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1) * weights).sum().backward()
        assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
        if trainable_head:
            assert torch.allclose(w_grad, ours.lm_head.weight.grad, atol=1e-5)
        ours.lm_head.weight.grad = None
    ours.lm_head.weight.requires_grad_(False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", pytest.param("fp32-onednn", marks=pytest.mark.skipif(
    not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING))])
@pytest.mark.parametrize("vocab_slice", [4096, 96])
def test_frozen_head_logprobs_equal_log_softmax_in_both_dtypes(tiny_model, dtype, vocab_slice, monkeypatch,
                                                              onednn_products):
    # with the output layer frozen (LoRA): no gradient, and HeadLogprob's value and gradient
    # formed in the forward pass, over uneven chunks (4, 4, ..., fewer) and either the whole
    # vocabulary (400) in one slice or slices of 96 (the last one 16), where the running max
    # and sums are rescaled; fp32-onednn: the products as an AMD CPU takes Qwen3-0.6B's
    monkeypatch.setattr(M, "VOCAB_SLICE", vocab_slice)
    by_onednn = dtype == "fp32-onednn"
    if by_onednn:
        every_fp32_weight_to_onednn(monkeypatch)
        dtype = "fp32"
    ours, tok = M.load(tiny_model, dtype=dtype)
    ours.requires_grad_(False)
    ids = torch.tensor([tok.encode("Question: what is 6 times 7?\nAnswer: 42")])
    targets = ids[0, 1:]
    with torch.no_grad():
        hidden = ours(ids[:, :-1], hidden_only=True)[0]
    assert len(targets) % 4 != 0
    def reference(h):  # the logits of the same product, then log-softmax in fp32
        return torch.nn.functional.linear(h, ours.lm_head.weight).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        expected = reference(hidden)
        assert torch.allclose(ours.token_logprobs(hidden, targets, chunk_size=4), expected, atol=1e-5)
    weights = torch.linspace(-1.0, 2.0, len(targets))
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    onednn_products.clear()
    got = ours.token_logprobs(h1, targets, chunk_size=4)
    assert bool(onednn_products) == by_onednn  # the output layer's products
    with torch.no_grad():  # the values of a pass without a gradient, to the bit
        assert torch.equal(got.detach(), ours.token_logprobs(hidden, targets, chunk_size=4))
    (got * weights).sum().backward()
    (reference(h2) * weights).sum().backward()
    # bf16: the softmax is rounded to bf16 before its product with W
    tolerance = 1e-5 if dtype == "fp32" else 2e-2 * h2.grad.abs().max().item()
    assert h1.grad.dtype == hidden.dtype and (h1.grad.float() - h2.grad.float()).abs().max() <= tolerance


def test_official_config_loads_with_its_values():
    config = M.read_config(SHARED_CONFIG)
    with open(os.path.join(SHARED_CONFIG, "config.json")) as f:
        raw = json.load(f)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                  "max_position_embeddings", "attention_bias"):
        assert getattr(config, field) == raw[field], field
    assert config.rope_theta == 1e6 and config.tie_word_embeddings and config.head_dim == 128
    assert config.eos_token_id == 151643
    with torch.device("meta"):
        model = M.Qwen3(config)
    assert round(M.num_parameters(model) / 1e6) == 596


def test_transformers5_config_style(workdir):
    with open(os.path.join(SHARED_CONFIG, "config.json")) as f:
        raw = json.load(f)
    theta = raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    assert M.Qwen3Config.from_dict(raw).rope_theta == theta
    del raw["rope_parameters"]
    with pytest.raises(ValueError, match="missing field.*rope_theta"):
        M.Qwen3Config.from_dict(raw)


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear"}}, "rope type 'linear' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported; set it to false"),
    ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe'; this file implements 'qwen3' only"),
])
def test_configs_of_other_models_are_refused_by_name(change, message):
    with open(os.path.join(SHARED_CONFIG, "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(M.InputError, match=message):
        M.Qwen3Config.from_dict({**raw, **change})
    # the official config passes, and of several stop ids the first is end-of-text
    assert M.Qwen3Config.from_dict({**raw, "eos_token_id": [7, 9]}).eos_token_id == 7


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_inputs_give_one_line_errors(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    no_config = copy_model(tiny_model, tmp_path / "no_config")
    os.remove(os.path.join(no_config, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        M.load(no_config)

    missing = copy_model(tiny_model, tmp_path / "missing")
    path = os.path.join(missing, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path)
    with pytest.raises(M.InputError, match=r"model.layers.1.mlp.up_proj.weight is missing"):
        M.load(missing)

    shape = copy_model(tiny_model, tmp_path / "shape")
    path = os.path.join(shape, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(state, path)
    with pytest.raises(M.InputError, match=r"k_proj.weight has shape \(3, 3\)") as e:
        M.load(shape)
    assert "\n" not in str(e.value)

    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub id"):
        M.load(str(tmp_path / "does" / "not" / "exist"))

    extra = copy_model(tiny_model, tmp_path / "extra")
    path = os.path.join(extra, "model.safetensors")
    save_file({**load_file(path), "model.layers.0.mlp.experts.0.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(M.InputError, match=r"unexpected tensor model.layers.0.mlp.experts.0.weight \(1 in all\); "
                                           r"is this a Qwen3 checkpoint\?"):
        M.load(extra)

    no_weights = copy_model(tiny_model, tmp_path / "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json; the weights"):
        M.load(no_weights)

    no_tokenizer = copy_model(tiny_model, tmp_path / "no_tokenizer")
    os.remove(os.path.join(no_tokenizer, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json; the model folder needs the tokenizer file too"):
        M.load(no_tokenizer)

    # damaged files: a download cut short, a config edited by hand
    cut_short = copy_model(tiny_model, tmp_path / "cut_short")
    path = os.path.join(cut_short, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(M.InputError, match=r"cut_short/model.safetensors is not a readable safetensors file \(.*\); the "
                                           r"file is damaged") as e:
        M.load(cut_short)
    assert "\n" not in str(e.value)
    edited = copy_model(tiny_model, tmp_path / "edited")
    with open(os.path.join(edited, "config.json"), "a") as f:
        f.write(",")
    with pytest.raises(M.InputError, match=r"edited/config.json is not valid JSON \(Extra data: .*\); the file is damaged"):
        M.load(edited)
    with open(os.path.join(no_tokenizer, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    with pytest.raises(M.InputError, match=r"no_tokenizer/tokenizer.json is not a readable tokenizer \(.*\); the file is"):
        M.load(no_tokenizer)

    no_eos = copy_model(tiny_model, tmp_path / "no_eos")
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(no_eos, name)
        if os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            config.pop("eos_token_id", None)
            with open(path, "w") as f:
                json.dump(config, f)
    with pytest.raises(M.InputError, match="no eos_token_id in generation_config.json or config.json; add it"):
        M.load(no_eos)

    ours, _ = M.load(tiny_model)
    hidden = torch.randn(3, ours.config.hidden_size)
    for bad in (-100, ours.config.vocab_size):  # an ignore label; one past the vocabulary
        with pytest.raises(ValueError, match=r"target ids must lie in \[0, 400\)") as e:
            ours.token_logprobs(hidden, torch.tensor([1, bad, 2]))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"token_kl: student states \(3, 64\) and teacher states \(2, 64\) differ"):
        ours.token_kl(hidden, hidden[:2])
    with pytest.raises(ValueError, match="direction 'backward' is neither 'reverse'"):
        ours.token_kl(hidden, hidden, "backward")


def test_number_flags_name_the_bound_and_the_reason(capsys):
    p = argparse.ArgumentParser(prog="script.py")
    p.add_argument("--n", type=M.number(int, 2, why="a pair needs two"))
    p.add_argument("--lr", type=M.number(float, 0, above=True))
    p.add_argument("--p", type=M.number(float, 0, below=1))
    assert vars(p.parse_args(["--n", "2", "--lr", "1e-4", "--p", "0"])) == {"n": 2, "lr": 1e-4, "p": 0.0}
    for argv, message in ((["--n", "1"], "argument --n: must be at least 2, got 1: a pair needs two"),
                          (["--n", "2.5"], "argument --n: '2.5' is not a whole number"),
                          (["--lr", "0"], "argument --lr: must be above 0, got 0"),
                          (["--lr", "nan"], "argument --lr: must be above 0, got nan"),
                          (["--p", "1"], "argument --p: must be at least 0 and below 1, got 1")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_run_script_ends_input_errors_in_one_line_and_keeps_tracebacks_for_bugs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["script.py", "--flag"])
    seen = []
    M.run_script(seen.append)
    assert seen == [["--flag"]]

    def broken_file(argv):
        raise M.InputError("x.json: not JSON; fix it")
    with pytest.raises(SystemExit, match=r"^error: x.json: not JSON; fix it$"):
        M.run_script(broken_file)
    with pytest.raises(SystemExit, match=r"^error: data folder .*nowhere does not exist"):  # data.DataError is one too
        M.run_script(lambda argv: data.resolve_data_dir("/nowhere"))

    def bug(argv):
        raise ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        M.run_script(bug)

    def too_big(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nIf reserved but unallocated ...")
    with pytest.raises(SystemExit) as e:
        M.run_script(too_big, "rerun with a smaller --batch-size")
    assert e.value.code == ("error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.); "
                            "rerun with a smaller --batch-size")

    def too_big_for_the_cpu(argv):  # a real allocation the CPU's allocator refuses (a pebibyte)
        torch.empty(2 ** 50, dtype=torch.uint8)
    with pytest.raises(SystemExit) as e:
        M.run_script(too_big_for_the_cpu, "rerun with a smaller --batch-size")
    assert re.fullmatch(r"error: the CPU ran out of memory \(can't allocate memory: you tried to allocate "
                        r"1125899906842624 bytes\..*\); rerun with a smaller --batch-size", e.value.code), e.value.code

    def disk_full(argv):  # what an evaluation's or drift's write meets on a full disk
        raise OSError(errno.ENOSPC, "No space left on device", "out/stress/eval.json.tmp42")
    with pytest.raises(SystemExit) as e:
        M.run_script(disk_full)
    assert e.value.code == ("error: could not write out/stress/eval.json.tmp42 (No space left on device); make room, "
                            "then run it again")

    def not_ours(argv):  # --out in a folder the user cannot write to
        raise PermissionError(errno.EACCES, "Permission denied", "/shared/out/stress")
    with pytest.raises(SystemExit) as e:
        M.run_script(not_ours)
    assert e.value.code == ("error: /shared/out/stress: Permission denied; check its permissions, or pass a folder you "
                            "can write to")

    def broken_disk(argv):
        raise OSError(errno.EIO, "Input/output error", "out/stress/eval.json")
    with pytest.raises(OSError, match="Input/output error"):  # neither: its traceback stays
        M.run_script(broken_disk)

    def other_runtime_error(argv):
        raise RuntimeError("shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # a bug: its traceback stays
        M.run_script(other_runtime_error)


def test_a_hub_id_that_cannot_be_fetched_is_a_one_line_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Cannot reach the hub.\nCheck your internet connection\n  and try again.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(M.InputError, match=r"could not fetch 'Qwen/Qwen3-0.6B-Base' .*Cannot reach the hub. Check your "
                                           r"internet connection and try again.*no local folder of that name"
                                           r".*pass its folder with --model") as e:
        M.model_folder("Qwen/Qwen3-0.6B-Base")
    assert "\n" not in str(e.value)
    with pytest.raises(M.InputError, match=r"could not fetch 'out/stres'.*pass its folder with --teacher$"):
        M.model_folder("out/stres", "--teacher")


def test_a_device_that_is_not_there_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(M.InputError, match="--device cuda, but torch finds no CUDA device"):
        M.resolve_device("cuda")
    with pytest.raises(M.InputError, match="--device 'gpu' is not a device"):
        M.resolve_device("gpu")
    with pytest.raises(M.InputError, match="--dtype 'fp8' is not a dtype"):
        M.resolve_device("cpu", "fp8")
    assert M.resolve_device(None) == (torch.device("cpu"), torch.float32)
    # $STATES_DEVICE stands in for a missing --device, and is named when it is wrong
    monkeypatch.setenv("STATES_DEVICE", "cuda")
    with pytest.raises(M.InputError, match=r"\$STATES_DEVICE cuda, but torch finds no CUDA device.*unset \$STATES_DEVICE"):
        M.resolve_device(None)
    assert M.resolve_device("cpu") == (torch.device("cpu"), torch.float32)  # --device wins
    monkeypatch.setenv("STATES_DEVICE", "gpu")
    with pytest.raises(M.InputError, match=r"\$STATES_DEVICE 'gpu' is not a device"):
        M.resolve_device(None)


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_cpu_has_bf16_reads_the_cpus_own_flags():
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert M.cpu_has_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads the CPU's flags from Linux's /proc/cpuinfo")
def test_cpu_has_amx_reads_the_cpus_own_flags():
    with open("/proc/cpuinfo") as f:
        flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert M.cpu_has_amx() == ("amx_tile" in flags)


def test_bf16_on_a_cpu_without_bf16_instructions_gets_a_note(monkeypatch, capsys):
    args = argparse.Namespace(device="cpu", dtype="bf16")
    for has_bf16, dtype in ((False, "bf16"), (True, "bf16"), (False, None)):
        monkeypatch.setattr(M, "cpu_has_bf16", lambda: has_bf16)
        args.dtype = dtype
        M.device_from_args(args)
        noted = "no bf16 instructions" in capsys.readouterr().out
        assert noted == (dtype == "bf16" and not has_bf16)


@pytest.mark.parametrize("products", ["plain", pytest.param("onednn", marks=pytest.mark.skipif(
    not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING))])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("head, vocab_slice", [("trainable", 4096), ("frozen", 4096), ("frozen", 96)])
def test_token_kl_value_and_gradient(tiny_model, direction, head, vocab_slice, products, monkeypatch,
                                    onednn_products):
    # a trainable output layer takes checkpointed chunks; a frozen one (LoRA), and any pass
    # without a gradient, HeadKL over the whole 400-token vocabulary or slices of 96
    monkeypatch.setattr(M, "VOCAB_SLICE", vocab_slice)
    if products == "onednn":  # row-major vocabulary slices included
        every_fp32_weight_to_onednn(monkeypatch)
    ours, tok = M.load(tiny_model)
    ours.lm_head.weight.requires_grad_(head == "trainable")
    ids = torch.tensor([tok.encode("Question: what is 6 times 7?\nAnswer: 42")])
    with torch.no_grad():
        hs = ours(ids, hidden_only=True)[0]
    ht = hs.roll(1, 0)  # another distribution at every position
    h1 = hs.clone().requires_grad_(True)
    onednn_products.clear()
    got = ours.token_kl(h1, ht, direction, chunk_size=3)
    assert bool(onednn_products) == (products == "onednn")  # the output layer's products
    h2 = hs.clone().requires_grad_(True)
    ls, lt = ours.lm_head(h2).log_softmax(-1), ours.lm_head(ht).log_softmax(-1)
    expected = (ls.exp() * (ls - lt)).sum(-1) if direction == "reverse" else (lt.exp() * (lt - ls)).sum(-1)
    assert torch.allclose(got, expected, atol=1e-5) and (got > 0).all()
    with torch.no_grad():
        assert torch.allclose(ours.token_kl(hs, ht, direction, chunk_size=3), expected, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    h3 = hs.clone().requires_grad_(True)
    same = ours.token_kl(h3, hs, direction)
    same.sum().backward()
    assert (same == 0).all() and (h3.grad == 0).all()  # exactly, not approximately


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
def test_token_kl_reads_teacher_states_with_the_teachers_own_output_layer(tiny_models, direction, head, monkeypatch):
    # a teacher of another width and output layer (the same vocabulary): its states go
    # through its own layer, the student's through the student's
    monkeypatch.setattr(M, "VOCAB_SLICE", 96)
    student, tok = M.load(tiny_models["tied"])
    teacher, _ = M.load(tiny_models["untied"])
    student.lm_head.weight.requires_grad_(head == "trainable")
    ids = torch.tensor([tok.encode("Question: what is 6 times 7?\nAnswer: 42")])
    with torch.no_grad():
        hs, ht = student(ids, hidden_only=True)[0], teacher(ids, hidden_only=True)[0]
    h1 = hs.clone().requires_grad_(True)
    got = student.token_kl(h1, ht, direction, chunk_size=3, teacher_head=teacher.lm_head.weight)
    h2 = hs.clone().requires_grad_(True)
    ls, lt = student.lm_head(h2).log_softmax(-1), teacher.lm_head(ht).log_softmax(-1)
    expected = (ls.exp() * (ls - lt)).sum(-1) if direction == "reverse" else (lt.exp() * (lt - ls)).sum(-1)
    assert torch.allclose(got, expected, atol=1e-5) and (got > 0).all()
    got.sum().backward()
    expected.sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    with pytest.raises(ValueError, match=r"teacher states of width 48 and a teacher output layer of shape \(400, 64\)"):
        student.token_kl(hs, ht)  # the teacher's states through the student's layer: refused, not mixed up


def test_our_writer_round_trips_and_transformers_opens_it(tiny_model, tmp_path):
    from transformers import Qwen3ForCausalLM
    for name, tied in [("tied", True), ("untied", False)]:
        config = M.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                               rope_theta=10000.0, tie_word_embeddings=tied, max_position_embeddings=512, eos_token_id=0)
        ours = M.init_weights(M.Qwen3(config), seed=3).eval()
        folder = M.save(ours, str(tmp_path / name), os.path.join(tiny_model, "tokenizer.json"))
        again, tok = M.load(folder)
        ids = torch.tensor([[5, 17, 42, 99, 7]])
        mine, theirs = ours.state_dict(), again.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        with torch.no_grad():
            # load() lays the weights out for the CPU's kernels, whose sums then run in
            # another order: the same layout gives the same logits to the bit
            assert torch.equal(again(ids), M.lay_out_weights(ours)(ids))
            ref = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            assert (ref(input_ids=ids).logits - ours(ids)).abs().max() < 1e-4
        assert tok.eos_id == 0


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_weights_are_laid_out_per_dtype_and_compute_the_same(tiny_models, name):
    ours, tok = M.load(tiny_models[name])
    linears = [m.weight for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    # fp32 on the CPU: column-major, the order MKL's few-row products read fastest
    assert all(w.stride() == (1, w.shape[0]) for w in linears)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "tied")
    ids = torch.tensor([tok.encode("Question: 12 eggs, 5 eaten. How many left?\nAnswer:")])
    with torch.no_grad():
        column_major = ours(ids)
        for w in linears:
            w.data = w.data.contiguous()
        assert (ours(ids) - column_major).abs().max() < 1e-5
    again = M.lay_out_weights(ours)
    assert all(w.stride() == (1, w.shape[0]) for w in linears) and again is ours
    bf16, _ = M.load(tiny_models[name], dtype="bf16")
    assert all(m.weight.is_contiguous() for m in bf16.modules() if isinstance(m, torch.nn.Linear))
    # either order can be forced, whatever the dtype (bench/layout.py times both)
    M.lay_out_weights(ours, column_major=False)
    assert all(w.is_contiguous() for w in linears)
    M.lay_out_weights(bf16, column_major=True)
    assert all(m.weight.stride() == (1, m.weight.shape[0]) for m in bf16.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_fp32_weights_that_go_to_onednn_are_row_major_unless_wider_in_than_out(monkeypatch, tiny_models, vendor):
    monkeypatch.setattr(M, "cpu_vendor", lambda: vendor)
    ours, _ = M.load(tiny_models["untied"])
    sizes = sorted({m.weight.numel() for m in ours.modules() if isinstance(m, torch.nn.Linear)})
    monkeypatch.setattr(M, "ONEDNN_MIN_WEIGHT", sizes[1])  # the smallest weights stay below it
    M.lay_out_weights(ours)
    for m in ours.modules():
        if isinstance(m, torch.nn.Linear):
            by_onednn = (vendor == "AuthenticAMD" and m.weight.numel() >= sizes[1]
                         and M.onednn_linear_works(torch.float32))
            # oneDNN's products read row-major weights, and transposed (a training step's
            # input gradient) column-major ones whose input is wider (o, down); MKL's read
            # column-major ones
            row_major = by_onednn and m.in_features <= m.out_features
            assert m.weight.is_contiguous() if row_major else m.weight.stride() == (1, m.weight.shape[0]), m
    assert any(m.in_features > m.out_features for m in ours.modules() if isinstance(m, torch.nn.Linear))


def bytes_kept(fn):
    """(fn(), bytes allocated while fn ran and still held after it): for a forward pass on
    the CPU, what it keeps for the backward pass plus its outputs."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_recompute_gives_the_same_gradients_and_keeps_less(tiny_model, dropout):
    import lora
    m, tok = M.load(tiny_model)
    torch.manual_seed(0)
    lora.add_lora(m, rank=4, alpha=8, dropout=dropout)
    with torch.no_grad():
        for p in lora.lora_parameters(m):
            p.normal_(0, 0.1)  # B = 0 would make every LoRA gradient but B's vanish
    m.train()
    seqs = [tok.encode(f"Question: {i} apples and {i + 3} pears cost {7 * i} dollars.\nAnswer: yes") for i in range(6)]
    seqs += [tok.encode("Answer: 7 pears"), tok.encode("Answer: 12 eggs")]  # these two share a row
    seqs += prefix_batch(tok)[0]  # and these their common prefixes
    assert len(M.pack_rows(seqs, share_prefixes=False)[0]) < len(seqs)
    assert sum(map(len, M.pack_rows(seqs)[0])) < sum(map(len, seqs))
    results = {}
    for recompute in (False, True):
        m.recompute = recompute
        torch.manual_seed(1)  # the same dropout masks in both passes
        logp, kept = bytes_kept(lambda: M.sequence_logprobs(m, seqs, [3] * len(seqs))[0])
        (-logp.mean()).backward()
        results[recompute] = logp.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, kept
        m.zero_grad(set_to_none=True)
    (logp0, grads0, kept0), (logp1, grads1, kept1) = results[False], results[True]
    assert torch.equal(logp0, logp1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert kept1 < 0.75 * kept0, (kept1, kept0)


@pytest.mark.parametrize("rows", [1, 3, M.FEW_ROWS, M.FEW_ROWS + 1])
@pytest.mark.parametrize("has_amx,forms", [(True, None), (False, None), (False, True), (True, False)],
                         ids=["amx-cpu", "other-cpu", "forced-on", "forced-off"])
def test_linear_computes_f_linear_in_every_form(rows, has_amx, forms, monkeypatch):
    # bf16 on a CPU with AMX (or with the forms forced on) takes a matrix-vector product at
    # one row and the weight-first product up to FEW_ROWS rows; above that, elsewhere, and
    # in fp32 or with a column-major weight, F.linear
    monkeypatch.setattr(M, "cpu_has_amx", lambda: has_amx)
    monkeypatch.setattr(M, "FEW_ROW_FORMS", forms)
    monkeypatch.setattr(M, "cpu_vendor", lambda: "GenuineIntel")  # fp32 by F.linear (MKL), not oneDNN
    plain_outputs, f_linear = [], torch.nn.functional.linear  # where F.linear's results lie

    def spy(*args):
        y = f_linear(*args)
        plain_outputs.append(y.data_ptr())
        return y
    monkeypatch.setattr(M.F, "linear", spy)
    g = torch.Generator().manual_seed(rows)
    W, b = torch.randn(48, 40, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    x = torch.randn(1, rows, 40, generator=g).bfloat16()
    for bias in (None, b):
        exact = torch.nn.functional.linear(x.double(), W.double(), None if bias is None else bias.double())
        plain_outputs.clear()
        y = M.linear(x, W, bias)
        assert y.shape == (1, rows, 48) and y.dtype == torch.bfloat16 and y.is_contiguous()
        # each output rounded once to bf16 (8 significant bits) after summing in fp32
        assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
        plain = rows > M.FEW_ROWS or not (has_amx if forms is None else forms)
        assert (y.data_ptr() in plain_outputs) == plain  # F.linear's own result where it is the faster form
        y32 = M.linear(x, W, bias, dtype=torch.float32)  # the sampler's logits: converted in the same copy
        assert y32.dtype == torch.float32 and y32.is_contiguous() and torch.equal(y32, y.float())
    xg = x.clone().requires_grad_(True)
    M.linear(xg, W, b).square().sum().backward()
    x_ref = x.double().requires_grad_(True)
    torch.nn.functional.linear(x_ref, W.double(), b.double()).square().sum().backward()
    assert (xg.grad.double() - x_ref.grad).abs().max() <= x_ref.grad.abs().max() * 2 ** -5
    column_major = W.t().contiguous().t()
    assert torch.equal(M.linear(x, column_major, b), torch.nn.functional.linear(x, column_major, b))
    assert torch.equal(M.linear(x.float(), W.float(), b.float()), torch.nn.functional.linear(x.float(), W.float(), b.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_by_roll_equals_transformers_rotate_half_to_the_bit(dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 700], [5, 6, 7, 8]])
    q, k = torch.randn(2, 4, 4, 16, generator=g).to(dtype), torch.randn(2, 2, 4, 16, generator=g).to(dtype)
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6)
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    our_cos, signed_sin = M.rotary_cos_sin(positions, 16, 1e6, dtype)
    assert torch.equal(M.rotate(q, our_cos, signed_sin), expected_q)
    assert torch.equal(M.rotate(k, our_cos, signed_sin), expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gives_autograds_gradients_to_the_bit_and_keeps_only_its_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(6, 40, generator=g).to(dtype) for _ in range(2))
    upstream = torch.randn(6, 40, generator=g).to(dtype)
    kept = []
    def keep(t):
        kept.append(t)
        return t
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = M.SwiGLU.apply(g1, u1)
    assert len(kept) == 2 and kept[0] is g1 and kept[1] is u1  # not silu(gate)
    out.backward(upstream)
    g2, u2 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    expected = torch.nn.functional.silu(g2) * u2
    expected.backward(upstream)
    assert torch.equal(out, expected) and torch.equal(g1.grad, g2.grad) and torch.equal(u1.grad, u2.grad)
    # only the gradient asked for is formed
    g3 = gate.clone().requires_grad_(True)
    M.SwiGLU.apply(g3, up).backward(upstream)
    assert torch.equal(g3.grad, g2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_in_closed_form_matches_autograd_and_keeps_the_input_as_it_came(dtype):
    g = torch.Generator().manual_seed(0)
    norm = M.RMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32, generator=g))
    x, upstream = (3 * torch.randn(5, 3, 32, generator=g)).to(dtype), torch.randn(5, 3, 32, generator=g).to(dtype)
    kept = []
    x1 = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y1 = norm(x1)
    assert any(t is x1 for t in kept)  # the input as it came
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in kept if t is not x1)  # no fp32 copy of it
    y1.backward(upstream)
    with torch.no_grad():
        assert torch.equal(y1, norm(x))  # the forward pass is the plain one, to the bit
    # autograd through the plain operations, and the exact gradients in fp64
    x2, w2 = x.clone().requires_grad_(True), norm.weight.detach().clone().requires_grad_(True)
    h = x2.float()
    (w2 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)).backward(upstream)
    x3, w3 = x.double().requires_grad_(True), norm.weight.detach().double().requires_grad_(True)
    (w3 * x3 * torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(upstream.double())
    for ours, autograd, exact in ((x1.grad, x2.grad, x3.grad), (norm.weight.grad, w2.grad, w3.grad)):
        assert ours.dtype == dtype
        error, autograd_error = (ours.double() - exact).abs().max(), (autograd.double() - exact).abs().max()
        assert error <= 1.5 * autograd_error + 1e-6 * exact.abs().max(), (error, autograd_error)


def packable_model(name, dtype=torch.bfloat16, **overrides):
    args = dict(TINY_CONFIGS[name], vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, eos_token_id=0)
    args.update(overrides)
    model = M.init_weights(M.Qwen3(M.Qwen3Config(**args)), std=0.1, seed=7).eval()
    return M.lay_out_weights(model.to(dtype))


@pytest.mark.parametrize("dtype, packed_as", [(torch.bfloat16, "bf16"), (torch.bfloat16, "fp32"),
                                              (torch.float32, "fp32")], ids=["bf16", "bf16-as-fp32", "fp32"])
def test_packed_products_compute_each_layers_own_product(monkeypatch, dtype, packed_as):
    if dtype == torch.bfloat16:
        pack_bf16_as(monkeypatch, packed_as)
    elif not M.onednn_linear_works(dtype):
        pytest.skip(ONEDNN_MISSING)
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(40, n, bias=True).to(dtype) for n in (48, 16, 16)]
    # fp32 weights column-major, as load() lays them out
    M.lay_out_weights(torch.nn.Sequential(*layers))
    # the output rounded once to its dtype, and fp32 sums of 40 terms in some order
    # (as fp32: the sums in fp32, then rounded once to bf16; no slack)
    rounding, slack = ((2 ** -8, 1e-3 if packed_as == "bf16" else 0.0) if dtype == torch.bfloat16
                       else (2 ** -24, 0.0))
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    layers[1].bias = None  # a layer without bias among layers with one
    packed = M.PackedWeights(*layers)
    assert packed.dtype == PACKED_AS[packed_as]
    for rows in (1, 8, 100):
        x = torch.randn(2, rows, 40, generator=g).to(dtype)
        outputs = packed(x)
        assert len(outputs) == 3
        for y, layer in zip(outputs, layers):
            bias = None if layer.bias is None else layer.bias.double()
            exact = torch.nn.functional.linear(x.double(), layer.weight.double(), bias)
            terms = torch.nn.functional.linear(x.double().abs(), layer.weight.double().abs(),
                                               None if bias is None else bias.abs())
            assert y.shape == exact.shape and y.dtype == dtype
            assert ((y.double() - exact).abs() <= exact.abs() * rounding + terms * 2 ** -18 + slack).all()


@pytest.mark.skipif(not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING)
def test_fp32_products_go_to_onednn_on_amd_cpus_with_autograds_gradients(monkeypatch, onednn_products):
    monkeypatch.setattr(M, "ONEDNN_MIN_WEIGHT", 48 * 40)
    g = torch.Generator().manual_seed(0)
    W, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    x = torch.randn(2, 5, 40, generator=g)
    upstream = torch.randn(2, 5, 48, generator=g)
    exact = [t.double().requires_grad_(True) for t in (x, W, b)]
    y_exact = torch.nn.functional.linear(*exact)
    y_exact.backward(upstream.double())
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(M, "cpu_vendor", lambda: vendor)
        on_amd = vendor == "AuthenticAMD"
        for weight in (W, W.t().contiguous().t()):  # row-major, and column-major as load() lays out fp32
            onednn_products.clear()
            with torch.no_grad():
                y = M.linear(x, weight, b)
            assert onednn_products == ([(48, 40)] if on_amd else []), vendor
            assert (y.double() - y_exact).abs().max() <= 1e-5 * y_exact.abs().max()  # fp32 sums in some order
            for weight_trains in (False, True):
                xg = x.clone().requires_grad_(True)
                wg, bg = weight.clone().requires_grad_(weight_trains), b.clone().requires_grad_(weight_trains)
                onednn_products.clear()
                y = M.linear(xg, wg, bg)
                y.backward(upstream)
                # the product, and the input's gradient as the product with the weight's transpose
                assert onednn_products == ([(48, 40), (40, 48)] if on_amd else []), vendor
                grads = [xg.grad] + ([wg.grad, bg.grad] if weight_trains else [])
                for ours, reference in zip(grads, exact):
                    assert (ours.double() - reference.grad).abs().max() <= 1e-5 * reference.grad.abs().max()
                assert weight_trains or (wg.grad is None and bg.grad is None)
                if not on_amd:  # F.linear and its autograd, to the bit
                    x_ref = x.clone().requires_grad_(True)
                    torch.nn.functional.linear(x_ref, weight, b).backward(upstream)
                    assert torch.equal(xg.grad, x_ref.grad)
    onednn_products.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 products stay autocast's
        assert M.linear(x, W, b).dtype == torch.bfloat16 and onednn_products == []
    monkeypatch.setattr(M, "cpu_vendor", lambda: "AuthenticAMD")
    sliced = torch.randn(96, 40, generator=g).t().contiguous().t()[:48]  # rows of a column-major weight
    with torch.no_grad():
        assert torch.equal(M.linear(x, sliced), torch.nn.functional.linear(x, sliced)) and onednn_products == []
        # a weight below the size where oneDNN's cost per call pays: MKL's product, to the bit
        small, small_bias = W[:47], b[:47]
        assert torch.equal(M.linear(x, small, small_bias), torch.nn.functional.linear(x, small, small_bias))
        assert onednn_products == []


@pytest.mark.skipif(not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING)
def test_recompute_keeps_onednns_products_and_gives_the_same_gradients(monkeypatch, onednn_products):
    import lora
    every_fp32_weight_to_onednn(monkeypatch)
    # products over an inner dimension above 128, the ones recomputation keeps
    args = dict(vocab_size=300, hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=48, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
                eos_token_id=0, tie_word_embeddings=True)
    model = M.lay_out_weights(M.init_weights(M.Qwen3(M.Qwen3Config(**args)), seed=0))
    lora.add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    model.train()
    seqs = [list(range(1, 12)), list(range(20, 29))]
    results, counts = {}, {}
    for recompute in (True, False):  # recompute first: oneDNN's trial product not yet made
        M.onednn_linear_works.cache_clear()
        model.recompute = recompute
        onednn_products.clear()
        logp = M.sequence_logprobs(model, seqs, [2, 2])[0]
        (-logp.mean()).backward()
        results[recompute] = logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        counts[recompute] = len(onednn_products)
    # each of the 7 weights' products and its input gradient in both layers, but layer 0's
    # q, k and v, whose input (the frozen embeddings) takes no gradient, and the output
    # layer's two in HeadLogprob (the logits, and the softmax-weighted sum of its rows, one
    # vocabulary slice here); recomputation replays the 14 forward calls
    assert counts[False] == 7 * 2 * 2 - 3 + 2 and counts[True] == counts[False] + 14, counts
    (logp0, grads0), (logp1, grads1) = results[False], results[True]
    assert torch.equal(logp0, logp1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    M.onednn_linear_works.cache_clear()


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""])
def test_fp32_packs_only_on_amd_cpus_bf16_on_any(monkeypatch, vendor):
    monkeypatch.setattr(M, "cpu_vendor", lambda: vendor)
    large = torch.zeros(M.ONEDNN_MIN_WEIGHT)
    assert M.can_pack(large) == (vendor == "AuthenticAMD" and M.onednn_linear_works(torch.float32))
    assert M.packing_dtype(large) == (torch.float32 if M.can_pack(large) else None)
    assert not M.can_pack(large[1:])
    # bf16 as bf16 where oneDNN multiplies bf16, else as fp32 copies
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert M.packing_dtype(bf16) == (torch.bfloat16 if M.onednn_linear_works(torch.bfloat16) else
                                     torch.float32 if M.onednn_linear_works(torch.float32) else None)
    assert not M.can_pack(torch.zeros(1, dtype=torch.float64))


@pytest.mark.skipif(not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING)
def test_bf16_packed_as_fp32_packs_from_two_rows(monkeypatch, packed_products, tiny_model):
    from sample import generate
    pack_bf16_as(monkeypatch, "fp32")
    model, tokenizer = M.load(tiny_model, dtype="bf16")
    ids = torch.randint(1, 300, (2, 9), generator=torch.Generator().manual_seed(1)).tolist()
    generate(model, tokenizer, ids, max_new_tokens=3, temperature=0)
    assert len(packed_products) >= 4 * model.config.num_hidden_layers
    # one row: bf16's own matrix-vector product reads half the bytes of the fp32 copies
    packed_products.clear()
    generate(model, tokenizer, ids[:1], max_new_tokens=3, temperature=0)
    assert packed_products == []
    generate(model, tokenizer, ids[:1], n=2, max_new_tokens=3, temperature=0)
    assert len(packed_products) >= 4 * model.config.num_hidden_layers


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads the CPU's vendor from Linux's /proc/cpuinfo")
def test_cpu_vendor_reads_the_cpus_own_name():
    with open("/proc/cpuinfo") as f:
        names = {line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")}
    assert M.cpu_vendor() in (names or {""}) and len(names) <= 1


@pytest.mark.skipif(not M.onednn_linear_works(torch.float32), reason=ONEDNN_MISSING)
def test_fp32_packed_forward_and_greedy_decode_match_the_plain_ones(monkeypatch, packed_products, tiny_model):
    from sample import generate
    every_fp32_weight_to_onednn(monkeypatch)
    model, tokenizer = M.load(tiny_model)  # fp32, row-major as oneDNN's weights are
    ids = torch.randint(1, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        hidden = model(ids, hidden_only=True)
        with M.packed_weights(model):
            packed = model(ids)
            assert len(packed_products) == 4 * model.config.num_hidden_layers  # the decoder layers'
            packed_products.clear()
            logits = model.next_token_logits(hidden)  # a prefill's last positions, not contiguous
            assert packed_products == [1]  # the output layer's own packed product
        assert model.packed == {}
    assert (packed - plain).abs().max() <= 1e-5 * plain.abs().max()  # fp32 sums in another order
    assert torch.allclose(logits, plain[:, -1], rtol=0, atol=1e-5 * plain.abs().max())
    packed_products.clear()
    decoded = generate(model, tokenizer, ids.tolist(), max_new_tokens=6, temperature=0)
    assert len(packed_products) >= 4 * model.config.num_hidden_layers * 6
    # a single row does not pack in fp32, two samples of one prompt do
    packed_products.clear()
    single = generate(model, tokenizer, ids[:1].tolist(), max_new_tokens=6, temperature=0)
    assert packed_products == [] and single[0].completion_ids == decoded[0].completion_ids
    generate(model, tokenizer, ids[:1].tolist(), n=2, max_new_tokens=2, temperature=0)
    assert len(packed_products) >= 4 * model.config.num_hidden_layers
    monkeypatch.setattr(M, "PACK_ON_CPU", False)
    unpacked = generate(model, tokenizer, ids.tolist(), max_new_tokens=6, temperature=0)
    assert [r.completion_ids for r in decoded] == [r.completion_ids for r in unpacked]


@pytest.mark.parametrize("name,bias", [("tied", False), ("untied", False), ("tied", True)])
def test_packed_weights_forward_matches_the_plain_one_and_leaves_nothing_behind(monkeypatch, packed_products, name,
                                                                                bias, bf16_packing):
    model = packable_model(name, attention_bias=bias)
    ids = torch.randint(1, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    calls = packed_products
    with torch.no_grad():
        plain = model(ids).float()
        with M.packed_weights(model):
            packed = model(ids).float()
        after = model(ids).float()
    layers = model.config.num_hidden_layers
    assert sorted(calls) == sorted([3, 1, 2, 1] * layers)  # qkv, o, gate-up, down in each layer; no more
    assert torch.equal(after, plain)
    assert all(layer.self_attn.packed == {} and layer.mlp.packed == {} for layer in model.model.layers)
    # the same sums in another order: bf16 rounding apart, through every layer
    assert (packed - plain).abs().max() <= 0.03 * plain.abs().max()
    assert (packed.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9
    # switched off, nothing is packed and the pass is the plain one to the bit
    monkeypatch.setattr(M, "PACK_ON_CPU", False)
    calls.clear()
    with torch.no_grad(), M.packed_weights(model):
        assert torch.equal(model(ids).float(), plain) and calls == []


def test_packed_weights_step_aside_for_changed_weights_adapters_and_gradients(packed_products, bf16_packing):
    import lora
    model = packable_model("tied")
    ids = torch.randint(1, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    calls = packed_products
    with M.packed_weights(model):
        # a gradient pass never takes the packed products (they have no backward)
        embeddings = model.model.embed_tokens.weight.requires_grad_(True)
        model(ids).float().sum().backward()
        assert calls == [] and embeddings.grad is not None
        embeddings.requires_grad_(False)
        with torch.no_grad():
            stale = model(ids).float()
            # a weight changed in place after packing: the layer runs from the weight as it is now
            q = model.model.layers[0].self_attn.q_proj.weight
            q.mul_(-1)
            calls.clear()
            changed = model(ids).float()
            assert len(calls) == 4 * 2 - 1  # layer 0's q, k and v one by one
    with torch.no_grad():
        fresh = model(ids).float()
        q.mul_(-1)
    scale = fresh.abs().max()
    assert (changed - fresh).abs().max() <= 0.03 * scale < (stale - fresh).abs().max()
    # an adapter wrapped in after packing, and one active but not folded: both run as adapters
    lora.add_lora(model, rank=4, alpha=8)
    for layer in lora.lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"], std=0.5)
    with torch.no_grad():
        adapted = model(ids)
        with M.packed_weights(model):
            calls.clear()
            assert torch.equal(model(ids), adapted) and calls == []
    plain = packable_model("tied")
    with torch.no_grad(), M.packed_weights(plain):
        lora.add_lora(plain, rank=4, alpha=8)
        for mine, theirs in zip(lora.lora_layers(plain).values(), lora.lora_layers(model).values()):
            mine.lora_A["default"].data.copy_(theirs.lora_A["default"])
            mine.lora_B["default"].data.copy_(theirs.lora_B["default"])
        calls.clear()
        assert torch.equal(plain(ids), adapted) and calls == []


def test_packing_is_skipped_where_onednns_linear_is_missing_or_wrong(monkeypatch):
    assert (M.onednn_linear_works(torch.bfloat16) or M.onednn_linear_works(torch.float32)) == M.can_pack(
        torch.zeros(1, dtype=torch.bfloat16))
    model = packable_model("tied")
    ids = torch.randint(1, 300, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids)
    for broken in (lambda *args: torch.zeros(1, 2, dtype=torch.bfloat16),  # answers, wrongly
                   lambda *args: (_ for _ in ()).throw(RuntimeError("no such kernel"))):
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
        M.onednn_linear_works.cache_clear()
        assert not M.onednn_linear_works() and not M.can_pack(model.lm_head.weight)
        with torch.no_grad(), M.packed_weights(model):
            assert torch.equal(model(ids), plain)
        monkeypatch.undo()
    M.onednn_linear_works.cache_clear()


def test_pack_rows_without_sharing_is_first_fit_decreasing():
    lengths = [5, 9, 2, 4, 7, 3, 9]
    rows, placed = M.pack_rows([[b] * n for b, n in enumerate(lengths)], share_prefixes=False)
    # 9 | 9 | 7+2 | 5+4 | 3: each in the first row with room, in decreasing length
    assert [r for r, _ in placed] == [3, 0, 2, 3, 2, 4, 1]
    assert rows[2] == [4] * 7 + [2] * 2 and [len(row) for row in rows] == [9, 9, 9, 9, 3]
    assert [r for r, _ in M.pack_rows([[1] * 4] * 3, share_prefixes=False)[1]] == [0, 1, 2]


def test_pack_rows_lays_a_shared_prefix_out_once_where_it_is_long_enough():
    n = M.SHARED_PREFIX_MIN
    prompt = list(range(100, 100 + n))
    trunk = prompt + [1, 2, 3, 4, 5, 6, 7, 8]
    sequences = [trunk, prompt + [7, 8], prompt[:-1] + [9, 9, 9, 9], trunk[:n + 2], [5] * 6, trunk, [6] * (n + 12)]
    rows, placed = M.pack_rows(sequences)
    for s, (r, columns) in zip(sequences, placed):
        assert [rows[r][c] for c in columns] == s  # each sequence reads back from its columns
        assert columns == sorted(columns)  # a token's earlier tokens lie before it: causal
    # rows of at most the longest sequence's n + 12 tokens, longest first: the trunk, then
    # its copy and its prefix at no cost, prompt + [7, 8] adding 2; sharing one token too
    # few, the third adds all of its own and takes a new row, where the short one fits
    assert [r for r, _ in placed] == [1, 1, 2, 1, 2, 1, 0]
    assert [len(row) for row in rows] == [n + 12, n + 10, n + 9]
    assert placed[3][1] == placed[0][1][:n + 2] and placed[5][1] == placed[0][1]
    assert placed[1][1] == placed[0][1][:n] + [n + 8, n + 9]
    # without sharing, each sequence's tokens are its own, first-fit decreasing
    rows, placed = M.pack_rows(sequences, share_prefixes=False)
    assert sum(map(len, rows)) == sum(map(len, sequences)) and max(map(len, rows)) == n + 12
    assert [r for r, _ in placed] == [1, 4, 3, 5, 3, 2, 0]


def test_pack_rows_keeps_apart_the_trees_that_open_alike_on_fewer_tokens():
    # every GSM8K prompt opens on "Question:": one rollout's continuations still find its
    # prefix in a row that holds other rollouts' trees too
    n = M.SHARED_PREFIX_MIN
    a = [1, 2, 3] + list(range(100, 100 + n + 10))
    b = [1, 2, 3] + list(range(300, 300 + n + 5))
    sequences = [a, b, b[:n + 4] + [7, 7], a[:n + 1] + [8]]
    rows, placed = M.pack_rows(sequences, row_tokens=1000)
    assert len(rows) == 1 and sum(map(len, rows)) == len(a) + len(b) + 2 + 1
    assert placed[2][1][:n + 4] == placed[1][1][:n + 4] and placed[3][1][:n + 1] == placed[0][1][:n + 1]


def sharing_batch(tok):
    """Sequences of mixed lengths, some of which share a row (model.pack_rows), and where
    each one's trained tokens start: halfway along it."""
    texts = ["Question: Janet has 3 apples and buys 5 more. How many apples now?\nAnswer: 8", "2 + 2?",
             "Question: a pen costs 4 dollars.\nAnswer:", "x", "Answer: 12 eggs", "Question: 7 * 6?\nAnswer: 42"]
    seqs = [tok.encode(t) for t in texts]
    assert len(M.pack_rows(seqs, share_prefixes=False)[0]) < len(seqs)  # rows are shared here
    return seqs, [max(1, len(s) // 2) for s in seqs]


def prefix_batch(tok):
    """Sequences with long common prefixes, as RL and OPD train on: two samples of one prompt,
    a duplicate of one of them, and OPD's continuations of a rollout at three cuts, each
    trained on its continuation alone."""
    prompt = tok.encode("Question: Janet has 3 apples and buys 5 more. How many apples does she have now?\nAnswer:")
    samples = [prompt + tok.encode(" She has 3 + 5 = 8 apples. #### 8"), prompt + tok.encode(" 8"),
               prompt + tok.encode(" She has 3 + 5 = 8 apples. #### 8")]
    rollout = samples[0]
    cuts = [len(prompt) + 1, len(prompt) + 6, len(rollout) - 2]
    continuations = [rollout[:t] + tok.encode(f" {t} more tokens") for t in cuts]
    assert len(prompt) >= M.SHARED_PREFIX_MIN
    return samples + continuations, [len(prompt)] * 3 + cuts


@pytest.mark.parametrize("by_run", [True, False])  # attention as on the CPU, or under a mask as elsewhere
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_sequences_sharing_rows_give_each_sequence_alone_its_values_and_gradients(tiny_models, name, by_run, monkeypatch):
    import lora
    if not by_run:
        monkeypatch.setattr(M.RowRuns, "attend", attend_under_the_mask)
    m, tok = M.load(tiny_models[name])
    lora.add_lora(m, rank=4, alpha=8)
    randomize_adapter(m)
    short, short_starts = sharing_batch(tok)
    prefixed, prefixed_starts = prefix_batch(tok)
    seqs, starts = short + prefixed, short_starts + prefixed_starts

    calls = []
    plain_forward = m.forward
    m.forward = lambda ids, **k: calls.append((ids, k.get("positions"), k.get("visible"))) or plain_forward(ids, **k)
    states, targets, sequence_of_state = M.sequence_states(m, seqs, starts, tok.pad_id)
    ids, positions, runs = calls[0]
    visible = runs.dense()
    # one row on the CPU, of fewer columns than the sequences hold: common prefixes laid out once
    assert len(ids) == 1 and ids.numel() < sum(map(len, seqs))
    # rotary sees relative positions only, so they are checked here rather than in the
    # values: each sequence, read back along the tokens its last one sees, counts its
    # positions from 0 and is itself, wherever and however shared it lies in its row
    for s in seqs:
        found = [(r, c) for r in range(len(ids)) for c in range(ids.shape[1])
                 if positions[r, c] == len(s) - 1 and ids[r, c] == s[-1]
                 and ids[r][visible[r, c]].tolist() == s]
        assert found
        r, c = found[0]
        assert positions[r][visible[r, c]].tolist() == list(range(len(s)))
    m.token_logprobs(states, targets).sum().backward()
    shared_grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad(set_to_none=True)
    calls.clear()

    alone = [M.sequence_states(m, [s], [start], tok.pad_id) for s, start in zip(seqs, starts)]
    assert [visible for _, _, visible in calls] == [None] * len(seqs)  # one sequence to a row: the causal kernel
    alone_states = torch.cat([a[0] for a in alone])
    assert torch.equal(targets, torch.cat([a[1] for a in alone]))
    m.token_logprobs(alone_states, targets).sum().backward()
    assert torch.equal(sequence_of_state, torch.cat([torch.full_like(a[2], b) for b, a in enumerate(alone)]))
    assert (states - alone_states).abs().max() < 1e-5
    for n, p in m.named_parameters():
        if p.requires_grad:
            assert (shared_grads[n] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), n
    row = torch.tensor([seqs[0]])
    with pytest.raises(ValueError, match="without a cache"):
        plain_forward(row, cache=m.new_cache(1, 40), positions=torch.zeros_like(row),
                      visible=torch.ones(1, row.shape[1], row.shape[1], dtype=torch.bool))
    with pytest.raises(ValueError, match="both or neither"):
        plain_forward(row, positions=torch.zeros_like(row))


# (device, weights, autocast on the CPU): the scripts run under autocast on CUDA (M.autocast)
# and never on the CPU; the third case runs CUDA's mixed precision on the CPU, bf16 products
# over fp32 weights through the same autograd Functions, so CI sees that path too
@pytest.mark.parametrize("device,dtype,cpu_autocast", [("cpu", "fp32", False), ("cpu", "bf16", False), ("cpu", "fp32", True)]
                         + [(device, dtype, False) for device in DEVICES if device != "cpu" for dtype in ("fp32", "bf16")])
def test_the_training_pass_on_each_device_computes_what_fp32_on_the_cpu_does(tiny_models, device, dtype, cpu_autocast):
    # the pass sft.py, rl.py and opd.py run on a device: weights in dtype, M.autocast (bf16
    # products on CUDA), short sequences sharing rows (a masked attention kernel) and one row
    # each (the causal one), against the same adapter in fp32 on the CPU
    import contextlib
    import lora
    ref, tok = M.load(tiny_models["untied"])
    ours, _ = M.load(tiny_models["untied"], device=device, dtype=dtype)
    for m in (ref, ours):
        lora.add_lora(m, rank=4, alpha=8)
    torch.manual_seed(0)  # the bounds below were measured on these values
    with torch.no_grad():
        for p_ref, p in zip(lora.lora_parameters(ref), lora.lora_parameters(ours)):
            p.copy_(p_ref.normal_(0, 0.1))
    seqs, starts = sharing_batch(tok)

    def training_pass(model, share_rows):
        mixed = torch.autocast("cpu", dtype=torch.bfloat16) if cpu_autocast and model is ours else contextlib.nullcontext()
        with M.autocast(model.lm_head.weight.device), mixed:
            logp = M.sequence_logprobs(model, seqs, starts, tok.pad_id, share_rows=share_rows)[0]
        logp.sum().backward()
        grads = [p.grad.float().cpu() for p in lora.lora_parameters(model)]
        model.zero_grad(set_to_none=True)
        return logp.detach().float().cpu(), grads

    expected, expected_grads = training_pass(ref, share_rows=True)
    shared, shared_grads = training_pass(ours, share_rows=True)
    alone, alone_grads = training_pass(ours, share_rows=False)
    # the two attention kernels on one device round differently, and no more: in bf16 on the
    # CPU shared rows moved the log-probs by 0.006 and the gradients by 0.6% of the largest
    # (0.002 and 0.7% under autocast), where a mask letting sequences see each other moves
    # them by about 1.2 and by 100%
    low_precision = dtype == "bf16" or device != "cpu" or cpu_autocast  # bf16 weights, or bf16 products
    assert (shared - alone).abs().max() <= (5e-2 if low_precision else 1e-5)
    for g, e in zip(shared_grads, alone_grads):
        assert (g - e).abs().max() <= (5e-2 if low_precision else 1e-4) * e.abs().max()
    # against fp32 on the CPU, bf16 weights are another model's by their rounding: 0.022 and 3.8%
    # of the largest gradient on the CPU (bf16 products under autocast: 0.020 and 4.6%)
    assert (shared - expected).abs().max() <= (0.15 if low_precision else 1e-5)
    for g, e in zip(shared_grads, expected_grads):
        assert (g - e).abs().max() <= (0.2 if low_precision else 1e-4) * e.abs().max()
