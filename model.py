"""
Qwen3 (dense) in one file: config, RMSNorm, rotary embedding, grouped-query attention
with per-head q/k RMSNorm, SwiGLU MLP, tied or untied lm_head, a KV cache object, and
load() from a local folder or a Hugging Face hub id, plus a small tokenizer wrapper.

Module names are Hugging Face's (model.layers.N.self_attn.q_proj, ...), so an official
model.safetensors loads with load_state_dict and no name map, and LoRA keys match PEFT's.
Numerics follow transformers' Qwen3ForCausalLM (tests/test_model.py checks parity).

Four autograd Functions write their backward passes by hand to keep less for them or to
skip tensors of vocabulary width: RMSNormFunction, SwiGLU, HeadLogprob and HeadKL. Their
forward passes compute what the plain operations compute; tests hold their gradients to
autograd's, and the whole LoRA training pass to transformers + peft (tests/test_lora.py).
"""
import argparse
import errno
import functools
import json
import os
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy

DEFAULT_MODEL = "Qwen/Qwen3-0.6B-Base"


class InputError(ValueError):
    """A mistake in what the user passed (a flag, a model folder, a checkpoint, an adapter,
    a dataset file) rather than in the code. Its message names the problem and the fix, and
    a script ends with that one line instead of a traceback (run_script)."""


# -----------------------------------------------------------------------------
# config

@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False
    eos_token_id: int = None  # from generation_config.json when present, else config.json
    pad_token_id: int = None

    @classmethod
    def from_dict(cls, d, source="config.json"):
        d = dict(d)
        # transformers >= 5 writes rope_parameters instead of a top-level rope_theta
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", "default") if rope else (d.get("rope_scaling") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise InputError(f"{source}: rope type {rope_type!r} is not supported; only plain rotary embeddings (Qwen3 dense) are")
        if d.get("use_sliding_window"):
            raise InputError(f"{source}: use_sliding_window=true is not supported; set it to false")
        if d.get("model_type", "qwen3") != "qwen3":
            raise InputError(f"{source}: model_type is {d['model_type']!r}; this file implements 'qwen3' only")
        required = [f.name for f in fields(cls) if f.name not in ("attention_bias", "eos_token_id", "pad_token_id")]
        missing = [n for n in required if n not in d]
        if missing:
            raise InputError(f"{source}: missing field(s) {', '.join(missing)}; is this a Qwen3 config.json?")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids: the first is the end-of-text token
            eos = eos[0]
        return cls(**{n: d[n] for n in required}, attention_bias=bool(d.get("attention_bias", False)),
                   eos_token_id=eos, pad_token_id=d.get("pad_token_id"))


# -----------------------------------------------------------------------------
# layers

FEW_ROWS = 16  # up to this many rows, bf16 products on an AMX CPU take the weight-first form
FEW_ROW_FORMS = None  # None: where the CPU has AMX (cpu_has_amx); True or False forces them (bench/layout.py)


def linear(x, weight, bias=None, dtype=None):
    """F.linear(x, weight, bias), converted to dtype if given, with the product in the order
    the CPU's bf16 kernels run fastest. On a CPU with AMX, for a decode step's few rows
    oneDNN multiplies the (out, in) weight by the (in, rows) inputs faster than the (rows,
    in) inputs by the weight's transpose, and a single row fastest as a matrix-vector
    product: over Qwen3-0.6B's weights about a fifth faster at 1 and 8 rows, a tenth at 2 to
    16, no steady difference at 32 to 64, slower at training sizes. The same sums in another
    order, so values agree to bf16 rounding. Without AMX these forms were the slower ones
    (0.54x to 0.84x F.linear's speed at 1 to 8 rows on an AMD EPYC with AVX512-BF16; 0.16x
    to 0.75x at 2 to 8 rows on a Xeon without bf16 instructions, where only the single row
    gained, 1.11x), so there F.linear serves; bench/layout.py measures both on any
    machine. In fp32 the column-major weights of lay_out_weights already give the plain
    form this speed with MKL, and on AMD CPUs the larger ones go to oneDNN (fp32_by_onednn),
    mostly row-major, with a gradient through OneDNNLinear. Inside packed_weights
    (sample.generate) the decoder layers' and the output layer's products take a faster
    form still; this one serves every forward pass outside it."""
    # over a strided slice of a column-major weight oneDNN took 1,000 times MKL's time
    if (x.dtype == torch.float32 and fp32_by_onednn(weight) and not torch.is_autocast_enabled("cpu")
            and dense(weight)):
        wants_gradient = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        y = OneDNNLinear.apply(x, weight, bias) if wants_gradient else onednn_product(x, weight, bias)
        return y if dtype is None else y.to(dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and 0 < rows <= FEW_ROWS and weight.stride(-1) == 1
            and (cpu_has_amx() if FEW_ROW_FORMS is None else FEW_ROW_FORMS)):
        y = F.linear(x, weight, bias)
        return y if dtype is None else y.to(dtype)
    x2d = x.reshape(rows, x.shape[-1])
    if rows == 1:  # the bias goes into the product, as in F.linear, so the sum is rounded once
        y = (torch.mv(weight, x2d[0]) if bias is None else torch.addmv(bias, weight, x2d[0]))[None]
        y = y if dtype is None else y.to(dtype)
    else:
        y = (weight @ x2d.t() if bias is None else torch.addmm(bias[:, None], weight, x2d.t())).t()
        # one copy both transposes and converts: for the output layer's fp32 logits at 8
        # rows a quarter of the time of a transposing copy and then a converting one
        y = y.contiguous() if dtype in (None, y.dtype) else y.to(dtype, memory_format=torch.contiguous_format)
    return y.view(*x.shape[:-1], weight.shape[0])


def dense(weight):
    """Whether a 2-d weight is dense in one order or the other: row-major or column-major."""
    return weight.is_contiguous() or weight.t().is_contiguous()


def onednn_product(x, weight, bias=None):
    """F.linear(x, weight, bias) by oneDNN's kernels, in x's dtype, without a gradient;
    weight in any strides."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """F.linear by oneDNN's kernels (fp32_by_onednn) with autograd's gradients: the input's
    by oneDNN too, as the product with the weight's transpose, the weight's and the bias's
    (where they train) as autograd forms them. Keeps what F.linear keeps: the weight, and
    the input only where the weight trains."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return onednn_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        d_x = onednn_product(grad, weight.t()) if ctx.needs_input_grad[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        d_weight = flat.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        d_bias = flat.sum(0) if ctx.needs_input_grad[2] else None
        return d_x, d_weight, d_bias


class Linear(nn.Linear):
    """nn.Linear computing with linear() above; the same parameters and state dict."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


PACK_ON_CPU = True  # False: packed_weights does nothing, saving its copy of the weights


def can_pack(weight):
    """Whether packed_weights() applies to this weight (packing_dtype)."""
    return packing_dtype(weight) is not None


def packing_dtype(weight):
    """The dtype in which packed_weights() packs this weight, or None where it does not:
    on a CPU whose PyTorch has oneDNN's linear, bf16 as bf16, and fp32 on AMD CPUs. There
    MKL's fp32 products of a few rows, which F.linear runs, were 1.6x (one row) to 3.8x (8
    rows) slower than oneDNN's over Qwen3-0.6B's layers; on the Intel Xeon where this was
    developed packing gained 1.09x at 8 rows in fp32 and lost at one row, so fp32 keeps MKL
    and column-major weights (lay_out_weights) there. Where oneDNN has no bf16 linear (a CPU
    without AVX-512), bf16 weights pack as fp32 copies, the products converting their
    inputs to fp32 and their outputs back: the same bf16 values in, fp32 sums, the outputs
    rounded to bf16 as bf16 products round them. On an AMD EPYC with AVX2 only PyTorch's own
    bf16 product of a (3,072, 1,024) weight took 3.8 ms at 8 rows against 2.1 ms so, and
    448 against 69 ms at 1,024 rows."""
    if not (PACK_ON_CPU and weight.device.type == "cpu"):
        return None
    if fp32_by_onednn(weight):
        return torch.float32
    if weight.dtype == torch.bfloat16:
        if onednn_linear_works(torch.bfloat16):
            return torch.bfloat16
        if onednn_linear_works(torch.float32):
            return torch.float32
    return None


ONEDNN_MIN_WEIGHT = 2 ** 19  # elements of an fp32 weight below which MKL's product is the quicker


def fp32_by_onednn(weight):
    """Whether fp32 products with this weight go to oneDNN's kernels rather than MKL's: on an
    AMD CPU, where MKL's ran at a quarter (a decode step's 8 rows, packed) to a half (700 to
    1,024 rows) of oneDNN's speed over Qwen3-0.6B's layers; with a gradient through
    OneDNNLinear. On Intel CPUs MKL is as fast or faster (packing gained 1.09x at 8 rows in
    fp32 and lost at one). Small weights stay with MKL: each oneDNN call costs about 40 us
    more, so on an AMD EPYC without AVX-512 a 256 x 256 weight ran at 0.3x (one row) to 0.7x
    (64 rows) MKL's speed, 512 x 512 even, 1024 x 512 1.05x to 1.5x (ONEDNN_MIN_WEIGHT)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.numel() >= ONEDNN_MIN_WEIGHT
            and cpu_vendor() == "AuthenticAMD" and onednn_linear_works(torch.float32))


