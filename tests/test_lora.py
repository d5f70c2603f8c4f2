import argparse

import pytest
import torch

import lora
import model as M
from conftest import DEVICES, hold_in_another_process, randomize_adapter


def peft_model(folder, adapter=None, r=4, alpha=8):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen3ForCausalLM
    base = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if adapter:
        return PeftModel.from_pretrained(base, adapter).eval()
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(lora.TARGETS), init_lora_weights=False)
    return get_peft_model(base, cfg).eval()


def sample_ids(tok):
    return torch.tensor([tok.encode("Question: Tom has 12 marbles and gives 5 away.\nAnswer: 7")])


def test_fresh_adapter_is_identity_and_only_lora_trains(tiny_model):
    ours, tok = M.load(tiny_model)
    ids = sample_ids(tok)
    with torch.no_grad():
        before = ours(ids)
    lora.add_lora(ours, rank=4, alpha=8)
    with torch.no_grad():
        assert torch.equal(ours(ids), before)  # B = 0
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * ours.config.num_hidden_layers


def test_peft_adapter_opens_in_ours_with_equal_logits(tiny_model, tmp_path):
    ref = peft_model(tiny_model)  # init_lora_weights=False: B is random, so the adapter matters
    ref.save_pretrained(str(tmp_path / "peft"))
    ours, tok = M.load(tiny_model)
    lora.load_adapter(ours, str(tmp_path / "peft"))
    ids = sample_ids(tok)
    with torch.no_grad():
        got, expected = ours(ids), ref(input_ids=ids).logits
        lora.set_adapter(ours, None)
        assert (ours(ids) - expected).abs().max() > 1e-3  # the adapter really changes the output
    assert (got - expected).abs().max() < 1e-5


def test_our_adapter_opens_in_peft_with_equal_logits(tiny_model, tmp_path):
    ours, tok = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    randomize_adapter(ours, "default", seed=1)
    lora.save_adapter(ours, str(tmp_path / "ours"))
    ref = peft_model(tiny_model, adapter=str(tmp_path / "ours"))
    ids = sample_ids(tok)
    with torch.no_grad():
        assert (ours(ids) - ref(input_ids=ids).logits).abs().max() < 1e-5
    # and back into ours under another name
    again, _ = M.load(tiny_model)
    lora.load_adapter(again, str(tmp_path / "ours"), name="reloaded")
    with torch.no_grad():
        assert (again(ids) - ours(ids)).abs().max() < 1e-6
    # the same tensors under keys that keep peft's adapter name (".lora_A.default.weight"), as
    # some tools write them
    from safetensors.torch import load_file, save_file
    named = tmp_path / "named"
    named.mkdir()
    (named / "adapter_config.json").write_text((tmp_path / "ours" / "adapter_config.json").read_text())
    state = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in state.items()}, str(named / "adapter_model.safetensors"))
    third, _ = M.load(tiny_model)
    lora.load_adapter(third, str(named))
    loaded, reference = list(lora.lora_parameters(third)), list(lora.lora_parameters(again, "reloaded"))
    assert len(loaded) == len(reference) > 0 and all(torch.equal(a, b) for a, b in zip(loaded, reference))


def test_merge_unmerge_and_switching(tiny_model):
    ours, tok = M.load(tiny_model)
    ids = sample_ids(tok)
    weights = {n: p.detach().clone() for n, p in ours.named_parameters()}
    with torch.no_grad():
        base_logits = ours(ids)
        lora.add_lora(ours, rank=4, alpha=8, name="one")
        randomize_adapter(ours, "one", seed=1)
        one = ours(ids)
        lora.add_lora(ours, rank=8, alpha=8, name="two")
        randomize_adapter(ours, "two", seed=2)
        two = ours(ids)
        assert (one - two).abs().max() > 1e-3 and (one - base_logits).abs().max() > 1e-3
        for name, expected in [(None, base_logits), ("one", one), ("two", two), ("one", one), (None, base_logits)]:
            lora.set_adapter(ours, name)
            assert (ours(ids) - expected).abs().max() < 1e-6, name
        with lora.use_adapter(ours, "two"):
            assert (ours(ids) - two).abs().max() < 1e-6
        assert (ours(ids) - base_logits).abs().max() < 1e-6  # restored
        lora.set_adapter(ours, "one")
        lora.merge(ours)
        assert (ours(ids) - one).abs().max() < 1e-4
        with pytest.raises(RuntimeError, match="unmerge"):
            lora.set_adapter(ours, "two")
        lora.unmerge(ours)
    for n, p in ours.named_parameters():
        if n in weights:
            assert torch.allclose(p, weights[n], atol=1e-6), n


