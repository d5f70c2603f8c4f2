"""
Hand-rolled LoRA (Hu et al. 2021, arXiv 2106.09685): y = W x + (alpha / r) B A dropout(x),
A Kaiming-uniform and B zero, so that a fresh adapter leaves the model unchanged.

A LoRALinear keeps the base layer's `weight` (and `bias`) under their own names, so the
base state dict is untouched, and holds any number of named adapters beside it. One
adapter (or none) is active at a time for the whole model: a teacher (base + its adapter)
and a student (base + another) share one copy of the frozen base weights.

Files are PEFT's format (adapter_config.json + adapter_model.safetensors with keys like
base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), so
peft.PeftModel.from_pretrained opens our adapters and load_adapter opens theirs.
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing import provenance
from plumbing.files import InputError, read_json, read_safetensors_file, write_atomic, write_json

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = nn.ParameterDict()  # name -> (rank, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, rank)
        self.dropout, self.scaling = {}, {}  # name -> p, alpha / rank
        self.active = None  # the adapter in use, or None for the plain base layer
        self.merged = None  # the adapter whose update is folded into weight, if any

    def add(self, name, rank, alpha, dropout):
        if not name.isidentifier() or hasattr(nn.ParameterDict, name):
            raise ValueError(f"adapter name {name!r} is not allowed; use a plain identifier "
                             f"such as 'teacher'")
        A = torch.empty(rank, self.in_features, device=self.weight.device)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # as nn.Linear and PEFT initialise it
        self.lora_A[name] = nn.Parameter(A)
        B = torch.zeros(self.out_features, rank, device=self.weight.device)
        self.lora_B[name] = nn.Parameter(B)
        self.dropout[name], self.scaling[name] = dropout, alpha / rank

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        name = self.active
        if name is None or name == self.merged:
            return y
        # the adapter stays fp32 (and so does its optimizer state); its products run in the
        # activations' dtype like every other product of the model, in training and sampling alike
        A, B = self.lora_A[name].to(x.dtype), self.lora_B[name].to(x.dtype)
        p = self.dropout[name] if self.training else 0.0
        down = F.linear(F.dropout(x, p) if p > 0 else x, A)  # (..., rank)
        # scaled at rank width: fewer operations than at out
        return y + F.linear(down * self.scaling[name], B)

    def delta_weight(self, name):
        return (self.lora_B[name] @ self.lora_A[name]) * self.scaling[name]  # (out, in), in fp32

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, adapters={list(self.lora_A)}, "
                f"active={self.active}")


def lora_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model, rank=16, alpha=32, dropout=0.0, targets=TARGETS, name="default", activate=True):
    """Add a fresh adapter `name` to the targeted linear layers of every block (wrapping them
    in LoRALinear the first time); afterwards only that adapter's parameters train."""
    # model.TokenLogprobs reads lm_head's weight, not its output: the trainer would miss LoRA there
    if "lm_head" in targets:
        raise InputError(f"LoRA on lm_head is not supported; use an adapter of the blocks' "
                         f"linear layers ({', '.join(TARGETS)})")
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child).train(child.training))
    layers = {n: m for n, m in lora_layers(model).items() if n.rsplit(".", 1)[-1] in targets}
    if not layers:
        raise ValueError(f"no linear layer named any of {targets} in the model")
    for layer in layers.values():
        if name in layer.lora_A:
            raise ValueError(f"adapter {name!r} exists already; pick another name")
        layer.add(name, rank, alpha, dropout)
    model.requires_grad_(False)
    for p in lora_parameters(model, name):
        p.requires_grad_(True)
    model.lora_config = getattr(model, "lora_config", {})
    model.lora_config[name] = dict(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                   target_modules=sorted({n.rsplit(".", 1)[-1] for n in layers}))
    if activate:
        set_adapter(model, name)
    return model


def lora_parameters(model, name="default"):
    return [p for layer in lora_layers(model).values() if name in layer.lora_A
            for p in (layer.lora_A[name], layer.lora_B[name])]


def set_adapter(model, name):
    """Make `name` the adapter in use everywhere; None means the plain base model."""
    for layer in lora_layers(model).values():
        if layer.merged is not None and layer.merged != name:
            raise RuntimeError("an adapter is merged into the weights; unmerge before switching "
                               "adapters")
        layer.active = name if name in layer.lora_A else None
    return model


def active_adapter(model):
    active = (layer.active for layer in lora_layers(model).values() if layer.active is not None)
    return next(active, None)