@functools.cache
def onednn_linear_works(dtype=torch.bfloat16):
    """The two oneDNN operators packing relies on are internal to PyTorch (torch.compile
    uses them for frozen weights), so a build may lack them or call them otherwise: tried
    once per dtype on a 2 x 4 product, and packing is skipped, not failed, where they do
    not give it."""
    try:
        w = torch.arange(8, dtype=dtype).view(2, 4)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4, dtype=dtype),
                                               torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return torch.backends.mkldnn.is_available() and torch.equal(y, torch.tensor([[6.0, 22.0]], dtype=dtype))
    except (AttributeError, RuntimeError, TypeError):
        return False


@functools.cache
def cpu_vendor():
    """The CPU's vendor as Linux names it (GenuineIntel, AuthenticAMD), or "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


class PackedWeights:
    """The weights of one or more linear layers that read the same input (q, k and v; gate
    and up), stacked and reordered once into oneDNN's blocked layout, so that one product
    gives all their outputs. Used only while each layer still holds the very weight tensor
    it was made from, unchanged (same version), with no adapter of its own running beside
    it, and never when a gradient is wanted."""

    def __init__(self, *layers):
        self.layers = layers
        self.sources = [(layer.weight, layer.weight._version) for layer in layers]
        self.sizes = [layer.out_features for layer in layers]
        self.dtype = packing_dtype(layers[0].weight) or layers[0].weight.dtype
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers]) if len(layers) > 1 else layers[0].weight
            weight = weight.to(self.dtype)
            # oneDNN reorders a column-major weight itself, in two thirds of the time that a
            # transposing copy and then its reorder take
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight if dense(weight) else weight.contiguous())
            biases = [layer.bias for layer in layers]
            self.bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else weight.new_zeros(n) for b, n in zip(biases, self.sizes)]).to(self.dtype)

    def matches(self):
        return all(layer.weight is w and w._version == v and runs_alone(layer)
                   for layer, (w, v) in zip(self.layers, self.sources))

    def __call__(self, x):
        # bf16 packed as fp32 (packing_dtype): fp32 sums of the bf16 values, rounded to bf16
        y = onednn_product(x.to(self.dtype), self.packed, self.bias).to(x.dtype)
        return y.split(self.sizes, -1) if len(self.sizes) > 1 else (y,)


def runs_alone(layer):
    """Whether a layer's output is its weight's product alone: no LoRA adapter running beside it."""
    return getattr(layer, "active", None) == getattr(layer, "merged", None)


def runs_packed(packed, layers):
    """Whether a packed product (packed_weights) serves these layers now: one is set for
    them, it still matches them and no gradient is wanted."""
    return packed is not None and not torch.is_grad_enabled() and packed.layers == layers and packed.matches()


def project(x, packed, *layers):
    """Each layer's output for x: from one packed product where runs_packed, else layer by layer."""
    if runs_packed(packed, layers):
        return packed(x)
    return tuple(layer(x) for layer in layers)


def packing_groups(model):
    """The products packed_weights makes: module -> {name: layers}, four for each decoder
    layer and the output layer's."""
    groups = {model: {"head": (model.lm_head,)}}
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        groups[a] = {"qkv": (a.q_proj, a.k_proj, a.v_proj), "o": (a.o_proj,)}
        groups[m] = {"gate_up": (m.gate_proj, m.up_proj), "down": (m.down_proj,)}
    return groups


class packed_weights:
    """with packed_weights(model): ... runs forward passes on the CPU (where can_pack) with
    each decoder layer's weights packed into four products: q, k and v stacked, o, gate and
    up stacked, down (PackedWeights); and the output layer's for the sampler's logits
    (Qwen3.next_token_logits). For the few rows of a decode step oneDNN streams its own
    blocked layout from memory faster than a plain (out, in) matrix and returns rows directly
    (no transposing copy, see linear()), and stacking makes fewer, taller products, each
    with less fixed cost: over Qwen3-0.6B's 28 layers at 8 rows the products take 46 ms
    against 70 ms in F.linear's form, the output layer's 8.4 against 13.0 ms in bf16 and 16
    against 62 ms in fp32 on an AMD EPYC (bench/README.md; bench/layout.py times whole
    decodes). Costs one copy of the weights while inside (in fp32 where bf16 packs as fp32,
    packing_dtype), made on entry (about half a second for Qwen3-0.6B) and dropped on exit.
    Weights changed or swapped inside are noticed (PackedWeights.matches) and run unpacked.
    Does nothing off the CPU, in fp32 on a CPU other than AMD's, in other dtypes, or without
    oneDNN. rows, where given, is the most rows a decode step will have: a single row does
    not pack in fp32, since a matrix-vector product streams the row-major weights as fast
    as the blocked ones (on an AMD EPYC without AVX-512 the output layer's took 41 ms
    unpacked against 54 packed, an MLP layer's 1.7 against 2.2) and packing Qwen3-0.6B took
    about 2 s there; nor do bf16 weights that would pack as fp32, whose own bf16 product
    streams half the bytes (a (3,072, 1,024) weight 0.98 ms against 1.49 there)."""

    def __init__(self, model, rows=None):
        self.model, self.rows, self.previous = model, rows, []

    def __enter__(self):
        packed_as = packing_dtype(self.model.lm_head.weight)
        if packed_as is not None and not (self.rows == 1 and packed_as == torch.float32):
            for module, named in packing_groups(self.model).items():
                self.previous.append((module, module.packed))
                module.packed = {name: PackedWeights(*layers) for name, layers in named.items()
                                 if all(map(runs_alone, layers))}
        return self.model

    def __exit__(self, *exc):
        for module, packed in self.previous:
            module.packed = packed
        self.previous = []


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return RMSNormFunction.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)[0]


def rms_norm(x, weight, eps):
    """RMSNorm's output and 1 / rms(x). Normalised in fp32 whatever the activation dtype,
    like the reference implementation."""
    h = x.float()
    inverse_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * inverse_rms).to(x.dtype), inverse_rms


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm's forward pass by the very operations of rms_norm, and its backward
    pass in closed form: with n = x r the normalised input, r = 1 / rms(x) and g the
    gradient reaching n, d x = r (g - n mean(g n)). Autograd would keep the fp32 copy of
    a bf16 input, twice the input's bytes (10 MB per Qwen3-0.6B layer at 4 x 256 tokens);
    this keeps the input as it came and 1 / rms, and makes the copy again when needed."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, inverse_rms = rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, inverse_rms = ctx.saved_tensors
        normalised = x.float() * inverse_rms
        d_weight = None
        if ctx.needs_input_grad[1]:  # as autograd forms it: through the normalised input in x's dtype
            d_weight = (grad * normalised.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight).float()
        d_x = inverse_rms * (g - normalised * (g * normalised).mean(-1, keepdim=True))
        return d_x.to(x.dtype), d_weight, None


def rotary_cos_sin(positions, head_dim, theta, dtype):
    """cos and sin of the rotary angles, (B, 1, T, head_dim) each for positions (B, T), the
    sin's first half negated (see rotate). Angles in fp32 for accuracy at long range."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    sin = emb.sin()
    sin[..., :head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def rotate(x, cos, signed_sin):
    """Rotary embedding x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1) for
    x = (x1, x2) its two halves. Rolling x by half a head gives (x2, x1), and the sign goes
    into sin's first half once per pass (rotary_cos_sin) instead of a negation and a
    concatenation per head and layer: the same values to the bit (negation is exact), and
    two operations fewer for q and for k in every layer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def kv_cache_dtype(weight):
    """The dtype a KV cache keeps for a model whose weights are like `weight`: theirs,
    except bf16 on a CPU without AMX, where keys and values are kept in fp32 (the bf16
    values themselves, exact in fp32) and attention over the cache runs in fp32, its output
    rounded back to bf16. There PyTorch's attention kernel for a few queries over a cache
    ran 2.3x to 5.9x faster in fp32 than in bf16 (one query per row, Qwen3-0.6B's heads, 1 to
    64 rows, 50 to 400 cached positions, on an AMD EPYC with AVX512-BF16), and RL's group
    sampling, 64 rows, at 1.39x the speed. The cache takes fp32's memory. With AMX the bf16
    kernel is kept (the hardware it was developed on, where a hand-written attention in bf16
    ran 2 to 4 times slower than it)."""
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not cpu_has_amx():
        return torch.float32
    return weight.dtype