def test_folded_adapter_computes_the_same_and_restores_the_very_weights(tiny_model):
    ours, tok = M.load(tiny_model)
    ids = sample_ids(tok)
    lora.add_lora(ours, rank=4, alpha=8, dropout=0.1, name="teacher")
    lora.add_lora(ours, rank=4, alpha=8, dropout=0.1)
    for name, seed in (("teacher", 1), ("default", 2)):
        randomize_adapter(ours, name, seed)
    weights = {n: (p, p.detach().clone()) for n, p in ours.named_parameters() if not p.requires_grad}
    ours.eval()
    with torch.no_grad():
        expected = {}
        for name in ("default", "teacher"):
            with lora.use_adapter(ours, name):
                expected[name] = ours(ids)
        with lora.folded_adapter(ours):
            folded = ours(ids)
            q = ours.model.layers[0].self_attn.q_proj
            original = weights["model.layers.0.self_attn.q_proj.weight"][0]
            assert q.merged == "default" and q.weight is not original
            assert q.weight.stride() == original.stride()  # the layout load() chose (column-major here, fp32)
        with lora.use_adapter(ours, "teacher"), lora.folded_adapter(ours):
            folded_teacher = ours(ids)
    assert (folded - expected["default"]).abs().max() < 1e-4
    assert (folded_teacher - expected["teacher"]).abs().max() < 1e-4
    assert (folded - folded_teacher).abs().max() > 1e-2  # each folded its own adapter
    # the same tensors, bit for bit, and the adapters back in charge
    current = dict(ours.named_parameters())
    for n, (tensor, values) in weights.items():
        assert current[n] is tensor and torch.equal(tensor, values), n
    assert all(layer.merged is None for layer in lora.lora_layers(ours).values())
    with torch.no_grad():
        assert torch.equal(ours(ids), expected["default"])
    ours.train()  # adapter dropout in train mode has no folded form: left as it is
    with lora.folded_adapter(ours):
        assert all(layer.merged is None for layer in lora.lora_layers(ours).values())


