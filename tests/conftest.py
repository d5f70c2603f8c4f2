"""Shared fixtures: tiny random Qwen3 checkpoints and a tiny byte-level BPE tokenizer,
built once per test session in a temporary folder. Nothing is downloaded."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import opd  # noqa: E402
import rl  # noqa: E402
import sft  # noqa: E402
from study import organism

# $STATES_DATA if set; else the offline copies beside the repository; else fetched once into the cache
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
DATA_DIR = os.environ.get("STATES_DATA") or (SHARED_DATA if os.path.isdir(SHARED_DATA) else None)
OFFICIAL_CONFIG = os.path.join(ROOT, "tests", "qwen3-0.6b-base")  # Qwen3-0.6B-Base's own config.json

# Whatever the machine, a script given no device runs on the CPU (cli.resolve_device reads
# $STATES_DEVICE; scripts run as subprocesses inherit it), so the suite computes what it
# computes in CI. The tests that take a device run on each device this machine has: where
# a GPU is present, `pytest -k cuda` checks the path the scripts take there.
os.environ["STATES_DEVICE"] = "cpu"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# name -> transformers Qwen3Config arguments; grouped-query ratios 2 and 4, tied and untied
TINY_CONFIGS = {
    "tied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "untied": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}


def randomize_norms(model, seed):
    """Every RMSNorm weight drawn from U(0.5, 1.5): a norm that forgets its weight, or applies
    it where it does not belong, then computes another model, as it would on a real checkpoint."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def our_model(config, seed=0, std=0.1):
    """A random Qwen3 built by the project's own code: normal(0, std) weights, random norms."""
    import model as M
    g = torch.Generator().manual_seed(seed)
    net = M.Qwen3(config)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return randomize_norms(net, seed).eval()


def randomize_adapter(model, name="default", seed=0, scale=0.1):
    """Random values in every LoRA matrix of adapter `name`, B included, so that the adapter
    changes what the model computes (a fresh adapter's B is zero)."""
    import lora
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.lora_parameters(model, name):
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def hold_in_another_process(folder):
    """A process that holds folder (runs.hold) until it is killed."""
    import subprocess
    code = "import sys; sys.path.insert(0, sys.argv[1]); from plumbing import runs; runs.lock(sys.argv[2]); print('held', flush=True); " \
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
    """A random Qwen3, random norms included, written by transformers' save_pretrained (the
    reference writer)."""
    import shutil
    from transformers import Qwen3Config, Qwen3ForCausalLM
    args = dict(TINY_CONFIGS["tied"])
    args.update(overrides)
    config = Qwen3Config(vocab_size=400, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                         eos_token_id=0, bos_token_id=0, initializer_range=0.1, **args)
    torch.manual_seed(seed)
    model = randomize_norms(Qwen3ForCausalLM(config).eval(), seed)
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
    return organism.train_tokenizer(gsm8k_texts(), str(workdir / "tokenizer.json"), vocab_size=384, split_digits=False)


@pytest.fixture(scope="session")
def tiny_models(workdir, tokenizer_path):
    """name -> folder of a transformers-saved random checkpoint."""
    return {name: save_hf_model(str(workdir / name), tokenizer_path, seed=i, **cfg)
            for i, (name, cfg) in enumerate(TINY_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_model(tiny_models):
    return tiny_models["tied"]


@pytest.fixture
def seeded():
    torch.manual_seed(0)


# what every training test shares: a script's flags, its log and adapter
# a random model's completions are never right: rl.py's runs in these tests reward each prompt's
# first sample, so that every group has an advantage to learn from
MAINS = {"sft": sft.main, "rl": lambda argv: rl.main(argv, reward_fn=lambda rollout, row: float(rollout.sample_index == 0)),
         "opd": opd.main}


def common(tiny_model, data_dir, out, *extra):
    return ["--model", tiny_model, "--data-dir", str(data_dir), "--out", str(out), *map(str, extra)]


def read_log(folder):
    return [json.loads(l) for l in open(os.path.join(folder, "log.jsonl"))]


def adapter_tensors(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def write_fixed_answer_data(source, folder, answer, n=24):
    """GSM8K-format data whose every answer is the same string."""
    rows = data.load_gsm8k("train", source)[:n]
    os.makedirs(os.path.join(folder, "gsm8k"), exist_ok=True)
    for split in ("train", "test"):
        with open(os.path.join(folder, "gsm8k", f"{split}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps({"question": r["question"], "answer": answer}) + "\n")
    return folder


def two_sequences(tok):
    a = tok.encode("Question: Janet has 3 apples and buys 5 more. How many?\nAnswer:")
    b = tok.encode("Question: 2 + 2?\nAnswer:")
    return a, b


def short_run(script, tiny_model):
    """Flags for a four-step run of script that trains visibly (LoRA dropout on in sft)."""
    return {"sft": ["--train-limit", 12, "--batch-size", 4, "--lora-dropout", 0.1, "--epochs", 2],
            "rl": ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 6, "--steps", 4, "--lr", 1e-3],
            "opd": ["--teacher", tiny_model, "--prompts-per-step", 2, "--max-new-tokens", 6, "--steps", 4,
                    "--continuation-tokens", 4, "--lr", 1e-3]}[script]
