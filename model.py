"""
Qwen3 (dense) in one file, to be read top to bottom: config, RMSNorm, rotary embedding,
KV cache, grouped-query attention with per-head q/k RMSNorm, SwiGLU MLP, the model (a
forward pass and a fixed-shape decode step), per-token log-probs over the vocabulary in
chunks, the tokenizer, and load()/save().

Module names are Hugging Face's (model.layers.N.self_attn.q_proj, ...), so an official
model.safetensors loads with load_state_dict and no name map, and LoRA keys match PEFT's.
Numerics follow transformers' Qwen3ForCausalLM (tests/test_model.py checks the parity).
Of the project it imports plumbing/files.py alone: reading and writing files.
"""
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from plumbing.files import InputError, read_json, read_safetensors_file, write_atomic, write_json


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
        # transformers >= 5 writes rope_parameters
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        d.setdefault("rope_theta", rope.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            raise InputError(f"{source}: rope type {rope['rope_type']!r} is not supported; only "
                             f"plain rotary embeddings are")
        if d.get("use_sliding_window"):
            raise InputError(f"{source}: use_sliding_window=true is not supported; set it to false")
        if d.get("model_type", "qwen3") != "qwen3":
            raise InputError(f"{source}: model_type is {d['model_type']!r}; this file implements "
                             f"'qwen3' only")
        optional = ("attention_bias", "eos_token_id", "pad_token_id")
        required = [f.name for f in fields(cls) if f.name not in optional]
        missing = [n for n in required if d.get(n) is None]
        if missing:
            raise InputError(f"{source}: missing field(s) {', '.join(missing)}; is this a Qwen3 "
                             f"config.json?")
        eos = d.get("eos_token_id")  # of several stop ids, the first is end-of-text
        eos = eos[0] if isinstance(eos, list) else eos
        return cls(**{n: d[n] for n in required}, eos_token_id=eos,
                   attention_bias=bool(d.get("attention_bias", False)),
                   pad_token_id=d.get("pad_token_id"))


# -----------------------------------------------------------------------------
# layers

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()  # normalised in fp32 whatever the activation dtype, as the reference does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(positions, head_dim, theta, dtype):
    """cos and sin (B, 1, T, head_dim) of the rotary angles at positions (B, T), in fp32 first."""
    dims = torch.arange(0, head_dim, 2, device=positions.device).float()
    inv_freq = 1.0 / theta ** (dims / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim / 2)
    emb = torch.cat([angles, angles], -1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """Rotate each pair (x_i, x_{i + head_dim/2}) by its angle: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """Keys and values of every layer, (B, n_kv_heads, max_len, head_dim) each, passed to
    forward explicitly; `length` counts the positions written. The rest hold zeros: the
    fixed-shape decode step reads them, masked, and a masked zero weighs nothing."""

    def __init__(self, config, batch_size, max_len, device, dtype):
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.length, self.max_len = 0, max_len
        self.write_pos = None  # a 1-element tensor in fixed-shape decoding (Qwen3.decode_step)

    def update(self, layer, k, v):
        """Write the new keys and values (B, n_kv, T, head_dim); return all written so far."""
        if self.write_pos is not None:  # a position held in a tensor: one CUDA graph, every step
            self.k[layer].index_copy_(2, self.write_pos, k)
            self.v[layer].index_copy_(2, self.write_pos, v)
            return self.k[layer], self.v[layer]
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions > max_len {self.max_len}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def select_rows(self, index):
        """Row i becomes old row index[i]: repeating a prompt's row serves its n samples from
        one prefill; leaving rows out drops finished ones."""
        self.k = [t.index_select(0, index) for t in self.k]
        self.v = [t.index_select(0, index) for t in self.v]


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.hidden_size, bias=bias)
        # per head, before rotary: Qwen3's addition over Qwen2
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, nkv, past + T, hd)
        if mask is None:  # plain causal attention; a key/value head serves n_head / n_kv queries
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1,
                                               enable_gqa=self.n_kv != self.n_head)
        else:  # the query heads of one key/value head side by side, each with its mask row: the
            # keys are read once for all of them, not copied (SDPA's grouped heads take no mask)
            rep = self.n_head // self.n_kv
            y = F.scaled_dot_product_attention(q.reshape(B, self.n_kv, rep * T, self.hd), k, v,
                                               attn_mask=mask.repeat(1, 1, rep, 1))
        y = y.reshape(B, self.n_head, T, self.hd).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, self.n_head * self.hd))


def swiglu(gate, up):
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # with a gradient, backward recomputes silu(gate): less memory
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(checkpoint(swiglu, gate, up, use_reentrant=False))
        return self.down_proj(swiglu(gate, up))


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


def positions_and_mask(attention_mask, T):
    """For the last T of the positions that attention_mask (B, past + T) marks 1 for real
    tokens and 0 for left padding: each token's position (B, T), counting real tokens only
    so that a left-padded row computes what it would alone, and the keys it attends to
    (B, 1, T, past + T): the real ones up to itself."""
    keep = attention_mask.bool()
    S = keep.shape[1]
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, S - T:]
    q = torch.arange(S - T, S, device=keep.device)[:, None]
    k = torch.arange(S, device=keep.device)[None, :]
    # a padding query sees itself: with no key at all SDPA would return NaN (never read)
    return positions, ((k <= q) & keep[:, None, :] | (k == q))[:, None]


class Qwen3(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()  # a container, so that parameter names are Hugging Face's
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i)
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.recompute = False  # True: layers keep only their inputs, and run again in backward

    def forward(self, input_ids, attention_mask=None, cache=None, hidden_only=False):
        """input_ids (B, T); attention_mask (B, past + T), 1 for real tokens and 0 for left
        padding, covering the cached positions too. Returns logits (B, T, vocab), or the
        final hidden states (B, T, hidden) with hidden_only=True, so that the caller takes
        logits only where it needs them."""
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        if attention_mask is None and past == 0:  # every row real from its start: plain causal
            positions, mask = torch.arange(T, device=input_ids.device).expand(B, T), None
        else:
            if attention_mask is None:
                attention_mask = input_ids.new_ones(B, past + T)
            positions, mask = positions_and_mask(attention_mask, T)
        x = self.body(input_ids, positions, mask, cache)
        if cache is not None:
            cache.length += T
        return x if hidden_only else self.lm_head(x)

    def body(self, input_ids, positions, mask, cache):
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            if self.recompute and cache is None and torch.is_grad_enabled():
                # the same gradients, less memory
                x = checkpoint(layer, x, cos, sin, mask, None, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)

    def decode_step(self, tokens, positions, key_mask, cache):
        """One new token per row at fixed shapes: tokens and positions (R, 1), key_mask (R, 1, 1,
        max_len), the cache's write_pos the column to write. Returns fp32 logits (R, vocab). The
        caller updates every input in place, so one captured CUDA graph serves a whole decode."""
        return self.lm_head(self.body(tokens, positions, key_mask, cache)[:, -1]).float()

    def new_cache(self, batch_size, max_len):
        w = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, w.device, w.dtype)

    def token_logprobs(self, hidden, targets, chunk_logits=2 ** 24):
        """log p(target | state) in fp32 for final hidden states (N, hidden) and targets (N,).
        Qwen3's output layer has 151,936 columns, so (N, vocab) fp32 logits would take
        gigabytes: chunk_logits of them at a time (64 MiB, 110 states), never all."""
        rows = max(1, chunk_logits // self.config.vocab_size)
        return TokenLogprobs.apply(hidden, self.lm_head.weight, targets, rows)


class TokenLogprobs(torch.autograd.Function):
    """logits[target] - logsumexp(logits) in fp32, logits = hidden @ weight.T, chunk rows at a time.
    Backward recomputes a chunk's logits and turns them in place into their gradient, grad *
    (onehot(target) - softmax): it holds one (chunk, vocab) fp32 tensor, autograd's form several."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        picked = hidden.new_empty(len(hidden), dtype=torch.float32)
        lse = torch.empty_like(picked)
        for c in (slice(i, i + chunk) for i in range(0, len(hidden), chunk)):
            logits = F.linear(hidden[c], weight).float()
            picked[c] = logits.gather(-1, targets[c, None]).squeeze(-1)
            lse[c] = logits.logsumexp(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        # toy.py's pretraining trains the output layer
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for c in (slice(i, i + ctx.chunk) for i in range(0, len(hidden), ctx.chunk)):
            g = F.linear(hidden[c], weight).float().sub_(lse[c, None]).exp_()  # softmax
            g.scatter_add_(-1, targets[c, None], -torch.ones_like(lse[c, None]))  # - onehot(target)
            g = g.mul_(-grad[c, None]).to(weight.dtype)
            grad_hidden[c] = g @ weight
            if grad_weight is not None:
                grad_weight += g.T @ hidden[c]
        return grad_hidden, grad_weight, None, None


# -----------------------------------------------------------------------------
# tokenizer

class Tokenizer:
    """tokenizers.Tokenizer plus the ids the project needs. pad_id only fills tensors: padding is
    tracked by masks and lengths, never by token values, so a real end-of-text stays real."""

    def __init__(self, path, eos_id, pad_id=None):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self.tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise InputError(f"{path} is not a readable tokenizer ({e}); restore it") from None
        self.eos_id, self.pad_id = eos_id, eos_id if pad_id is None else pad_id

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


# -----------------------------------------------------------------------------
# loading and saving

HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "*.safetensors",
             "model.safetensors.index.json"]


def model_folder(name_or_path, flag="--model"):
    """A local folder as it is, or a hub id downloaded (config, weights and tokenizer only);
    flag names the option that gave it, for the error's fix."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path.count("/") != 1 or name_or_path.startswith((".", "/")):
        raise InputError(f"{flag} {name_or_path!r} is neither a local folder nor a hub id like "
                         "'Qwen/Qwen3-0.6B-Base'")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name_or_path, allow_patterns=HUB_FILES)
    except Exception as e:  # 'out/stress' reads as a hub id too: a mistyped run folder ends up here
        why = f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise InputError(f"could not fetch {name_or_path!r} from the Hugging Face hub ({why}), and "
                         f"there is no local folder of that name; check the path, or download the "
                         f"model elsewhere and pass its folder with {flag}") from None


def read_config(folder):
    path, generation = (os.path.join(folder, f) for f in ("config.json", "generation_config.json"))
    if not os.path.isfile(path):
        raise InputError(f"{folder}: no config.json; point --model at a Hugging Face model folder")
    d = read_json(path)
    if os.path.isfile(generation) and read_json(generation).get("eos_token_id") is not None:
        d["eos_token_id"] = read_json(generation)["eos_token_id"]
    return Qwen3Config.from_dict(d, source=path)


def load_weights(model, state, source):
    """state into model, every name and shape checked first, so that a mismatch is one line."""
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some exporters write the tied copy too
    for name, t in expected.items():
        if name not in state:
            raise InputError(f"{source}: tensor {name} is missing; the checkpoint does not match "
                             f"its config.json")
        if state[name].shape != t.shape:
            raise InputError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                             f"config.json implies {tuple(t.shape)}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InputError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all); "
                         f"is this a Qwen3 checkpoint?")
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings, assign=True)
    if model.config.tie_word_embeddings:  # assign=True replaced the parameters: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load(name_or_path, device="cpu", dtype=None):
    """(model, tokenizer) from a local folder or a hub id, in eval mode with every parameter
    frozen. dtype defaults to bf16 on CUDA and fp32 elsewhere."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    folder = model_folder(name_or_path)
    config = read_config(folder)
    with torch.device("meta"):  # no memory, no random init: the weights come next
        model = Qwen3(config)
    index = os.path.join(folder, "model.safetensors.index.json")  # a sharded one names its files
    files = (sorted(set(read_json(index)["weight_map"].values())) if os.path.isfile(index)
             else ["model.safetensors"])
    if not all(os.path.isfile(os.path.join(folder, f)) for f in files):
        raise InputError(f"{folder}: no model.safetensors or model.safetensors.index.json; the "
                         f"weights are missing")
    state = {k: v.to(dtype) for f in files
             for k, v in read_safetensors_file(os.path.join(folder, f), device).items()}
    load_weights(model, state, folder)
    model.eval().requires_grad_(False)
    model.name_or_path = name_or_path
    tokenizer = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise InputError(f"{folder}: no tokenizer.json; the model folder needs its tokenizer file "
                         f"too")
    if config.eos_token_id is None:
        raise InputError(f"{folder}: no eos_token_id in generation_config.json or config.json; "
                         f"add it")
    return model, Tokenizer(tokenizer, config.eos_token_id, config.pad_token_id)


def save(model, folder, tokenizer_path=None):
    """A Hugging Face-format folder (config.json, generation_config.json, model.safetensors,
    and tokenizer.json when given) that load() and transformers both open."""
    import shutil
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    cfg = {k: v for k, v in asdict(model.config).items() if v is not None}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # safetensors refuses shared tensors: config.json ties
        state.pop("lm_head.weight")
    write_atomic(os.path.join(folder, "model.safetensors"),
                 lambda p: save_file(state, p, metadata={"format": "pt"}))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
              **cfg,
              "bos_token_id": cfg["eos_token_id"], "use_sliding_window": False,
              "torch_dtype": str(model.lm_head.weight.dtype).removeprefix("torch.")}
    write_json(os.path.join(folder, "config.json"), config)
    ids = ("eos_token_id", "bos_token_id")
    write_json(os.path.join(folder, "generation_config.json"), {k: config[k] for k in ids})
    copy = os.path.abspath(os.path.join(folder, "tokenizer.json"))
    if tokenizer_path and os.path.abspath(tokenizer_path) != copy:
        shutil.copy(tokenizer_path, os.path.join(folder, "tokenizer.json"))
    return folder
