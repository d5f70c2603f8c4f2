"""Shared fixtures: tiny random Qwen3 checkpoints and a tiny byte-level BPE tokenizer,
built once per test session in a temporary folder. Nothing is downloaded."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# $STATES_DATA if set; else the offline copies beside the repository; else fetched once into the cache
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
DATA_DIR = os.environ.get("STATES_DATA") or (SHARED_DATA if os.path.isdir(SHARED_DATA) else None)
SHARED_CONFIG = os.path.join(ROOT, "..", "shared", "qwen3-0.6b-base")

# Whatever the machine, a model or script given no device runs on the CPU (model.resolve_device
# reads $STATES_DEVICE; scripts run as subprocesses inherit it), so the suite computes what it
# computes in CI. The tests that take a device run on each device this machine has: where a
# GPU is present, `pytest -k cuda` checks the path the scripts take there (bf16, autocast,
# SDPA's CUDA kernels, the captured decode step)
os.environ["STATES_DEVICE"] = "cpu"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# why a test of oneDNN's products skips: PyTorch's oneDNN operators are internal, and its
# bf16 kernels need more of the CPU than its fp32 ones (an AMD EPYC with AVX2 and no
# AVX-512 ran the fp32 ones only)
ONEDNN_MISSING = "oneDNN's linear does not run in fp32 with this PyTorch on this CPU"
ONEDNN_BF16_MISSING = "oneDNN's linear does not run in bf16 with this PyTorch on this CPU"

# name -> transformers Qwen3Config arguments; grouped-query ratios 2 and 4, tied and untied
TINY_CONFIGS = {
    "tied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "untied": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}


def randomize_adapter(model, name="default", seed=0, scale=0.1):
    """Random values in every LoRA matrix of adapter `name`, B included, so that the adapter
    changes what the model computes (a fresh adapter's B is zero)."""
    import lora
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.lora_parameters(model, name):
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def hold_in_another_process(folder):
    """A process that holds folder (lora.hold) until it is killed."""
    import subprocess
    code = "import sys; sys.path.insert(0, sys.argv[1]); import lora; lora.hold(sys.argv[2]); print('held', flush=True); " \
           "sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", code, ROOT, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    return holder

def gsm8k_texts(limit=1500):
    import data
    rows = data.load_gsm8k("train", DATA_DIR)[:limit]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def save_hf_model(folder, tokenizer_path, seed=0, max_shard_size="2GB", **overrides):
    """A random Qwen3 written by transformers' save_pretrained (the reference writer)."""
    import shutil
    from transformers import Qwen3Config, Qwen3ForCausalLM
    args = dict(TINY_CONFIGS["tied"])
    args.update(overrides)
    config = Qwen3Config(vocab_size=400, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                         eos_token_id=0, bos_token_id=0, initializer_range=0.1, **args)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    shutil.copy(tokenizer_path, os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 0, "bos_token_id": 0}, f)
    return folder


@pytest.fixture(scope="session")
def data_dir():
    import data
    return data.resolve_data_dir(DATA_DIR)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("states")


@pytest.fixture(scope="session")
def tokenizer_path(workdir, data_dir):
    import model
    return model.train_tokenizer(gsm8k_texts(), str(workdir / "tokenizer.json"), vocab_size=384, split_digits=False)


@pytest.fixture(scope="session")
def tiny_models(workdir, tokenizer_path):
    """name -> folder of a transformers-saved random checkpoint."""
    return {name: save_hf_model(str(workdir / name), tokenizer_path, seed=i, **cfg)
            for i, (name, cfg) in enumerate(TINY_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_model(tiny_models):
    return tiny_models["tied"]


@pytest.fixture
def packed_products(monkeypatch):
    """A list that gets one entry per packed product run (model.PackedWeights) during the
    test: how many layers' weights it stacks."""
    import model
    sizes = []
    product = model.PackedWeights.__call__
    monkeypatch.setattr(model.PackedWeights, "__call__", lambda self, x: sizes.append(len(self.sizes)) or product(self, x))
    return sizes


@pytest.fixture
def onednn_products(monkeypatch):
    """A list that gets one entry per unpacked oneDNN product run (model.onednn_product)
    during the test: the shape of the weight it multiplies by."""
    import model
    shapes = []
    product = model.onednn_product
    monkeypatch.setattr(model, "onednn_product", lambda *args: shapes.append(tuple(args[1].shape)) or product(*args))
    return shapes


PACKED_AS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def pack_bf16_as(monkeypatch, kind):
    """bf16 weights packed as this CPU's oneDNN packs them ("bf16"), or as fp32 copies
    ("fp32"), as on a CPU whose oneDNN has no bf16 linear (model.packing_dtype); skips
    where this machine cannot run the kind asked for."""
    import model
    works = model.onednn_linear_works
    if not works(PACKED_AS[kind]):
        pytest.skip(ONEDNN_BF16_MISSING if kind == "bf16" else ONEDNN_MISSING)
    if kind == "fp32":
        monkeypatch.setattr(model, "onednn_linear_works", lambda dtype=torch.bfloat16: dtype != torch.bfloat16 and works(dtype))
    assert model.packing_dtype(torch.zeros(1, dtype=torch.bfloat16)) == PACKED_AS[kind]


@pytest.fixture(params=["bf16", "fp32"], ids=["packed-bf16", "packed-fp32"])
def bf16_packing(request, monkeypatch):
    """Each way bf16 weights pack (pack_bf16_as), in turn."""
    pack_bf16_as(monkeypatch, request.param)
    return request.param


@pytest.fixture
def seeded():
    torch.manual_seed(0)