def test_adapter_for_other_base_is_a_one_line_error(tiny_models, tmp_path):
    other, _ = M.load(tiny_models["untied"])
    lora.add_lora(other, rank=4, alpha=8)
    lora.save_adapter(other, str(tmp_path / "other"))
    ours, _ = M.load(tiny_models["tied"])
    with pytest.raises(M.InputError, match="another base model") as e:
        lora.load_adapter(ours, str(tmp_path / "other"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not allowed"):
        lora.add_lora(ours, rank=2, alpha=2, name="keys")
    with pytest.raises(FileNotFoundError, match="run folder"):
        lora.load_adapter(ours, str(tmp_path / "nothing"))


def test_adapters_that_are_not_plain_lora_of_this_base_are_one_line_errors(tiny_model, tmp_path):
    """Each damaged or foreign adapter is refused by name, never loaded half or at the wrong
    scale (rsLoRA scales by alpha / sqrt(r), not alpha / r)."""
    import json
    from safetensors.torch import load_file, save_file
    ours, _ = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=8)
    lora.save_adapter(ours, str(tmp_path / "good"))
    tensors = load_file(str(tmp_path / "good" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
    some_key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)

    def damaged(name, state=tensors, **changes):
        folder = tmp_path / name
        folder.mkdir()
        save_file(state, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(folder)

    cases = [
        (damaged("bias", {**tensors, some_key.replace("lora_A.weight", "bias"): torch.zeros(4)}), "unexpected tensor"),
        (damaged("extra_layer", {**tensors, some_key.replace("layers.0.", "layers.99."): tensors[some_key].clone()}),
         "names a layer the base model does not have"),
        (damaged("missing", {k: v for k, v in tensors.items() if k != some_key}), "some LoRA tensors are missing"),
        (damaged("rslora", use_rslora=True), "only plain LoRA"),
        (damaged("dora", use_dora=True), "only plain LoRA"),
        (damaged("ia3", peft_type="IA3"), "only plain LoRA"),
    ]
    cut_short = damaged("cut_short")
    (tmp_path / "cut_short" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "good" / "adapter_model.safetensors").read_bytes()[:100])
    edited = damaged("edited")
    (tmp_path / "edited" / "adapter_config.json").write_text(json.dumps(config)[:-1])
    cases += [(cut_short, "adapter_model.safetensors is not a readable safetensors file"),
              (edited, "adapter_config.json is not valid JSON")]
    for folder, message in cases:
        fresh, _ = M.load(tiny_model)
        with pytest.raises(M.InputError, match=message) as e:
            lora.load_adapter(fresh, folder)
        assert "\n" not in str(e.value), folder
    fresh, _ = M.load(tiny_model)
    lora.load_adapter(fresh, str(tmp_path / "good"))  # the undamaged files load


class ReplayedDropout(torch.nn.Module):
    """peft's dropout of one layer's LoRA input, taking the next of the masks ours drew:
    both models call their layers in the same order (q, k, v, o, gate, up, down)."""

    def __init__(self, masks, p):
        super().__init__()
        self.masks, self.p = masks, p

    def forward(self, x):
        kept = self.masks.pop(0)
        assert kept.shape == x.shape
        return x * (kept * torch.ones((), dtype=x.dtype).div_(1 - self.p))


@pytest.mark.parametrize("device,dtype,dropout", [("cpu", "fp32", 0.0), ("cpu", "bf16", 0.0), ("cpu", "fp32", 0.2)] + [
    (device, dtype, 0.0) for device in DEVICES if device != "cpu" for dtype in ("fp32", "bf16")])
def test_lora_gradients_equal_pefts(tiny_model, tmp_path, monkeypatch, device, dtype, dropout):
    # the whole training pass against transformers + peft: our norms', MLP's, attention's
    # and output layer's backward passes, with the same adapter and transformers' own loss;
    # with dropout, peft's layers drop out what ours dropped out (ReplayedDropout).
    # On CUDA both run under the scripts' autocast (M.autocast)
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM
    ours, tok = M.load(tiny_model, device=device, dtype=dtype)
    lora.add_lora(ours, rank=4, alpha=8, dropout=dropout)
    randomize_adapter(ours, "default", seed=2)  # B != 0, so every LoRA matrix gets a gradient
    lora.save_adapter(ours, str(tmp_path / "adapter"))
    base = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    ref = PeftModel.from_pretrained(base.to(device), str(tmp_path / "adapter"), is_trainable=True)
    ours.train(), ref.train()  # dropout draws in training mode only
    texts = ["Question: Tom has 12 marbles and gives 5 away. How many are left?\nAnswer: 7",
             "Question: A box holds 6 eggs. How many eggs are in 4 boxes?\nAnswer: 24"]
    length = min(len(tok.encode(t)) for t in texts)
    ids = torch.tensor([tok.encode(t)[:length] for t in texts], device=device)  # one length: no padding on either side
    masks = []
    if dropout:
        drawn = lora.keep_mask
        monkeypatch.setattr(lora, "keep_mask", lambda x, p: masks.append(drawn(x, p)) or masks[-1])
        for module in ref.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout["default"] = ReplayedDropout(masks, dropout)
    with M.autocast(ids.device):
        (-M.sequence_logprobs(ours, ids.tolist(), [1, 1])[0].mean()).backward()
    assert len(masks) == (7 * ours.config.num_hidden_layers if dropout else 0)
    with M.autocast(ids.device):
        ref(input_ids=ids, labels=ids).loss.backward()
    assert not masks  # peft took every one
    theirs = {n: p.grad.cpu() for n, p in ref.named_parameters() if p.requires_grad}
    got = {f"base_model.model.{n}.weight": p.grad.cpu() for n, p in ours.named_parameters() if p.requires_grad}
    assert got.keys() == theirs.keys() and len(got) == 2 * 7 * ours.config.num_hidden_layers
    for name, grad in got.items():
        scale = theirs[name].abs().max().item()
        # fp32 on the CPU: float rounding; bf16 (and CUDA's autocast): the two round every
        # activation, and peft runs the adapter's products in fp32
        bound = 1e-5 * scale if dtype == "fp32" and device == "cpu" else 5e-2 * scale
        assert scale > 0 and (grad - theirs[name]).abs().max() <= bound, name


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_lora_dropout_keeps_a_one_byte_mask_and_computes_what_autograd_does(dtype, autocast):
    # autocast: products in bf16 over fp32 inputs, as training on CUDA runs them
    x0, A0 = torch.randn(2, 32, 64, dtype=dtype), torch.randn(8, 64, dtype=dtype)
    results, kept = [], []

    def by_autograd(x, A):  # dropout as F.dropout forms it, over the same mask
        noise = lora.keep_mask(x, 0.1) * torch.ones((), dtype=x.dtype).div_(1 - 0.1)
        return torch.nn.functional.linear(x * noise, A)
    for down in (by_autograd, lambda x, A: lora.DroppedDown.apply(x, A, 0.1)):
        x, A = x0.clone().requires_grad_(), A0.clone().requires_grad_()
        saved = {}  # storage -> bytes of what the backward pass keeps, x itself aside

        def keep(t):
            if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", enabled=autocast):
            out = down(x, A)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype))
        results.append((out, x.grad, A.grad))
        kept.append(sum(saved.values()) - A.numel() * A.element_size())
    assert all(torch.equal(a, b) for a, b in zip(*results))  # the same draws, values and gradients, to the bit
    assert (results[0][1] == 0).any()  # some inputs were dropped
    assert kept[1] == x0.numel() < kept[0]  # one byte an element, where autograd keeps x's dropped copy and the noise


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_keep_mask_keeps_each_element_with_probability_one_minus_p_independently(p):
    x = torch.empty(1001, 1001)  # an odd count: the last 64-bit draw is half used
    torch.manual_seed(0)
    kept = lora.keep_mask(x, p)
    assert kept.shape == x.shape and kept.dtype == torch.bool
    n = x.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * sigma
    flat = kept.flatten().double()
    # each element's two halves of a 64-bit draw, and neighbours, are as likely as any
    for part in (flat[0::2], flat[1::2], flat[0::3]):
        assert abs(part.mean().item() - (1 - p)) < 5 * sigma * (n / len(part)) ** 0.5
    both = (flat[:-1] * flat[1:]).mean().item()  # P(two neighbours kept) = q^2, q = 1 - p
    # its spread: each pair's variance q^2 (1 - q^2), and each pair's covariance with the
    # two pairs it overlaps, q^3 - q^4
    q = 1 - p
    sigma_both = ((q ** 2 * (1 - q ** 2) + 2 * (q ** 3 - q ** 4)) / n) ** 0.5
    assert abs(both - q ** 2) < 4 * sigma_both
    torch.manual_seed(0)
    assert torch.equal(lora.keep_mask(x, p), kept)  # drawn from the default generator: a seed repeats it
    assert not torch.equal(lora.keep_mask(x, p), kept)
    assert lora.keep_mask(x, 0.0).all()