class use_adapter:
    """with use_adapter(model, "teacher"): ... switches to an adapter and back."""

    def __init__(self, model, name):
        self.model, self.name = model, name

    def __enter__(self):
        self.previous = active_adapter(self.model)
        return set_adapter(self.model, self.name)

    def __exit__(self, *exc):
        set_adapter(self.model, self.previous)


@torch.no_grad()
def merge(model):
    """Fold the active adapter into the base weights: W += (alpha / r) B A. The weights are
    shared with any other adapter's user, and unmerge() restores them only up to rounding."""
    for layer in lora_layers(model).values():
        if layer.active is not None and layer.merged is None:
            layer.weight += layer.delta_weight(layer.active).to(layer.weight.dtype)
            layer.merged = layer.active


@torch.no_grad()
def unmerge(model):
    for layer in lora_layers(model).values():
        if layer.merged is not None:
            layer.weight -= layer.delta_weight(layer.merged).to(layer.weight.dtype)
            layer.merged = None


class folded:
    """with folded(model): ... runs each layer's active adapter folded into a copy of its
    weight, W + (alpha / r) B A, in fp32 only: one product per layer instead of three while
    sampling, and the same policy up to fp32 rounding. In bf16 the folded weight would round
    away every update entry below half the weight's spacing, however much its product with
    the inputs adds up: the sampler would draw from a policy nearer the base than the one
    being trained, so other dtypes run the adapter's own products, as training does. The
    model's weights are never written to (a teacher may share them): leaving restores them."""

    def __init__(self, model):
        self.model, self.swapped = model, []

    @torch.no_grad()
    def __enter__(self):
        for layer in lora_layers(self.model).values():
            name = layer.active
            if (name is None or layer.merged is not None or layer.weight.dtype != torch.float32
                    or (layer.training and layer.dropout[name] > 0)):
                continue
            self.swapped.append((layer, layer.weight))
            merged = layer.weight + layer.delta_weight(name)
            layer.weight = nn.Parameter(merged, requires_grad=False)
            layer.merged = name
        return self.model

    def __exit__(self, *exc):
        for layer, weight in self.swapped:
            layer.weight, layer.merged = weight, None
        self.swapped = []


# -----------------------------------------------------------------------------
# PEFT file format

def adapter_state(model, name="default"):
    """The tensors of one adapter under PEFT's key names."""
    return {f"{PEFT_PREFIX}{path}.lora_{kind}.weight":
            getattr(layer, f"lora_{kind}")[name].detach().float().contiguous()
            for path, layer in lora_layers(model).items() if name in layer.lora_A for kind in "AB"}


def save_adapter(model, folder, name="default", base_model=None):
    """adapter_config.json and adapter_model.safetensors in PEFT's format, each written
    atomically."""
    from safetensors.torch import save_file
    if name not in getattr(model, "lora_config", {}):
        raise ValueError(f"model has no adapter named {name!r}")
    os.makedirs(folder, exist_ok=True)
    cfg = model.lora_config[name]
    config = dict(peft_type="LORA", task_type="CAUSAL_LM",
                  base_model_name_or_path=base_model or getattr(model, "name_or_path", None),
                  r=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"],
                  target_modules=cfg["target_modules"], bias="none", fan_in_fan_out=False,
                  inference_mode=True, init_lora_weights=True, use_rslora=False, use_dora=False,
                  modules_to_save=None, layers_to_transform=None)
    state = adapter_state(model, name)
    write_atomic(os.path.join(folder, "adapter_model.safetensors"), lambda p: save_file(state, p))
    write_json(os.path.join(folder, "adapter_config.json"), config)


def read_adapter(folder):
    """(adapter_config.json, tensors under PEFT's key names) of a PEFT-format adapter folder."""
    config_path = os.path.join(folder, "adapter_config.json")
    weights_path = os.path.join(folder, "adapter_model.safetensors")
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise InputError(f"{folder}: no adapter_config.json + adapter_model.safetensors; is this a "
                         f"run folder?")
    cfg = read_json(config_path)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise InputError(f"{config_path}: only plain LoRA adapters are supported (no DoRA, no "
                         f"rsLoRA)")
    state = read_safetensors_file(weights_path)
    # peft writes keys without the adapter name; some tools keep ".default"
    return cfg, {k.replace(".lora_A.default.", ".lora_A.")
                  .replace(".lora_B.default.", ".lora_B."): v for k, v in state.items()}


