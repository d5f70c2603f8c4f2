import pytest
import torch

import lora
import model as M
import train
from conftest import DEVICES, randomize_adapter
from plumbing.files import InputError


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


def test_folded_adapter_computes_the_same_in_fp32_and_restores_the_very_weights(tiny_model):
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
        with lora.folded(ours):
            folded = ours(ids)
            q = ours.model.layers[0].self_attn.q_proj
            assert q.merged == "default" and q.weight is not weights["model.layers.0.self_attn.q_proj.weight"][0]
        with lora.use_adapter(ours, "teacher"), lora.folded(ours):
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
    with lora.folded(ours):
        assert all(layer.merged is None for layer in lora.lora_layers(ours).values())
    ours.eval().bfloat16()  # nor is anything folded in bf16, where the fold would round the update away
    with lora.folded(ours):
        assert all(layer.merged is None for layer in lora.lora_layers(ours).values())


def test_adapter_for_other_base_is_a_one_line_error(tiny_models, tmp_path):
    other, _ = M.load(tiny_models["untied"])
    lora.add_lora(other, rank=4, alpha=8)
    lora.save_adapter(other, str(tmp_path / "other"))
    ours, _ = M.load(tiny_models["tied"])
    with pytest.raises(InputError, match="another base model") as e:
        lora.load_adapter(ours, str(tmp_path / "other"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not allowed"):
        lora.add_lora(ours, rank=2, alpha=2, name="keys")
    with pytest.raises(InputError, match="no adapter_config.json \\+ adapter_model.safetensors; is this a run folder"):
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
        (damaged("lm_head", target_modules=[*config["target_modules"], "lm_head"]), "LoRA on lm_head is not supported"),
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
        with pytest.raises(InputError, match=message) as e:
            lora.load_adapter(fresh, folder)
        assert "\n" not in str(e.value), folder
    fresh, _ = M.load(tiny_model)
    lora.load_adapter(fresh, str(tmp_path / "good"))  # the undamaged files load


class ReplayedDropout(torch.nn.Module):
    """peft's dropout of one layer's LoRA input, keeping what ours kept: both models call
    their layers in the same order (q, k, v, o, gate, up, down)."""

    def __init__(self, masks, p):
        super().__init__()
        self.masks, self.p = masks, p

    def forward(self, x):
        kept = self.masks.pop(0)
        assert kept.shape == x.shape
        return x * kept / (1 - self.p)


@pytest.mark.parametrize("device,dtype,dropout", [("cpu", "fp32", 0.0), ("cpu", "bf16", 0.0), ("cpu", "fp32", 0.2)] + [
    (device, dtype, 0.0) for device in DEVICES if device != "cpu" for dtype in ("fp32", "bf16")])
def test_lora_gradients_equal_pefts(tiny_model, tmp_path, monkeypatch, device, dtype, dropout):
    # the whole training pass against transformers + peft: our norms', MLP's, attention's and
    # output layer's backward passes, with the same adapter and transformers' own loss; with
    # dropout, peft's layers drop out what ours dropped out (ReplayedDropout)
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ours, tok = M.load(tiny_model, device, dtype)
    lora.add_lora(ours, rank=4, alpha=8, dropout=dropout)
    randomize_adapter(ours, "default", seed=2)  # B != 0, so every LoRA matrix gets a gradient
    lora.save_adapter(ours, str(tmp_path / "adapter"))
    base = Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=dtype)
    ref = PeftModel.from_pretrained(base.to(device), str(tmp_path / "adapter"), is_trainable=True)
    ours.train(), ref.train()  # dropout draws in training mode only
    texts = ["Question: Tom has 12 marbles and gives 5 away. How many are left?\nAnswer: 7",
             "Question: A box holds 6 eggs. How many eggs are in 4 boxes?\nAnswer: 24"]
    length = min(len(tok.encode(t)) for t in texts)
    ids = torch.tensor([tok.encode(t)[:length] for t in texts], device=device)  # one length: no padding on either side
    masks = []
    if dropout:
        drawn = torch.nn.functional.dropout
        monkeypatch.setattr(torch.nn.functional, "dropout",
                            lambda x, p, *a, **k: masks.append(drawn(x, p, *a, **k)) or masks[-1])
        for module in ref.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout["default"] = ReplayedDropout(masks, dropout)
    (-train.sequence_logprobs(ours, ids.tolist(), [1, 1])[0].mean()).backward()
    assert len(masks) == (7 * ours.config.num_hidden_layers if dropout else 0)
    masks[:] = [m != 0 for m in masks]  # the elements dropout kept
    ref(input_ids=ids, labels=ids).loss.backward()
    assert not masks  # peft took every one
    theirs = {n: p.grad.cpu() for n, p in ref.named_parameters() if p.requires_grad}
    got = {f"base_model.model.{n}.weight": p.grad.cpu() for n, p in ours.named_parameters() if p.requires_grad}
    assert got.keys() == theirs.keys() and len(got) == 2 * 7 * ours.config.num_hidden_layers
    for name, grad in got.items():
        scale = theirs[name].abs().max().item()
        # fp32 on the CPU: float rounding; bf16: both round every activation, and peft runs
        # the adapter's products in fp32 where ours runs them in the activations' dtype (a
        # scale or a layer gone wrong is off by the gradient's own size)
        bound = 1e-5 * scale if dtype == torch.float32 and device == "cpu" else 0.1 * scale
        assert scale > 0 and (grad.float() - theirs[name].float()).abs().max() <= bound, name


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
    with pytest.raises(InputError, match="up_proj.lora_A.weight has no lora_B beside it"):
        lora.update_norm(str(tmp_path / "ours"))


def test_cap_update_norm_scales_the_update_down_to_the_bound_and_keeps_its_direction(tiny_model):
    ours, _ = M.load(tiny_model)
    lora.add_lora(ours, rank=4, alpha=12)
    for layer in lora.lora_layers(ours).values():  # a trained-looking update: B away from zero
        torch.nn.init.normal_(layer.lora_B["default"], std=0.1)
    before = {n: layer.delta_weight("default").detach().clone() for n, layer in lora.lora_layers(ours).items()}
    norm = sum(d.double().pow(2).sum() for d in before.values()).item() ** 0.5
    assert lora.cap_update_norm(ours, 0.0) is None  # no cap: nothing measured, nothing moved
    assert lora.cap_update_norm(ours, 2 * norm) == pytest.approx(norm, rel=1e-6)  # under it: untouched
    after = {n: layer.delta_weight("default") for n, layer in lora.lora_layers(ours).items()}
    assert all(torch.equal(before[n], after[n]) for n in before)
    capped = lora.cap_update_norm(ours, norm / 3)
    assert norm / 3 * (1 - 2e-6) <= capped <= norm / 3
    for n, layer in lora.lora_layers(ours).items():  # every layer's change a third of what it was
        # each entry a sum of rank products, rounded in fp32: a millionth of the layer's largest
        assert (layer.delta_weight("default") - before[n] / 3).abs().max() <= 1e-6 * before[n].abs().max()