def test_update_norm_is_the_norm_of_every_layers_weight_change(tiny_model, tmp_path):
    ref = peft_model(tiny_model, r=4, alpha=12)  # random B, scale 3
    ref.save_pretrained(str(tmp_path / "peft"))
    ours, _ = M.load(tiny_model)
    lora.load_adapter(ours, str(tmp_path / "peft"))
    # the explicit (out, in) weight changes, as merge() would add them
    expected = sum(layer.delta_weight("default").double().pow(2).sum() for layer in lora.lora_layers(ours).values()) ** 0.5
    got = lora.update_norm(str(tmp_path / "peft"))
    assert expected > 0 and abs(got - expected.item()) < 1e-6 * expected.item()  # delta_weight rounds in fp32
    lora.save_adapter(ours, str(tmp_path / "ours"))  # our own files give the same
    assert abs(lora.update_norm(str(tmp_path / "ours")) - got) < 1e-9 * got
    from safetensors.torch import load_file, save_file
    path = str(tmp_path / "ours" / "adapter_model.safetensors")
    save_file({k: v for k, v in load_file(path).items() if "layers.1.mlp.up_proj.lora_B" not in k}, path)
    with pytest.raises(M.InputError, match="up_proj.lora_A.weight has no lora_B beside it"):
        lora.update_norm(str(tmp_path / "ours"))


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_zero():
    peak, total = 1e-3, 100
    lr = [lora.lr_at(step, total, peak, 0.1) for step in range(total + 1)]  # 10 warmup steps
    assert lr[0] == pytest.approx(peak / 10)  # the first step already learns
    assert lr[4] == pytest.approx(peak / 2) and lr[9] == pytest.approx(peak)
    assert lr[10] == pytest.approx(peak)  # the decay starts from the peak
    assert lr[55] == pytest.approx(peak / 2)  # halfway through the 90 decay steps
    assert lr[100] == pytest.approx(0, abs=1e-18)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lora.lr_at(0, total, peak, 0.0) == peak  # no warmup: the first step at the peak
    assert lora.lr_at(1, 2, peak, 0.0) == pytest.approx(peak / 2)