class KVCache:
    """Preallocated keys/values for every layer, (B, n_kv_heads, max_len, head_dim) each,
    in kv_cache_dtype. Passed to forward explicitly; `length` counts the positions already
    written. Positions past `length` hold whatever the memory held: attention reads only
    written ones, and fixed-shape decoding, which reads them all behind a mask, zeroes them
    first (zero_unwritten). Left unfilled, a page of the memory is first touched when a
    position on it is written, and never where none is (rows that end early); on the CPU,
    faulting fresh pages in is most of what filling them costs (zeros for 64 rows of 600
    positions at Qwen3-0.6B's shape in fp32, 8.8 GB, took 12 s on 2 cores of an AMD EPYC).

    rows (default batch_size) is the most rows select_rows makes in place, as when each
    prompt's row is repeated for its samples: the memory holds that many, and k[layer]
    and v[layer] are views of its first rows."""

    def __init__(self, config, batch_size, max_len, device, dtype, rows=None):
        shape = (max(batch_size, rows or 0), config.num_key_value_heads, max_len, config.head_dim)
        self.k_memory = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v_memory = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.k = [m[:batch_size] for m in self.k_memory]
        self.v = [m[:batch_size] for m in self.v_memory]
        self.length = 0
        self.max_len = max_len
        self.write_pos = None  # a 1-element tensor in fixed-shape decoding (Qwen3.decode_step)
        self.shared = None  # SharedColumns, where rows were copied from a common prompt (sample.prefill)

    def update(self, layer, k, v):
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)  # bf16 into an fp32 cache: exact
        if self.write_pos is not None:
            # in place at a position held in a tensor: the same kernels serve every step, so
            # the step can be captured once as a CUDA graph and replayed
            self.k[layer].index_copy_(2, self.write_pos, k)
            self.v[layer].index_copy_(2, self.write_pos, v)
            return self.k[layer], self.v[layer]
        T = k.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache full: {self.length}+{T} positions > max_len {self.max_len}")
        self.k[layer][:, :, self.length:self.length + T] = k
        self.v[layer][:, :, self.length:self.length + T] = v
        end = self.length + T
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def zero_unwritten(self):
        """Zeros past `length`: a masked-out key still multiplies its value by a zero
        weight, and a NaN left in the memory would make that NaN."""
        for t in self.k + self.v:
            t[:, :, self.length:].zero_()

    def select_rows(self, index):
        """Row i becomes old row index[i]: repeating a row lets one prefilled prompt serve
        several samples or answer choices; leaving rows out drops finished sequences.

        Within the rows the memory holds, rows move in place, written positions only, and
        only the rows that change: from the first row on when each takes a later one
        (leaving rows out, or filling their places with the last rows), from the last row
        back when each takes an earlier one (repeating rows in order), so that no row is
        overwritten before it is read. Any other index gathers every layer into new memory,
        which at Qwen3-0.6B's shape on the CPU cost 1 to 6 s a call at 64 rows in fp32,
        where a decode step takes half a second: more than dropping finished rows saved."""
        sources = index.tolist()
        capacity = len(self.k_memory[0])
        moves = [(row, source) for row, source in enumerate(sources) if row != source]
        upward, downward = all(s > r for r, s in moves), all(s < r for r, s in moves)
        if len(sources) <= capacity and (upward or downward):
            if downward:
                moves.reverse()  # the highest row first: each takes a row below it, not yet written
            for memory in self.k_memory + self.v_memory:
                for row, source in moves:
                    memory[row, :, :self.length] = memory[source, :, :self.length]
        else:
            shape = (len(sources),) + self.k_memory[0].shape[1:]
            for memory in (self.k_memory, self.v_memory):
                for layer, old in enumerate(memory):
                    memory[layer] = old.new_empty(shape)
                    memory[layer][:, :, :self.length] = old[:, :, :self.length].index_select(0, index)
        self.k = [m[:len(sources)] for m in self.k_memory]
        self.v = [m[:len(sources)] for m in self.v_memory]
        if self.shared is not None:
            self.shared = SharedColumns(self.shared.width, [self.shared.group[s] for s in sources])


class SharedColumns:
    """Rows of a KV cache that hold the same keys and values in their first `width`
    columns, copied from one prompt's (sample.prefill): group[r] names row r's source, and
    a decode step on the CPU reads those columns once per group rather than once per row
    (shared_prefix_attention)."""

    def __init__(self, width, group):
        self.width, self.group = width, list(group)
        rows = {}
        for r, g in enumerate(self.group):
            rows.setdefault(g, []).append(r)
        # (rows of a group, the row whose columns are read for all of them)
        self.groups = [(torch.tensor(members), members[0]) for members in rows.values()]
        self.any_shared = len(rows) < len(self.group)

    def pay(self, length):
        """Whether reading the columns once per group beats SDPA over every row's copy, for
        a cache of `length` columns: where some rows share and the shared columns are more
        than a third of them. At Qwen3-0.6B's heads in fp32 on 2 cores of an AMD EPYC, 64
        rows in 8 groups ran at 0.90x SDPA's speed with 32 shared and 64 own columns, 1.11x
        with 96 and 128, 1.42x with 96 and 8; 16 rows of one group at 3.0x with 900 and 120."""
        return self.any_shared and 3 * self.width > length


def shared_prefix_attention(q, k, v, mask, shared):
    """One query per row (q (R, heads, 1, head_dim)) over a cache's keys and values (R,
    kv_heads, L, head_dim) under mask (R, 1, 1, L), where rows of a group hold the same
    keys and values in columns [0, shared.width): those are read once for the group, all its
    rows' queries against them in one product, and the rest row by row; the two parts'
    softmax weights share one maximum, so they add up to the one softmax over all L. For a
    decode step after a long common prompt, as GSM8K's 5-shot evaluation runs, the cache
    reads fall by the group's size: 16 rows of 900 common and 120 own positions at Qwen3-0.6B's
    heads took 4.3 ms a layer against 14.3 ms for SDPA over every row's copy (fp32, 2 cores
    of an AMD EPYC), 3e-7 from its output. Computed in fp32."""
    R, heads, _, d = q.shape
    kv, width = k.shape[1], shared.width
    rep = heads // kv
    q = (q.float() * d ** -0.5).view(R, kv, rep, d)
    own_v = v[:, :, width:].float()
    own_scores = torch.matmul(q, k[:, :, width:].float().transpose(-1, -2))  # (R, kv, rep, L - width)
    own_scores.masked_fill_(~mask[:, :, :, width:], float("-inf"))
    prefix_scores = q.new_empty(R, kv, rep, width)
    for rows, lead in shared.groups:
        group_q = q[rows].transpose(0, 1).reshape(kv, len(rows) * rep, d)
        scores = torch.matmul(group_q, k[lead, :, :width].float().transpose(-1, -2))  # (kv, rows * rep, width)
        prefix_scores[rows] = scores.view(kv, len(rows), rep, width).transpose(0, 1)
    prefix_scores.masked_fill_(~mask[:, :, :, :width], float("-inf"))
    top = torch.maximum(prefix_scores.amax(-1, keepdim=True), own_scores.amax(-1, keepdim=True))
    prefix_weights, own_weights = prefix_scores.sub_(top).exp_(), own_scores.sub_(top).exp_()
    total = prefix_weights.sum(-1, keepdim=True) + own_weights.sum(-1, keepdim=True)
    out = torch.matmul(own_weights, own_v)  # (R, kv, rep, d)
    for rows, lead in shared.groups:
        weights = prefix_weights[rows].transpose(0, 1).reshape(kv, len(rows) * rep, width)
        out[rows] += torch.matmul(weights, v[lead, :, :width].float()).view(kv, len(rows), rep, d).transpose(0, 1)
    return (out / total).view(R, heads, 1, d)


class PrefixView:
    """Rows of a KV cache read by other rows, as a cache for one pass: each layer's keys and
    values of rows owner (the cache's `length` positions) come before the pass's own, copied
    as that layer runs and dropped after it. A group of prompts that share a prefix runs
    its rest after the prefix's cache this way when nothing is decoded after (scoring,
    sample.prefill), holding one layer's copy at a time instead of every layer's for every
    prompt."""

    def __init__(self, cache, owner):
        self.cache, self.owner, self.length, self.write_pos, self.shared = cache, owner, cache.length, None, None

    def update(self, layer, k, v):
        keys, values = self.cache.k[layer], self.cache.v[layer]
        return (torch.cat([keys[self.owner, :, :self.length], k.to(keys.dtype)], 2),
                torch.cat([values[self.owner, :, :self.length], v.to(values.dtype)], 2))