def assign_adapter_tensors(model, state, name, source):
    """Copy PEFT-keyed tensors into adapter `name`, checking every key and shape."""
    layers = lora_layers(model)
    for key, tensor in state.items():
        ours = key.startswith(PEFT_PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))
        if not ours:
            raise InputError(f"{source}: unexpected tensor {key}; not a PEFT LoRA adapter")
        path, kind, _ = key[len(PEFT_PREFIX):].rsplit(".", 2)
        if path not in layers or name not in layers[path].lora_A:
            raise InputError(f"{source}: tensor {key} names a layer the base model does not have; "
                             f"was the adapter trained on another base model?")
        param = getattr(layers[path], kind)[name]
        if tensor.shape != param.shape:
            raise InputError(f"{source}: {key} has shape {tuple(tensor.shape)} but the base model "
                             f"needs {tuple(param.shape)}; the adapter was trained on another base "
                             f"model")
        with torch.no_grad():
            param.copy_(tensor)
    if len(state) != 2 * sum(name in layer.lora_A for layer in layers.values()):
        raise InputError(f"{source}: some LoRA tensors are missing for adapter {name!r}")


def restore_adapter(model, folder, name="default"):
    """The weights saved in folder back into adapter `name`, of the same shapes, in place: a
    resumed run's optimizer keeps its hold on them (runs.RunFolder)."""
    path = os.path.join(folder, "adapter_model.safetensors")
    assign_adapter_tensors(model, read_safetensors_file(path), name, path)


def load_adapter(model, folder, name="default", activate=True, trainable=False, sha256=None):
    """Open a PEFT-format adapter folder (ours or peft's) as adapter `name`; its sha256 (given,
    where the caller hashed it already) goes to model.lora_config[name]["sha256"], naming the
    adapter an evaluation measured."""
    cfg, state = read_adapter(folder)
    targets = cfg["target_modules"]
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    trainable_before = [p for p in model.parameters() if p.requires_grad]
    add_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), targets, name,
             activate=False)
    assign_adapter_tensors(model, state, name, os.path.join(folder, "adapter_model.safetensors"))
    for p in lora_parameters(model, name):
        p.requires_grad_(trainable)
    for p in trainable_before:  # add_lora froze everything else: what trained before trains again
        p.requires_grad_(True)
    model.lora_config[name].update(base_model_name_or_path=cfg.get("base_model_name_or_path"),
                                   sha256=sha256 or provenance.adapter_sha256(folder))
    if activate:
        set_adapter(model, name)
    return model


def update_norm(folder):
    """||delta W||_F over every layer the adapter in folder adapts: how far training moved the
    weights, the weight-space counterpart of drift.py's state-space MMD."""
    return delta_norm([(s, A, B) for _, s, A, B in adapter_updates(folder)])


def adapter_updates(folder):
    """(module name, scaling s, A, B) of each layer the adapter in folder adapts: its update is
    s B A."""
    cfg, state = read_adapter(folder)
    updates = []
    for key, A in state.items():
        if key.endswith(".lora_A.weight"):
            B = state.get(key.replace(".lora_A.", ".lora_B."))
            if B is None:
                raise InputError(f"{folder}: {key} has no lora_B beside it; the adapter file is "
                                 f"incomplete")
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            updates.append((module, cfg["lora_alpha"] / cfg["r"], A, B))
    return updates


def delta_norm(triples):
    """||delta W||_F of (scaling s, A, B) layers: per layer ||s B A||_F^2 = s^2 tr((B^T B)(A A^T)),
    two rank x rank products instead of the out x in matrix, in float64, since the terms span
    orders of magnitude."""
    total = torch.zeros((), dtype=torch.float64)
    for s, A, B in triples:
        A, B = A.detach().double(), B.detach().double()
        total = total + s * s * torch.trace((B.T @ B) @ (A @ A.T)).cpu()
    return total.sqrt().item()


def cap_update_norm(model, bound, name="default"):
    """--max-update-norm: where the adapter's update norm (update_norm's, on the live model) is
    above bound, scale its A and B each by sqrt(bound / norm), so that the norm is bound (less a
    millionth, which fp32 rounding cannot cross). The norm after, or None for bound 0 (no cap:
    the adapter untouched)."""
    if not bound:
        return None
    triples = [(m.scaling[name], m.lora_A[name], m.lora_B[name])
               for m in lora_layers(model).values() if name in m.lora_A]
    norm = delta_norm(triples)
    if norm <= bound:
        return norm
    factor = math.sqrt(bound * (1 - 1e-6) / norm)
    with torch.no_grad():
        for _, A, B in triples:  # the parameters themselves: scaled in place
            A.mul_(factor)
            B.mul_(factor)
    return delta_norm(triples)