@pytest.mark.parametrize("grad_clip,expected", [(1.0, [-0.6, -0.8]), (10.0, [-3.0, -4.0]), (0.0, [-3.0, -4.0])])
def test_optimizer_step_clips_the_gradient_norm_before_the_step(grad_clip, expected):
    # plain SGD with lr 1, so the update is the gradient as clipped (AdamW would hide the scale)
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([3.0, 4.0])
    args = argparse.Namespace(lr=1.0, warmup=0.0, grad_clip=grad_clip)
    lr, grad_norm = lora.optimizer_step(optimizer, 0, 10, args)
    assert lr == 1.0 and grad_norm == pytest.approx(5.0)  # the norm before clipping, as logged
    assert torch.allclose(p.detach(), torch.tensor(expected)) and p.grad is None


def test_micro_batches_split_in_order_under_the_token_bound():
    lengths = [5, 9, 3, 3, 12, 4, 4, 4]
    sequences = [[b] * n for b, n in enumerate(lengths)]  # no two open alike
    # without a bound, --grad-accum alone: ceil(8 / n) sequences a pass
    assert lora.micro_batches(sequences, 1, 0, "cpu") == [(0, 8)]
    assert lora.micro_batches(sequences, 3, 0, "cpu") == [(0, 3), (3, 6), (6, 8)]
    # on a GPU rows are as long as a pass's longest sequence; at 18 tokens each pass's rows
    # times that length stay at most 18: 9 | 5 3 is two rows of 9, adding a 3 would make three
    assert lora.micro_batches(sequences, 1, 18, "cuda") == [(0, 3), (3, 4), (4, 5), (5, 8)]
    # the bound and --grad-accum together: whichever splits first
    assert lora.micro_batches(sequences, 4, 18, "cuda") == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
    # on the CPU a pass is one row of its sequences end to end: 5 9 3, 3 12, 4 4 4
    assert lora.micro_batches(sequences, 1, 18, "cpu") == [(0, 3), (3, 5), (5, 8)]
    assert lora.micro_batches(sequences, 4, 18, "cpu") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for device in ("cpu", "cuda"):
        # a sequence longer than the bound runs alone rather than not at all
        assert lora.micro_batches(sequences, 1, 10, device) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 7), (7, 8)]
        # sharing rows fits more sequences a pass than one row each would: 3 x 9 = 27
        assert lora.micro_batches([[b] * n for b, n in enumerate([9, 3, 3, 3, 9])], 1, 27, device) == [(0, 5)]
        assert lora.micro_batches([], 2, 10, device) == []


