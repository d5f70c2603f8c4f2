import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import model as M
import train
from plumbing.files import InputError
from sample import left_pad
from conftest import (DEVICES, OFFICIAL_CONFIG, ROOT, TINY_CONFIGS, our_model, randomize_adapter, save_hf_model,
                      two_sequences)


def hf_model(folder, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def official_config():
    with open(os.path.join(OFFICIAL_CONFIG, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_match_transformers(tiny_models, name):
    ours, tok = M.load(tiny_models[name])
    ref = hf_model(tiny_models[name])
    a, b = two_sequences(tok)
    ids, mask = left_pad([a, b], tok.pad_id)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
        # the real positions of each row are what matter; padding positions carry no meaning
        assert (got - expected)[mask.bool()].abs().max() < 1e-4
        full = ours(torch.tensor([a]))
        assert (full - ref(input_ids=torch.tensor([a])).logits).abs().max() < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_match_transformers_in_bf16(tiny_model, device):
    # the same bf16 weights on both sides: the same next token at every position of a text
    ours, tok = M.load(tiny_model, device, torch.bfloat16)
    ref = hf_model(tiny_model, torch.bfloat16).to(device)
    ids = torch.tensor([tok.encode("Question: Janet has 3 apples and buys 5 more. How many does she have?")],
                       device=device)
    with torch.no_grad():
        got, expected = ours(ids).float(), ref(input_ids=ids).logits.float()
    # rounding may swap two near-equal logits; elsewhere the argmax is the reference's
    top2 = expected.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05
    assert clear.sum() >= 10 and torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_rms_norm_is_its_formula_with_its_weight():
    norm = M.RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0, -1.0, 3.0]))
    x = torch.randn(4, 6, dtype=torch.float64).float()
    expected = norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x), expected, atol=1e-6)
    # bf16 activations: normalised in fp32, rounded to bf16, then scaled
    xb = x.bfloat16()
    expected = norm.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(norm(xb), expected)


def test_test_checkpoints_have_norm_weights_other_than_one(tiny_models):
    for folder in tiny_models.values():
        ours, _ = M.load(folder)
        norms = [p for n, p in ours.named_parameters() if n.endswith("norm.weight")]
        assert len(norms) == 4 * ours.config.num_hidden_layers + 1  # 4 a layer (q, k, input, post-attention), 1 final
        assert all((p - 1).abs().max() > 0.1 for p in norms)


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
        ids, mask = left_pad([a, b], tok.pad_id)
        batch = ours(ids, attention_mask=mask)
        alone_b = ours(torch.tensor([b]))
        assert (batch[1, -len(b):] - alone_b[0]).abs().max() < 1e-4
        assert (batch[0] - full[0]).abs().max() < 1e-4
        # padded prefill, then a decode step under the mask, and the rows copied as for n samples
        cache = ours.new_cache(2, ids.shape[1] + 3)
        ours(ids, attention_mask=mask, cache=cache)
        cache.select_rows(torch.tensor([1, 1, 0]))
        nxt = torch.tensor([[9], [4], [7]])
        mask2 = torch.cat([mask[[1, 1, 0]], torch.ones(3, 1, dtype=torch.long)], 1)
        step = ours(nxt, attention_mask=mask2, cache=cache)[:, -1]
        for row, seq in enumerate([b + [9], b + [4], a + [7]]):
            assert (step[row] - ours(torch.tensor([seq]))[0, -1]).abs().max() < 1e-4


def test_decode_step_at_fixed_shape_equals_the_cached_forward(tiny_model):
    # the CUDA graph's step, run eagerly: every column of the cache read, the unwritten ones masked
    ours, tok = M.load(tiny_model)
    a, b = two_sequences(tok)
    ids, mask = left_pad([a, b], tok.pad_id)
    with torch.no_grad():
        cache = ours.new_cache(2, ids.shape[1] + 4)
        ours(ids, attention_mask=mask, cache=cache)
        cache.write_pos = torch.tensor([ids.shape[1]])
        key_mask = torch.zeros(2, 1, 1, cache.max_len, dtype=torch.bool)
        key_mask[:, 0, 0, :ids.shape[1] + 1] = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).bool()
        logits = ours.decode_step(torch.tensor([[5], [6]]), mask.sum(-1, keepdim=True), key_mask, cache)
    assert logits.dtype == torch.float32
    with torch.no_grad():
        for row, seq in enumerate([a + [5], b + [6]]):
            assert (logits[row] - ours(torch.tensor([seq]))[0, -1]).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_log_softmax_with_their_gradients(tiny_model, dtype):
    ours, tok = M.load(tiny_model, dtype=dtype)
    ids = torch.tensor([tok.encode("Question: what is 6 times 7?\nAnswer: 42")])
    targets = ids[0, 1:]
    with torch.no_grad():
        hidden = ours(ids[:, :-1], hidden_only=True)[0]
    assert len(targets) % 4 != 0  # uneven chunks
    weights = torch.linspace(-1.0, 2.0, len(targets))  # an uneven upstream gradient
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradients' products round in bf16
    for trainable_head in (False, True):  # frozen (LoRA) and trained (toy.py's pretraining)
        ours.lm_head.weight.requires_grad_(trainable_head)
        h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
        got = ours.token_logprobs(h1, targets, chunk_logits=4 * ours.config.vocab_size)
        # the plain form: the whole (tokens, vocab) matrix, autograd's gradient
        expected = ours.lm_head(h2).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)
        (got * weights).sum().backward()
        w_grad = ours.lm_head.weight.grad
        ours.lm_head.weight.grad = None
        (expected * weights).sum().backward()
        assert h1.grad.dtype == dtype and (h1.grad - h2.grad).abs().max() <= tol * h2.grad.abs().max()
        if trainable_head:
            assert (w_grad - ours.lm_head.weight.grad).abs().max() <= tol * w_grad.abs().max()
        ours.lm_head.weight.grad = None
    ours.lm_head.weight.requires_grad_(False)