QUERY_BLOCK = 256


def attend(q, k, v, mask, gqa):
    """Attention of queries q (B, n_head, T, head_dim) over keys and values (B, n_kv, past +
    T, head_dim), the queries being the last T positions. mask None means plain causal
    attention over exactly these T positions; an explicit mask (Qwen3.forward's, for
    padding or for rows shared by several sequences) is causal over them too, and RowRuns
    attends run by run. Under an explicit mask PyTorch's CPU kernel computes every query
    against every key, where is_causal skips the masked half, so on the CPU a pass of 2 *
    QUERY_BLOCK queries or more attends by blocks of QUERY_BLOCK queries, each over the
    keys up to its last one: the keys after it are masked for every query of the block.
    On 2 cores of an AMD EPYC, 5-shot MMLU scoring of Qwen3-0.6B in bf16 (prompts of 280
    to 1,732 tokens) ran 1.27x as fast, and attention's forward and backward pass over 512
    to 1,024 positions 1.2x to 1.6x. The same values up to the kernel's order of summation
    (3e-7 apart in fp32)."""
    if isinstance(mask, RowRuns):
        return mask.attend(q, k, v, gqa)
    T, past = q.shape[2], k.shape[2] - q.shape[2]
    if mask is None or T < 2 * QUERY_BLOCK or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=gqa)
    blocks = []
    for start in range(0, T, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, T)
        keys = past + end
        blocks.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :keys], v[:, :, :keys],
                                                     attn_mask=mask[..., start:end, :keys], enable_gqa=gqa))
    return torch.cat(blocks, 2)