@pytest.mark.parametrize("device, passes", [("cpu", 2), ("cuda", 3)])
def test_micro_batches_count_a_common_prefix_once(device, passes):
    """OPD's continuations of one rollout share it up to their cuts: laid out once, the
    prefix lets more of them into a pass, and each pass still holds at most the bound."""
    import random
    rng = random.Random(0)
    rollouts = [[rng.randrange(1000) for _ in range(40)] for _ in range(4)]
    # a long sequence, then each rollout continued from four cuts: 50 tokens laid out once
    sequences = [[rng.randrange(1000) for _ in range(100)]]
    sequences += [r[:cut] + [rng.randrange(1000) for _ in range(5)] for r in rollouts for cut in (20, 25, 30, 35)]
    alone = [[1000 + b] * len(s) for b, s in enumerate(sequences)]  # the same lengths, nothing in common
    bound = 2 * max(map(len, sequences))
    ranges = lora.micro_batches(sequences, 1, bound, device)
    for lo, hi in ranges:
        assert M.laid_out(M.training_rows(sequences[lo:hi], device)[0]) <= bound
    assert len(ranges) == passes and len(lora.micro_batches(alone, 1, bound, device)) == 4
    # every split gallops to the longest run that fits, as adding one sequence at a time would
    for bound in range(100, 600, 7):
        ranges, lo = lora.micro_batches(sequences, 1, bound, device), 0
        for first, end in ranges:
            assert first == lo
            fits = [M.laid_out(M.training_rows(sequences[first:hi], device)[0]) <= bound
                    for hi in range(first + 1, len(sequences) + 1)]
            assert end - first == (fits + [False]).index(False) or end - first == 1
            lo = end
        assert lo == len(sequences)


def test_a_run_killed_anywhere_in_a_checkpoint_write_resumes_from_a_whole_checkpoint(tiny_model, tmp_path):
    """A checkpoint write killed after any of its file operations (os._exit in a forked
    child: no cleanup runs, as under SIGKILL or a power cut) leaves the previous checkpoint
    or the new one, each whole: a resume loads one of them exactly."""
    import argparse
    import os
    import shutil
    import safetensors.torch
    args = argparse.Namespace(save_every=2, snapshot_every=0, seed=0, model=tiny_model, rank=4, alpha=8)

    def fresh_model():
        model, _ = M.load(tiny_model)
        lora.add_lora(model, rank=4, alpha=8)
        return model, torch.optim.AdamW(lora.lora_parameters(model), lr=0.1)

    def train_step(seed):
        torch.manual_seed(seed)
        for p in lora.lora_parameters(model):
            p.grad = torch.randn_like(p)
        optimizer.step()
        return {k: v.clone() for k, v in lora.adapter_state(model, "default").items()}

    saved = {}
    operations = [(os, "replace"), (shutil, "rmtree"), (torch, "save"), (safetensors.torch, "save_file")]
    for kill_after in range(1, 100):
        folder = str(tmp_path / f"kill-{kill_after}")
        model, optimizer = fresh_model()
        run = lora.RunFolder(folder, args, resume=False)
        saved[2] = train_step(2)
        run.save(model, optimizer, 2)
        saved[4] = train_step(4)
        child = os.fork()
        if child == 0:  # count the file operations of the second write; die after the chosen one
            exit_code = 2  # an error: never return into the test run from the child
            try:
                done = [0]
                for module, name in operations:
                    def counted(*a, _original=getattr(module, name), **k):
                        result = _original(*a, **k)
                        done[0] += 1
                        if done[0] == kill_after:
                            os._exit(3)
                        return result
                    setattr(module, name, counted)
                run.save(model, optimizer, 4)
                exit_code = 0
            finally:
                os._exit(exit_code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) in (0, 3), kill_after
        fresh, fresh_optimizer = fresh_model()
        step = lora.RunFolder(folder, args, resume=True).resume(fresh, fresh_optimizer)
        assert step in (2, 4), (kill_after, step)
        loaded = lora.adapter_state(fresh, "default")
        assert all(torch.equal(loaded[k], saved[step][k]) for k in loaded), kill_after
        assert fresh_optimizer.state_dict()["state"][0]["step"] == step // 2
        if os.waitstatus_to_exitcode(status) == 0:  # the write finished before the chosen operation
            assert step == 4 and kill_after > 5  # it did kill the earlier writes
            break
    else:
        pytest.fail("the checkpoint write never finished")