def test_mlp_recomputes_silu_in_backward_with_the_same_gradients(tiny_model):
    from torch.profiler import ProfilerActivity, profile
    mlp = M.load(tiny_model)[0].model.layers[0].mlp.requires_grad_(True)
    x = torch.randn(3, 40, mlp.gate_proj.in_features)
    results = []
    for recomputing in (True, False):
        xi = x.clone().requires_grad_(True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = mlp(xi) if recomputing else mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(xi)) * mlp.up_proj(xi))
        kept = sum(e.self_cpu_memory_usage for e in prof.events())  # held after the forward pass: kept for backward
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in mlp.parameters()], kept))
        mlp.zero_grad(set_to_none=True)
    (y1, gx1, gp1, kept1), (y0, gx0, gp0, kept0) = results
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0) and all(torch.equal(a, b) for a, b in zip(gp1, gp0))
    with torch.no_grad():
        assert torch.equal(mlp(x), y0)  # and without a gradient, no checkpoint at all
    # plain autograd keeps gate, silu(gate), up and their product (the down layer's input):
    # four (tokens, intermediate) tensors; recomputing silu keeps three
    assert kept1 <= 0.8 * kept0, (kept1, kept0)


def test_official_config_loads_with_its_values():
    config, raw = M.read_config(OFFICIAL_CONFIG), official_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                  "max_position_embeddings", "attention_bias"):
        assert getattr(config, field) == raw[field], field
    assert config.rope_theta == 1e6 and config.tie_word_embeddings and config.head_dim == 128
    assert config.eos_token_id == 151643
    with torch.device("meta"):
        model = M.Qwen3(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 596


def test_transformers5_config_style():
    raw = official_config()
    theta = raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    assert M.Qwen3Config.from_dict(raw).rope_theta == theta
    del raw["rope_parameters"]
    with pytest.raises(InputError, match="missing field.*rope_theta"):
        M.Qwen3Config.from_dict(raw)


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear"}}, "rope type 'linear' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported; set it to false"),
    ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe'; this file implements 'qwen3' only"),
])
def test_configs_of_other_models_are_refused_by_name(change, message):
    raw = official_config()
    with pytest.raises(InputError, match=message):
        M.Qwen3Config.from_dict({**raw, **change})
    # the official config passes, and of several stop ids the first is end-of-text
    assert M.Qwen3Config.from_dict({**raw, "eos_token_id": [7, 9]}).eos_token_id == 7


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_inputs_give_one_line_errors(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    def refused(folder, pattern):
        with pytest.raises(InputError, match=pattern) as e:
            M.load(folder)
        assert "\n" not in str(e.value)

    no_config = copy_model(tiny_model, tmp_path / "no_config")
    os.remove(os.path.join(no_config, "config.json"))
    refused(no_config, "no config.json; point --model at a Hugging Face model folder")
    missing = copy_model(tiny_model, tmp_path / "missing")
    path = os.path.join(missing, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path)
    refused(missing, r"model.layers.1.mlp.up_proj.weight is missing")
    shape = copy_model(tiny_model, tmp_path / "shape")
    path = os.path.join(shape, "model.safetensors")
    save_file({**load_file(path), "model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 3)}, path)
    refused(shape, r"k_proj.weight has shape \(3, 3\)")
    refused(str(tmp_path / "does" / "not" / "exist"), "neither a local folder nor a hub id")
    extra = copy_model(tiny_model, tmp_path / "extra")
    path = os.path.join(extra, "model.safetensors")
    save_file({**load_file(path), "model.layers.0.mlp.experts.0.weight": torch.zeros(2, 2)}, path)
    refused(extra, r"unexpected tensor model.layers.0.mlp.experts.0.weight \(1 in all\); is this a Qwen3 checkpoint\?")
    no_weights = copy_model(tiny_model, tmp_path / "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    refused(no_weights, "no model.safetensors or model.safetensors.index.json; the weights are missing")
    no_tokenizer = copy_model(tiny_model, tmp_path / "no_tokenizer")
    os.remove(os.path.join(no_tokenizer, "tokenizer.json"))
    refused(no_tokenizer, "no tokenizer.json; the model folder needs its tokenizer file too")
    # damaged files: a download cut short, a config edited by hand, a tokenizer half written
    cut_short = copy_model(tiny_model, tmp_path / "cut_short")
    path = os.path.join(cut_short, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    refused(cut_short, r"cut_short/model.safetensors is not a readable safetensors file \(.*\); download it")
    edited = copy_model(tiny_model, tmp_path / "edited")
    with open(os.path.join(edited, "config.json"), "a") as f:
        f.write(",")
    refused(edited, r"edited/config.json is not valid JSON \(Extra data: .*\); the file is damaged")
    with open(os.path.join(no_tokenizer, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    refused(no_tokenizer, r"no_tokenizer/tokenizer.json is not a readable tokenizer \(.*\); restore it")
    no_eos = copy_model(tiny_model, tmp_path / "no_eos")
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(no_eos, name)) as f:
            config = json.load(f)
        config.pop("eos_token_id", None)
        with open(os.path.join(no_eos, name), "w") as f:
            json.dump(config, f)
    refused(no_eos, "no eos_token_id in generation_config.json or config.json; add it")


def test_a_hub_id_that_cannot_be_fetched_is_a_one_line_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Cannot reach the hub.\nCheck your internet connection\n  and try again.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(InputError, match=r"could not fetch 'Qwen/Qwen3-0.6B-Base' .*Cannot reach the hub. Check your "
                                           r"internet connection and try again.*no local folder of that name"
                                           r".*pass its folder with --model") as e:
        M.model_folder("Qwen/Qwen3-0.6B-Base")
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=r"could not fetch 'out/stres'.*pass its folder with --teacher$"):
        M.model_folder("out/stres", "--teacher")


@pytest.mark.parametrize("tied", [True, False])
def test_our_writer_round_trips_and_transformers_opens_it(tiny_model, tmp_path, tied):
    config = M.Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                           rope_theta=10000.0, tie_word_embeddings=tied, max_position_embeddings=512, eos_token_id=0)
    ours = our_model(config, seed=3)
    folder = M.save(ours, str(tmp_path / "model"), os.path.join(tiny_model, "tokenizer.json"))
    again, tok = M.load(folder)
    mine, theirs = ours.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (again.lm_head.weight is again.model.embed_tokens.weight) == tied
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))
        assert (hf_model(folder)(input_ids=ids).logits - ours(ids)).abs().max() < 1e-4
    assert tok.eos_id == 0


def test_recompute_gives_the_same_gradients_and_keeps_less(tiny_model):
    import lora
    from torch.profiler import ProfilerActivity, profile
    m, tok = M.load(tiny_model)
    lora.add_lora(m, rank=4, alpha=8)
    randomize_adapter(m)  # B = 0 would make every gradient but B's vanish
    m.train()
    seqs = [tok.encode(f"Question: {i} apples and {i + 3} pears cost {7 * i} dollars.\nAnswer: yes") for i in range(6)]
    results = {}
    for recompute in (False, True):
        m.recompute = recompute
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logp = train.sequence_logprobs(m, seqs, [3] * len(seqs))[0]
        kept = sum(e.self_cpu_memory_usage for e in prof.events())  # held after the forward pass: kept for backward
        (-logp.mean()).backward()
        results[recompute] = logp.detach(), [p.grad for p in lora.lora_parameters(m)], kept
        m.zero_grad(set_to_none=True)
    (logp0, grads0, kept0), (logp1, grads1, kept1) = results[False], results[True]
    assert torch.equal(logp0, logp1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert kept1 < 0.5 * kept0, (kept1, kept0)


def test_importing_the_model_imports_nothing_else_of_the_project_but_its_file_helpers():
    """model.py and plumbing/files.py (reading and writing files) stand alone: a reader needs no other module."""
    packages = ("plumbing", "study")
    project = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")} | set(packages) | {
        f"{p}.{f[:-3]}" for p in packages for f in os.listdir(os.path.join(ROOT, p)) if f.endswith(".py")}
    code = ("import sys, model, torch; m = model.Qwen3; print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert "model" in loaded and (loaded & project) - {"model"} == {"plumbing", "plumbing.files"}
    for name, allowed in (("model.py", {"plumbing.files"}), ("plumbing/files.py", set())):  # nor inside a function
        with open(os.path.join(ROOT, name)) as f:
            imported = set(re.findall(r"^\s*(?:import|from) ([\w.]+)", f.read(), re.M))
        assert imported & project == allowed, name