class RowRuns:
    """Who sees whom in training rows laid out by pack_rows. Each row is cut into runs of
    columns, each the tokens one sequence laid out: after the prefix it found already in
    the row (whose columns it sees too, the same for every sequence through them), or
    from its start. A run sees its prefix and itself causally; the columns after a row's
    last run are padding. On the CPU attention goes run by run (attend), each query
    against the keys it sees alone and a run without a prefix by the causal kernel, so a
    long row of many sequences costs each about what it would alone. Elsewhere the
    runs become a mask of who sees whom (dense), for one attention call over each row."""

    def __init__(self, sequences, placed, n_rows, length):
        self.length, self.runs = length, [[] for _ in range(n_rows)]
        laid = [0] * n_rows  # each row's columns are laid out left to right
        for b in packing_order(sequences):  # replayed as pack_rows placed them
            r, columns = placed[b]
            own = [c for c in columns if c >= laid[r]]  # the rest lie on a prefix laid out before
            if own:
                prefix = columns[:len(columns) - len(own)]
                self.runs[r].append((own[0], own[-1] + 1, prefix))
                laid[r] = own[-1] + 1
        for r, end in enumerate(laid):
            if end < length:
                self.runs[r].append((end, length, []))  # padding, causal among itself: it is never read
        self.masks, self.prefix_columns = {}, {}

    def dense(self, device=None):
        """(rows, length, length) bool: the keys each query sees."""
        visible = torch.zeros(len(self.runs), self.length, self.length, dtype=torch.bool)
        for r, runs in enumerate(self.runs):
            for lo, hi, prefix in runs:
                visible[r, lo:hi, prefix] = True
                visible[r, lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
        return visible.to(device)

    def attend(self, q, k, v, gqa):
        # each row split once into its runs, and every run's prefix columns gathered in one
        # index: a slice or index per run would cost its backward pass a zeroed gradient of
        # the whole row, per run
        if not self.prefix_columns:  # every layer reads the same: made once
            for r, runs in enumerate(self.runs):
                for lo, hi, prefix in runs:
                    if prefix:
                        n = hi - lo
                        mask = torch.ones(n, len(prefix) + n, dtype=torch.bool, device=q.device)
                        mask[:, len(prefix):] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                        self.masks[r, lo] = mask
                self.prefix_columns[r] = torch.tensor([c for _, _, prefix in runs for c in prefix], dtype=torch.long,
                                                      device=q.device)
        rows = []
        for r, runs in enumerate(self.runs):
            sizes, prefix_sizes = [hi - lo for lo, hi, _ in runs], [len(prefix) for _, _, prefix in runs]
            q_runs, k_runs, v_runs = (t[r:r + 1].split(sizes, 2) for t in (q, k, v))
            columns = self.prefix_columns[r]
            k_prefixes, v_prefixes = ((t[r:r + 1].index_select(2, columns).split(prefix_sizes, 2)
                                       if len(columns) else [None] * len(runs)) for t in (k, v))
            parts = []
            for (lo, hi, prefix), q_run, k_run, v_run, k_prefix, v_prefix in zip(runs, q_runs, k_runs, v_runs,
                                                                                  k_prefixes, v_prefixes):
                if prefix:
                    parts.append(F.scaled_dot_product_attention(q_run, torch.cat([k_prefix, k_run], 2),
                                                                torch.cat([v_prefix, v_run], 2),
                                                                attn_mask=self.masks[r, lo], enable_gqa=gqa))
                else:
                    parts.append(F.scaled_dot_product_attention(q_run, k_run, v_run, is_causal=True, enable_gqa=gqa))
            rows.append(torch.cat(parts, 2))
        return torch.cat(rows, 0)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_head * self.hd, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = Linear(self.n_head * self.hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)  # per head, before rotary: Qwen3's addition over Qwen2
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.packed = {}  # set by packed_weights

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q, k, v = project(x, self.packed.get("qkv"), self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(B, T, self.n_head, self.hd)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(k.view(B, T, self.n_kv, self.hd)).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        shared = cache.shared if cache is not None else None
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if T == 1 and shared is not None and shared.pay(k.shape[2]) and cache.write_pos is None and x.device.type == "cpu":
            y = shared_prefix_attention(q, k, v, mask, shared).to(q.dtype)  # a decode step after common prompts
        else:
            # over a cache kept in fp32 for a bf16 model (kv_cache_dtype) attention runs in fp32
            y = attend(q.to(k.dtype), k, v, mask, gqa=self.n_kv != self.n_head).to(q.dtype)
        return project(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd), self.packed.get("o"), self.o_proj)[0]


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.packed = {}  # set by packed_weights

    def forward(self, x):
        gate, up = project(x, self.packed.get("gate_up"), self.gate_proj, self.up_proj)
        # without a gradient the autograd Function would only add its call's cost
        # (tens of microseconds, each layer of each decode step)
        hidden = SwiGLU.apply(gate, up) if torch.is_grad_enabled() else F.silu(gate).mul_(up)
        return project(hidden, self.packed.get("down"), self.down_proj)[0]


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for the backward pass. Autograd would keep
    silu(gate) too: one more (tokens, intermediate) tensor per layer, a ninth of what a
    Qwen3 layer keeps in LoRA training. The backward pass recomputes it with the kernel
    autograd would have used, and forms both gradients as autograd would (the product's
    rule, then SiLU's), so they are the same to the bit."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_ATTENTION_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)}


def keep_costly(ctx, op, *args, **kwargs):
    """Which results of a layer's forward pass to keep for the backward pass (Qwen3.recompute).
    Kept: attention, and every matrix product over an inner dimension above 128, which
    are the products with the model's own weights (and LoRA's A side, whose output is
    only rank wide). Recomputed: norms, rotary, SiLU, elementwise products and sums, and
    LoRA's B-side products over its rank (up to 128), whose outputs take as much memory as
    a weight product's but cost only a few operations per element to redo. Recomputing
    runs the same kernels on the same inputs, so the gradients are the same to the bit."""
    aten = torch.ops.aten
    if op in _ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in (aten.mm.default, aten.bmm.default) and args[0].shape[-1] > 128:
        return CheckpointPolicy.MUST_SAVE
    if op == aten.addmm.default and args[1].shape[-1] > 128:
        return CheckpointPolicy.MUST_SAVE
    if op == _ONEDNN_LINEAR and args[0].shape[-1] > 128:  # OneDNNLinear's products
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_ONEDNN_LINEAR = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)


def recompute_elementwise():
    # oneDNN's trial product (cached) made before the recomputed region, never first inside
    # it: run there, it shifted the products that selective checkpointing keeps
    onednn_linear_works(torch.float32)
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(keep_costly)


class Qwen3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed = {}  # set by packed_weights: the output layer's product, for sampling
        # True: in training passes each layer keeps only its matrix products and attention
        # outputs for the backward pass and recomputes the elementwise rest (see keep_costly)
        self.recompute = False

    def forward(self, input_ids, attention_mask=None, cache=None, hidden_only=False, positions=None, visible=None):
        """input_ids (B, T). attention_mask (B, past+T) of 1 for real tokens and 0 for left
        padding, covering the cached positions too. positions (B, T) and visible (B, T, T),
        without a cache: each token's position and the earlier tokens of its row it attends
        to (itself included), for rows holding several sequences, or a prefix tree of them,
        laid out by sequence_states; visible may also be the RowRuns it is made from.
        Returns logits (B, T, vocab), or the final hidden states (B, T, hidden) with
        hidden_only=True so the caller can take logits only where it needs them."""
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        device = input_ids.device
        if (positions is None) != (visible is None):
            raise ValueError("positions and visible go together: pass both or neither")
        if visible is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError("positions and visible are for training passes, without a cache or an attention_mask")
            mask = visible if isinstance(visible, RowRuns) else visible[:, None]
        elif attention_mask is None:
            positions = torch.arange(past, past + T, device=device).expand(B, T)
            mask = None
            if past > 0 and T > 1:
                mask = torch.arange(past + T, device=device)[None, :] <= torch.arange(past, past + T, device=device)[:, None]
        else:
            if attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, past + T)} (cached + new positions)")
            keep = attention_mask.bool()
            # positions count real tokens only, so a left-padded row sees the same positions as alone
            positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            q_idx = torch.arange(past, past + T, device=device)[:, None]
            k_idx = torch.arange(past + T, device=device)[None, :]
            mask = (k_idx <= q_idx)[None] & keep[:, None, :]  # (B, T, S)
            # a padding query would see no key at all and SDPA would return NaN; let it see itself
            mask = (mask | (k_idx == q_idx)[None])[:, None]  # (B, 1, T, S)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        recompute = self.recompute and cache is None and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, None, use_reentrant=False,
                                                      context_fn=recompute_elementwise)
            else:
                x = layer(x, cos, sin, mask, cache)
        if cache is not None:
            cache.length += T
        x = self.model.norm(x)
        return x if hidden_only else self.lm_head(x)

    def decode_step(self, tokens, positions, key_mask, cache):
        """One new token per row at fixed shapes: tokens and positions (R, 1), key_mask
        (R, 1, 1, max_len) true where a cached key may be attended to, and a cache whose
        write_pos says which column the new keys go to, its unwritten positions zeroed
        (KVCache.zero_unwritten: every column is read). Returns fp32 logits (R, vocab).
        Every input is a tensor updated in place by the caller, so on CUDA one captured
        graph of this step serves the whole decode loop (sample.generate)."""
        x = self.model.embed_tokens(tokens)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, key_mask, cache)
        return self.next_token_logits(self.model.norm(x))

    def next_token_logits(self, hidden, out=None):
        """fp32 logits (B, vocab) from final hidden states (B, T, hidden) at their last
        position: what a sampler draws from. Logits a packed bf16 output layer gives are
        converted into out, an fp32 (B, vocab) tensor, where given, in place of a new
        tensor each call: at 64 rows over Qwen3's vocabulary the conversion into fresh
        memory took 50 ms of a 450 ms decode step on the CPU (see sample.draw on why)."""
        head = self.packed.get("head")
        if runs_packed(head, (self.lm_head,)):
            logits = head(hidden[:, -1])[0]
            if out is None or logits.dtype == torch.float32:  # fp32 packed logits need no conversion
                return logits.float()
            return out.copy_(logits)
        return linear(hidden[:, -1:], self.lm_head.weight, self.lm_head.bias, dtype=torch.float32)[:, -1]

    def new_cache(self, batch_size, max_len, rows=None):
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, p.device, kv_cache_dtype(p), rows)

    def token_logprobs(self, hidden, targets, chunk_size=512):
        """log p(target | state) in fp32 for hidden states (N, hidden) and targets (N,),
        in chunks of states. With the output layer frozen (LoRA), or without a gradient,
        no tensor of vocabulary width is made (151,936 columns for Qwen3; HeadLogprob),
        and a gradient pass gives the same values as one without; when the output layer
        trains too, chunks are recomputed in the backward pass."""
        out = []
        weight = self.lm_head.weight
        lowest, highest = (int(targets.min()), int(targets.max())) if targets.numel() else (0, 0)
        if not 0 <= lowest <= highest < len(weight):
            # checked here because HeadLogprob's slices would not fail on such an id, only miss it
            raise ValueError(f"token_logprobs: target ids must lie in [0, {len(weight)}), got {lowest} to {highest}; "
                             f"leave out the positions not to score instead of marking them (-100)")
        for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size)):
            with_grad = torch.is_grad_enabled() and h.requires_grad
            if with_grad and weight.requires_grad:
                out.append(torch.utils.checkpoint.checkpoint(self._chunk_logprobs, h, t, use_reentrant=False))
            else:
                out.append(HeadLogprob.apply(h, weight.detach(), t, with_grad))
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    def _chunk_logprobs(self, h, t):
        logits = self.lm_head(h).float()
        return logits.gather(-1, t[:, None]).squeeze(-1) - logits.logsumexp(-1)

    def token_kl(self, student_hidden, teacher_hidden, direction="reverse", chunk_size=1024, teacher_head=None):
        """Per-state KL between next-token distributions, (N,) in fp32, chunked like
        token_logprobs. reverse: KL(student || teacher); forward: KL(teacher || student).
        The student's logits come from this model's output layer; the teacher's from
        teacher_head, the teacher's output-layer weight (vocab, its hidden size), which is
        this model's unless given: right for a teacher that is this base with another adapter
        (LoRA leaves the output layer alone), wrong for any other model. Only the student's
        states get a gradient. With the output layer frozen (LoRA), or without a gradient,
        no tensor of vocabulary width is made (HeadKL); when the output layer trains too,
        chunks are recomputed in the backward pass."""
        weight = self.lm_head.weight
        teacher_head = weight if teacher_head is None else teacher_head
        if direction not in ("reverse", "forward"):
            raise ValueError(f"token_kl: direction {direction!r} is neither 'reverse' (KL(student || teacher)) nor 'forward'")
        if len(student_hidden) != len(teacher_hidden):
            raise ValueError(f"token_kl: student states {tuple(student_hidden.shape)} and teacher states "
                             f"{tuple(teacher_hidden.shape)} differ; pass the two models' states at the same positions")
        if teacher_head.shape != (len(weight), teacher_hidden.shape[-1]):
            raise ValueError(f"token_kl: teacher states of width {teacher_hidden.shape[-1]} and a teacher output layer "
                             f"of shape {tuple(teacher_head.shape)}, against a student vocabulary of {len(weight)}; pass "
                             f"the teacher model's lm_head.weight as teacher_head, for a teacher of the same vocabulary")
        out = []
        for hs, ht in zip(student_hidden.split(chunk_size), teacher_hidden.split(chunk_size)):
            with_grad = torch.is_grad_enabled() and hs.requires_grad
            if with_grad and weight.requires_grad:
                fn = lambda a, b: self._chunk_kl(a, b, direction, teacher_head)
                out.append(torch.utils.checkpoint.checkpoint(fn, hs, ht, use_reentrant=False))
            else:
                out.append(HeadKL.apply(hs, ht.detach(), weight.detach(), teacher_head.detach(), direction, with_grad))
        return torch.cat(out) if out else student_hidden.new_zeros(0, dtype=torch.float32)

    def _chunk_kl(self, hs, ht, direction, teacher_head):
        z = self.lm_head(hs).float()  # student logits, the only thing that gets a gradient
        log_s = z.log_softmax(-1)
        log_t = linear(ht, teacher_head.detach(), dtype=torch.float32).log_softmax(-1)
        if direction == "reverse":  # KL(s || t) = sum p_s (log p_s - log p_t); d/dz = p_s (d - KL)
            p_s, d = log_s.exp(), log_s - log_t
            kl = (p_s * d).sum(-1)
            grad = p_s * (d - kl[:, None])
        else:  # KL(t || s) = sum p_t (log p_t - log p_s); d/dz = p_s - p_t
            p_t = log_t.exp()
            kl = (p_t * (log_t - log_s)).sum(-1)
            grad = log_s.exp() - p_t
        # the gradient in closed form rather than through autograd's chain of softmaxes: then
        # identical distributions give exactly zero gradient, not float noise that Adam would
        # scale up into a full-size step
        surrogate = (grad.detach() * z).sum(-1)
        return kl.detach() + surrogate - surrogate.detach()


VOCAB_SLICE = 4096  # output-layer columns that HeadLogprob and HeadKL form at a time