def test_a_folder_in_use_by_another_process_stops_a_second_run_in_one_line(tmp_path, monkeypatch, capsys):
    """Two runs writing one folder would interleave their logs and overwrite each other's
    checkpoints, so the second stops, naming the first's pid. A killed holder leaves no
    lock behind, and a finished run, a refused start and a training loop ended by an error
    let the folder go, also in a process that lives on (a notebook)."""
    import os
    args = argparse.Namespace(save_every=2, snapshot_every=0, seed=0, model="m", rank=4, alpha=8)
    folder = str(tmp_path / "run")

    def another_process_can_take_it():
        holder = hold_in_another_process(folder)  # fails its readline if it cannot
        holder.kill()
        holder.wait()

    holder = hold_in_another_process(folder)
    try:
        with pytest.raises(M.InputError, match=rf"^{folder} is in use by another process \(pid {holder.pid}\); wait"):
            lora.RunFolder(folder, args, resume=False)
        assert not os.path.exists(os.path.join(folder, "run.json"))  # and touched nothing
    finally:
        holder.kill()
        holder.wait()
    run = lora.RunFolder(folder, args, resume=False)  # SIGKILL ended the hold with the process
    lora.RunFolder(folder, args, resume=False)  # this process holds it already: the same run going on
    run.finish(0)
    another_process_can_take_it()
    with pytest.raises(M.InputError, match="has no checkpoint to resume from"):
        lora.RunFolder(folder, args, resume=True)
    another_process_can_take_it()
    run = lora.RunFolder(folder, args, resume=False)
    with pytest.raises(RuntimeError), run.stop_between_steps():
        raise RuntimeError("out of memory")
    another_process_can_take_it()
    # reproduce.py's and toy.py's hold on their --out: for the block, however it ends
    with pytest.raises(RuntimeError), lora.holding(folder):
        with pytest.raises(AssertionError):
            another_process_can_take_it()
        raise RuntimeError("a stage failed")
    another_process_can_take_it()
    lora.hold(folder)
    with lora.holding(folder):  # held before the block: still held after it
        pass
    with pytest.raises(AssertionError):
        another_process_can_take_it()
    lora.let_go(folder)
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # a mount without locks: one note, and the run goes on
    os.makedirs(tmp_path / "lockless")  # a folder there already: RunFolder holds it before and after its checks
    run = lora.RunFolder(str(tmp_path / "lockless"), args, resume=False)
    assert capsys.readouterr().out.count("note: cannot lock") == 1
    run.finish(0)
    monkeypatch.setattr(lora, "fcntl", None)  # as on Windows: no lock, but the folder is made all the same
    lora.hold(str(tmp_path / "unlocked"))
    assert os.listdir(tmp_path / "unlocked") == [] and os.path.realpath(tmp_path / "unlocked") not in lora.HELD