def fold_slice(top, total, logits, in_place=False):
    """One slice of fp32 logits (rows, slice) folded into a running max `top` and sum of
    exponentials `total` (rows, 1). Returns the new max, the factor that rescales any sum
    over earlier slices to it (0 at the first slice, where top is -inf), the slice's
    exp(logits - new max), and the new total. in_place: the exponentials overwrite the
    logits, saving a (rows, slice) buffer where the logits are not needed after."""
    new_top = torch.maximum(top, logits.amax(-1, keepdim=True))
    shrink = (top - new_top).exp()
    exp = (logits.sub_(new_top) if in_place else logits - new_top).exp_()
    return new_top, shrink, exp, total * shrink + exp.sum(-1, keepdim=True)


class HeadLogprob(torch.autograd.Function):
    """log p(target | state) for a chunk of states under a frozen output layer W. Its
    gradient with respect to state i is g_i * (W[target_i] - softmax_i @ W): the bracket
    is known as soon as the logits are, so the forward pass forms it (when with_grad) and
    the backward pass only scales it. The logits are made VOCAB_SLICE columns at a time,
    keeping a running max, sum of exponentials and softmax-weighted sum of W's rows that
    are rescaled when the max grows (the softmax of flash attention): no (chunk, vocab)
    tensor is ever made, each slice of W is read for its logits and straight away for its
    product, and the result equals the one-pass softmax up to float rounding. Both products
    go through linear(), so on AMD CPUs in fp32 oneDNN takes them over the row-major slices:
    token_logprobs with its gradient over 1,020 states of Qwen3-0.6B took 5.75 against
    6.98 s with MKL's (token_kl 12.96 against 13.97) on an AMD EPYC without AVX-512."""

    @staticmethod
    def forward(ctx, h, weight, targets, with_grad):
        n = len(h)
        top = h.new_full((n, 1), float("-inf"), dtype=torch.float32)
        total = h.new_zeros((n, 1), dtype=torch.float32)
        weighted_rows = h.new_zeros((n, weight.shape[1]), dtype=torch.float32)  # sum exp(logit - top) W[v]
        target_logit = h.new_zeros((n, 1), dtype=torch.float32)
        for start in range(0, len(weight), VOCAB_SLICE):
            w = weight[start:start + VOCAB_SLICE]
            logits = linear(h, w).float()
            inside = ((targets >= start) & (targets < start + len(w)))[:, None]
            picked = logits.gather(-1, (targets - start).clamp(0, len(w) - 1)[:, None])
            target_logit = torch.where(inside, picked, target_logit)
            top, shrink, exp, total = fold_slice(top, total, logits, in_place=True)
            if with_grad:
                weighted_rows = weighted_rows * shrink + linear(exp.to(w.dtype), w.t()).float()
        if with_grad:
            ctx.save_for_backward(weight[targets].float() - weighted_rows / total)
            ctx.h_dtype = h.dtype
        return (target_logit - top - total.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        (d_logp_d_h,) = ctx.saved_tensors
        return (grad.float()[:, None] * d_logp_d_h).to(ctx.h_dtype), None, None, None


class HeadKL(torch.autograd.Function):
    """Per-state KL between the next-token distributions that frozen output layers give
    student states hs (W) and teacher states ht (the teacher's, which may be W itself),
    sliced like HeadLogprob: for each of the two a running max and sum of exponentials,
    and the sums below, rescaled as the maxes grow.
    With z the logits, p the distributions and lse the log-normalisers,
      reverse: KL = sum p_s (z_s - z_t) - lse_s + lse_t,
               d KL / d hs = sum_v p_s,v (z_s,v - z_t,v - KL - lse_s + lse_t) W[v];
      forward: KL = sum p_t (z_t - z_s) - lse_t + lse_s,
               d KL / d hs = sum_v (p_s,v - p_t,v) W[v].
    The gradient is formed in the forward pass (when with_grad) and only scaled in the
    backward pass. Identical distributions give a KL and a gradient of exactly zero, not
    float noise that Adam would scale up into a full-size step: the same operations on the
    same values cancel exactly."""

    @staticmethod
    def forward(ctx, hs, ht, weight, teacher_weight, direction, with_grad):
        reverse = direction == "reverse"
        filled = lambda *shape, fill=0.0: hs.new_full(shape, fill, dtype=torch.float32)
        n = len(hs)
        top_s, top_t = filled(n, 1, fill=float("-inf")), filled(n, 1, fill=float("-inf"))
        sum_s, sum_t = filled(n, 1), filled(n, 1)
        gap = filled(n, 1)  # sum e_s (z_s - z_t) (reverse) or sum e_t (z_t - z_s) (forward)
        rows_s = filled(n, weight.shape[1])  # sum e_s W[v]
        rows_other = filled(n, weight.shape[1])  # sum e_s (z_s - z_t) W[v] (reverse) or sum e_t W[v] (forward)
        for start in range(0, len(weight), VOCAB_SLICE):
            w = weight[start:start + VOCAB_SLICE]
            z_s, z_t = linear(hs, w).float(), linear(ht, teacher_weight[start:start + VOCAB_SLICE]).float()
            top_s, shrink_s, e_s, sum_s = fold_slice(top_s, sum_s, z_s)
            top_t, shrink_t, e_t, sum_t = fold_slice(top_t, sum_t, z_t)
            weighted_gap = e_s * (z_s - z_t) if reverse else e_t * (z_t - z_s)
            shrink_gap, e_other = (shrink_s, weighted_gap) if reverse else (shrink_t, e_t)
            gap = gap * shrink_gap + weighted_gap.sum(-1, keepdim=True)
            if with_grad:
                rows_s = rows_s * shrink_s + linear(e_s.to(w.dtype), w.t()).float()
                rows_other = rows_other * shrink_gap + linear(e_other.to(w.dtype), w.t()).float()
        lse_s, lse_t = top_s + sum_s.log(), top_t + sum_t.log()
        if reverse:
            kl = gap / sum_s - lse_s + lse_t
            d_kl_d_hs = (rows_other - gap / sum_s * rows_s) / sum_s  # KL + lse_s - lse_t = gap / sum_s
        else:
            kl = gap / sum_t - lse_t + lse_s
            d_kl_d_hs = rows_s / sum_s - rows_other / sum_t
        if with_grad:
            ctx.save_for_backward(d_kl_d_hs)
            ctx.hs_dtype = hs.dtype
        return kl.squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        (d_kl_d_hs,) = ctx.saved_tensors
        return (grad.float()[:, None] * d_kl_d_hs).to(ctx.hs_dtype), None, None, None, None, None


def left_pad(seqs, pad_id, device=None):
    """Token lists -> (ids, mask), both (B, T), padded on the left so that every row's
    next token goes into the same column. The mask, not the pad id, marks padding."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s)
            mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


SHARED_PREFIX_MIN = 16  # tokens a sequence must share with a row to be laid out on its prefix


def training_rows(sequences, device):
    """How a training pass on this device lays out its sequences: pack_rows' layout where
    it computes fewer tokens than a row for each sequence, padded to the longest (which
    runs unmasked, attention skipping the keys after each query), else that. On the CPU
    attention goes run by run (RowRuns), each query against the keys it sees alone, so
    one row holds every sequence, end to end: no padding, and each common prefix laid out
    once however many sequences pass through it. Elsewhere attention over a row is one
    call under a mask, which computes every query against every key, so rows stay as
    long as the longest sequence. Returns (rows, placed) as pack_rows does."""
    longest = max(map(len, sequences), default=0)
    on_cpu = torch.device(device).type == "cpu"
    layout = pack_rows(sequences, row_tokens=sum(map(len, sequences)) if on_cpu else 0)
    return layout if laid_out(layout[0]) < len(sequences) * longest else one_row_each(sequences)


def laid_out(rows):
    """Tokens a pass over these rows computes, padding included."""
    return len(rows) * max(map(len, rows), default=0)


def one_row_each(sequences):
    """The plain layout, in pack_rows' terms: each sequence a row of its own, in order."""
    return [list(s) for s in sequences], [(b, list(range(len(s)))) for b, s in enumerate(sequences)]


def packing_order(sequences):
    """The order pack_rows places sequences in, longest first (the first of equals first),
    which RowRuns replays to tell each sequence's own columns from the prefix it found."""
    return sorted(range(len(sequences)), key=lambda b: -len(sequences[b]))


def pack_rows(sequences, share_prefixes=True, row_tokens=0):
    """Sequences laid out in rows of up to row_tokens tokens, or the longest sequence's
    if that is more, longest first, each in the row where it adds fewest tokens, of those
    with room for it (the first of equals). A batch's lengths vary (GSM8K's questions with
    their solutions by about threefold), and with one sequence to a row nearly half of an
    SFT batch of 16 would be padding. A sequence that opens with SHARED_PREFIX_MIN or more
    tokens already in its row, along one path, adds only the rest: a row is then a prefix
    tree, each token computed once for every sequence that passes through it. RL's
    samples of one prompt share the prompt, OPD's continuations of one rollout its prefix
    up to their cut. A shorter common opening, such as GSM8K's 'Question:', would save a
    few tokens for a mask (RowRuns): over a run's own keys, which the causal kernel would
    have halved, or over a whole row where a row each would have run unmasked. Returns
    (rows, placed): the token ids of each row, and for each sequence its row and the
    column of each of its tokens."""
    budget = max(max(map(len, sequences), default=0), row_tokens)
    # each row's prefix trees: a tree's first SHARED_PREFIX_MIN columns by its opening tokens (so
    # that trees opening alike on fewer, as every GSM8K prompt on "Question:", stay apart), then
    # each later column by its parent's column and its token
    rows, openings, children, placed = [], [], [], [None] * len(sequences)
    for b in packing_order(sequences):
        s = sequences[b]
        opening = tuple(s[:SHARED_PREFIX_MIN]) if share_prefixes and len(s) >= SHARED_PREFIX_MIN else None
        best, best_path = None, []
        for r, row in enumerate(rows):
            path = list(openings[r].get(opening, []))
            while path and len(path) < len(s) and (path[-1], s[len(path)]) in children[r]:
                path.append(children[r][path[-1], s[len(path)]])
            if len(row) + len(s) - len(path) <= budget and (best is None or len(path) > len(best_path)):
                best, best_path = r, path
        if best is None:
            rows.append([])
            openings.append({})
            children.append({})
            best = len(rows) - 1
        row, columns = rows[best], list(best_path)
        for token in s[len(columns):]:
            if columns and opening is not None:  # one that opens no tree (short, or not sharing) hosts none
                children[best].setdefault((columns[-1], token), len(row))
            columns.append(len(row))
            row.append(token)
        if opening is not None:
            openings[best].setdefault(opening, columns[:SHARED_PREFIX_MIN])
        placed[b] = (best, columns)
    return rows, placed


def sequence_states(model, sequences, starts, pad_id=0, share_rows=True):
    """Hidden states of every state (seq[:t]) whose next token seq[t] is trained on, for t
    in [start, len(seq)) of each sequence. Returns (states (N, hidden), targets (N,),
    sequence (N,)), sequence by sequence in the given order. Short sequences share a row,
    and sequences with a common prefix share its tokens (training_rows), each token attending
    only to its own sequence's earlier tokens (share_rows=False: one row each, as
    bench/train_step.py compares); where every sequence has a row of its own, rows are
    right-padded, causal attention alone keeps padding out of real tokens, and the pass
    runs the causal kernel with no mask."""
    device = model.lm_head.weight.device
    for b, (s, start) in enumerate(zip(sequences, starts)):
        if not 1 <= start <= len(s):
            raise ValueError(f"sequence {b}: start {start} outside [1, {len(s)}]")
    rows, placed = training_rows(sequences, device) if share_rows else one_row_each(sequences)
    shared = len(rows) < len(sequences)
    L = max(len(row) for row in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    positions = visible = None
    if shared:
        positions = torch.zeros((len(rows), L), dtype=torch.long)
        for s, (r, columns) in zip(sequences, placed):
            positions[r, columns] = torch.arange(len(s))
        positions, visible = positions.to(device), RowRuns(sequences, placed, len(rows), L)
        if device.type != "cpu":
            visible = visible.dense(device)
    state_rows, state_cols, target_cols, seq_of_state = [], [], [], []
    for b, ((r, columns), start) in enumerate(zip(placed, starts)):
        state_rows += [r] * (len(columns) - start)
        state_cols += columns[start - 1:-1]
        target_cols += columns[start:]
        seq_of_state += [b] * (len(columns) - start)
    ids = ids.to(device)
    state_rows, state_cols, target_cols, seq_of_state = (torch.tensor(x, dtype=torch.long, device=device)
                                                         for x in (state_rows, state_cols, target_cols, seq_of_state))
    hidden = model(ids, hidden_only=True, positions=positions, visible=visible)
    return hidden[state_rows, state_cols], ids[state_rows, target_cols], seq_of_state


def sequence_logprobs(model, sequences, starts, pad_id=0, share_rows=True):
    """log p(seq[t] | seq[:t]) in fp32 for t in [start, len(seq)); flat (N,) with the
    index of each one's sequence (N,)."""
    states, targets, sequence = sequence_states(model, sequences, starts, pad_id, share_rows)
    return model.token_logprobs(states, targets), sequence


def autocast(device):
    """bf16 autocast on CUDA (the LoRA path is fp32 parameters); plain fp32 or bf16 weights on CPU."""
    import contextlib
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def init_weights(model, std=0.02, seed=0):
    """Random weights (normal(0, std), norms at one) for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


# -----------------------------------------------------------------------------
# tokenizer

class Tokenizer:
    """tokenizers.Tokenizer plus the ids the project needs. pad_id exists only to fill
    tensors: padding is always tracked by attention masks and lengths, never by comparing
    token values, so a real end-of-text token is never mistaken for padding."""

    def __init__(self, path, eos_id, pad_id=None):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self.tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise InputError(f"{path} is not a readable tokenizer ({e}); the file is damaged: restore it or download "
                             f"it again") from None
        self.eos_id = eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self.eos_text = self.tok.id_to_token(eos_id)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self):
        return self.tok.get_vocab_size()


def train_tokenizer(texts, path, vocab_size=512, eos="<|endoftext|>", split_digits=True):
    """A byte-level BPE tokenizer.json (like Qwen's, only smaller) trained on texts, with
    eos as its first special token (id 0). Digits split one per token by default, as in
    Qwen's own pre-tokenizer, so that small models can learn arithmetic digit by digit."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return path


# -----------------------------------------------------------------------------
# loading

HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json"]


def device_source(device=None):
    """Where the device comes from: "--device" when one is given, else "$STATES_DEVICE" when
    that is set (the tests set it to cpu, so that a machine with a GPU runs them as CI does),
    else None: cuda when present, else cpu."""
    return "--device" if device is not None else "$STATES_DEVICE" if os.environ.get("STATES_DEVICE") else None


def resolve_device(device=None, dtype=None):
    """One place that picks device and dtype (device_source says where the device comes
    from), and says why."""
    source = device_source(device)
    fix = "unset $STATES_DEVICE" if source == "$STATES_DEVICE" else "leave out --device"
    if source == "$STATES_DEVICE":
        device = os.environ["STATES_DEVICE"]
    elif source is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise InputError(f"{source} {device!r} is not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{source} {device}, but torch finds no CUDA device (no GPU, no driver, or a CPU-only build of "
                         f"torch); {fix} to run on the CPU")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                 "fp16": torch.float16, "float16": torch.float16}
        if dtype not in names:
            raise InputError(f"--dtype {dtype!r} is not a dtype this code knows; use fp32, bf16 or fp16")
        dtype = names[dtype]
    return device, dtype


def add_model_args(p, model_default=DEFAULT_MODEL, model_help="base model: hub id or local folder"):
    """The flags every entry point shares: which model, which data, which device."""
    p.add_argument("--model", default=model_default, help=model_help)
    p.add_argument("--data-dir", default=None,
                   help="dataset folder (default: $STATES_DATA, else fetched into ~/.cache/states)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: $STATES_DEVICE, else cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="fp32 or bf16 (default: bf16 on cuda, fp32 on cpu)")


def number(kind, minimum, above=False, below=None, why=""):
    """An argparse type: a value of kind (int or float) at least minimum (greater, with
    above=True) and less than below, when given; anything else is argparse's one-line
    error, which ends with why (the reason for the bound) when given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        in_range = value > minimum if above else value >= minimum  # False for NaN too
        if not in_range or (below is not None and not value < below):
            bound = f"{'above' if above else 'at least'} {minimum}" + (f" and below {below}" if below is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}" + (f": {why}" if why else ""))
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def run_script(main, memory_fix="rerun with smaller settings"):
    """A script's entry point: main(argv) on the command line's arguments. A mistake in the
    user's input (InputError, a file that is not there) ends the run with its one-line
    message, and so do a GPU (or CPU) too small for the settings, with memory_fix, the
    script's flags that need less, a full disk and a file or folder without permission; any
    other exception is a bug and keeps its traceback."""
    try:
        main(sys.argv[1:])
    except (InputError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except torch.OutOfMemoryError as e:
        first_line = (str(e).strip().splitlines() or ["out of memory"])[0]
        raise SystemExit(f"error: the GPU ran out of memory ({first_line}); {memory_fix}") from None
    except OSError as e:  # a full disk (training scripts say more: lora.RunFolder.end_step), a folder not ours
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SystemExit(f"error: could not write {e.filename or 'a file'} ({e.strerror}); make room, then run it "
                             f"again") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise SystemExit(f"error: {e.filename or 'a file'}: {e.strerror}; check its permissions, or pass a folder "
                             f"you can write to") from None
        raise
    except RuntimeError as e:  # the CPU's allocator raises a plain RuntimeError
        if "DefaultCPUAllocator: can't allocate memory" not in str(e):
            raise
        first_line = str(e).strip().splitlines()[0].split("DefaultCPUAllocator: ")[-1]
        raise SystemExit(f"error: the CPU ran out of memory ({first_line}); {memory_fix}") from None


@functools.cache
def cpu_has_bf16():
    """Whether this CPU multiplies bf16 matrices in hardware (x86's AVX512-BF16 or AMX).
    Without either, torch converts bf16 to fp32 and back around its products: on 2 cores
    of a Xeon whose virtual machine hides both, a (1024, 1024) x (1024, 3072) product took
    5 times as long in bf16 as in fp32, and a toy.py pretraining step 2.8 times. Other
    architectures count as without (fp32 is never the slow choice there)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helpers of torch.cpu; a build without them gets fp32
        return False


@functools.cache
def cpu_has_amx():
    """Whether this CPU has AMX, Intel's matrix tiles, the hardware for which linear()'s
    few-row bf16 forms pay (and only there, of the CPUs they were measured on)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a private helper of torch.cpu; a build without it takes F.linear
        return False


def device_from_args(args):
    """resolve_device for --device/--dtype, printing what was picked and why."""
    device, dtype = resolve_device(args.device, args.dtype)
    source = {"--device": "given", "$STATES_DEVICE": "from $STATES_DEVICE", None: "default"}[device_source(args.device)]
    print(f"device {device} ({source}), dtype {dtype} ({'given' if args.dtype else 'default for ' + device.type})")
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16():
        print("note: this CPU has no bf16 instructions (AVX512-BF16 or AMX), so bf16 runs slower than fp32 here; "
              "leave out --dtype for fp32")
    return device, dtype


def model_folder(name_or_path, flag="--model"):
    """A local folder as it is, or a hub id downloaded (config, weights, tokenizer only);
    flag names the option that gave it, for the error's fix."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        try:
            return snapshot_download(name_or_path, allow_patterns=HUB_FILES)
        except Exception as e:
            detail = " ".join(str(e).split())  # the hub's messages span several lines
            # 'out/stress' reads as a hub id too: a mistyped run folder ends up here
            raise InputError(f"could not fetch {name_or_path!r} from the Hugging Face hub ({type(e).__name__}: {detail}), "
                             f"and there is no local folder of that name; check the path, or download the model "
                             f"elsewhere and pass its folder with {flag}") from None
    raise FileNotFoundError(f"model {name_or_path!r} is neither a local folder nor a hub id like 'Qwen/Qwen3-0.6B-Base'")


def read_json(path):
    """A JSON file's content; a damaged one (a manual edit, a download cut short) is a
    one-line InputError naming it."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON ({e}); the file is damaged: restore it or write it again") from None


def read_safetensors_file(path, device="cpu", raw=None):
    """A safetensors file's tensors, from raw, its bytes, where the caller has read them
    already (lora.read_adapter hashes them); a damaged file (a download cut short, say) is a
    one-line InputError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file
    try:
        return load_file(path, device=str(device)) if raw is None else load(raw)
    except SafetensorError as e:
        raise InputError(f"{path} is not a readable safetensors file ({e}); the file is damaged: download it or "
                         f"write it again") from None


def read_config(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json; point --model at a Hugging Face model folder")
    d = read_json(path)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            d["eos_token_id"] = gen["eos_token_id"]
    return Qwen3Config.from_dict(d, source=path)


def read_safetensors(folder, device):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(read_json(index)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json; the weights are missing")
    state = {}
    for name in files:
        state.update(read_safetensors_file(os.path.join(folder, name), device))
    return state


def load_weights(model, state, source):
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some exporters write the tied copy too
    for name, t in expected.items():
        if name not in state:
            raise InputError(f"{source}: tensor {name} is missing; the checkpoint does not match its config.json")
        if tuple(state[name].shape) != tuple(t.shape):
            raise InputError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(t.shape)}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InputError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all); is this a Qwen3 checkpoint?")
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_word_embeddings:  # assign=True replaced the parameter objects: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return lay_out_weights(model)


def lay_out_weights(model, column_major=None):
    """Store each nn.Linear weight (out, in) in the memory order that the device's matrix
    kernels read fastest; values never change, only strides. Where MKL multiplies in fp32
    on the CPU that is column-major (the storage of an (in, out) matrix): MKL multiplies a
    few rows by such a matrix far faster than by a row-major one, which is what decoding
    does (8 rows of Qwen3-0.6B decode 1.5x faster), and about as fast at training sizes.
    Weights whose products go to oneDNN (bf16; fp32 on AMD CPUs, fp32_by_onednn) are
    row-major: in bf16 that order is the faster one, and in fp32 on an AMD EPYC without
    AVX-512 a prefill of 8 x 32 tokens took 2.5 s against 3.8 s column-major, packing
    (packed_weights) 1.7 to 2.2 s against 4.3 to 6.2 s, and training sizes about the same;
    the output layer's vocabulary slices (HeadLogprob) are then dense too. Except, in fp32,
    those whose input is wider than their output (o and down in Qwen3): training multiplies
    by each weight twice, once as stored and once transposed (the input's gradient), and
    oneDNN read a transposed operand with more rows than columns at as little as half its
    speed there: the down projection's input gradient over 1,024 tokens of Qwen3-0.6B took
    129 ms row-major against 57 ms column-major, its forward product 55 against 53 ms, at
    one row 1.05 against 1.14 ms (gate and up, transposed (1,024, 3,072), ran at full
    speed). Column-major, the transposed operand is always the one with fewer rows. On
    CUDA weights stay as loaded. column_major=True or False forces one order
    (bench/layout.py measures both on any machine). A tied output layer takes the embedding
    with it, whose row lookups barely notice."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            column = column_major if column_major is not None else (
                w.device.type == "cpu" and w.dtype == torch.float32
                and (not fp32_by_onednn(w) or w.shape[1] > w.shape[0]))
            if column and w.stride() != (1, w.shape[0]):
                w.data = w.data.t().contiguous().t()
            elif not column and not w.is_contiguous():
                w.data = w.data.contiguous()
    return model


def load_tokenizer(folder, config):
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no tokenizer.json; the model folder needs the tokenizer file too")
    if config.eos_token_id is None:
        raise InputError(f"{folder}: no eos_token_id in generation_config.json or config.json; add it")
    return Tokenizer(path, config.eos_token_id, config.pad_token_id)


def load(name_or_path=DEFAULT_MODEL, device=None, dtype=None):
    """(model, tokenizer) from a local folder or a hub id. Default dtype: bf16 on CUDA, fp32 on CPU."""
    device, dtype = resolve_device(device, dtype)
    folder = model_folder(name_or_path)
    config = read_config(folder)
    with torch.device("meta"):
        model = Qwen3(config)
    state = {k: v.to(dtype) for k, v in read_safetensors(folder, device).items()}
    load_weights(model, state, folder)
    model.eval().requires_grad_(False)
    model.name_or_path = name_or_path
    return model, load_tokenizer(folder, config)


def save(model, folder, tokenizer_path=None):
    """Write a Hugging Face-format folder (config.json, generation_config.json,
    model.safetensors, optionally tokenizer.json) that load() and transformers both open."""
    import shutil
    from dataclasses import asdict
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    cfg = asdict(model.config)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
              **{k: v for k, v in cfg.items() if v is not None}, "bos_token_id": cfg["eos_token_id"],
              "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "torch_dtype": "float32"}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # safetensors refuses shared tensors; the tie is in config.json
        state.pop("lm_head.weight")
    from lora import write_atomic, write_json
    write_atomic(os.path.join(folder, "model.safetensors"), lambda p: save_file(state, p, metadata={"format": "pt"}))
    write_json(os.path.join(folder, "config.json"), config)
    write_json(os.path.join(folder, "generation_config.json"), {"eos_token_id": cfg["eos_token_id"],
                                                                 "bos_token_id": cfg["eos_token_id"]})
    dest = os.path.join(folder, "tokenizer.json")
    if tokenizer_path and os.path.abspath(tokenizer_path) != os.path.abspath(dest):
        shutil.copy(tokenizer_path, dest)
    return folder


def num_parameters(model):
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
