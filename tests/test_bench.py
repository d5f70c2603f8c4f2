"""The benchmarks compare like with like: run on a tiny config, each side decodes the same
tokens or starts from the same loss. (Their timings are read in bench/README.md, never
asserted.)"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import OFFICIAL_CONFIG, ROOT



def bench_common():
    """bench/common.py, loaded by its path: putting bench/ on sys.path would shadow sample.py
    with bench/sample.py for every later test."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_common", os.path.join(ROOT, "bench", "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """The official config at a tiny width: the benchmarks build random weights of it."""
    with open(os.path.join(OFFICIAL_CONFIG, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, bos_token_id=0, eos_token_id=0)
    folder = tmp_path_factory.mktemp("config")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def bench(name, config, *flags):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), "--config", config, "--repeats",
                           "1", *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]


def test_sample_bench_decodes_what_transformers_decodes(tiny_config):
    header, *rows = bench("sample", tiny_config, "--new-tokens", "6")
    assert [r[:2] for r in rows] == [["fp32", "1"], ["fp32", "8"], ["bf16", "1"], ["bf16", "8"]]
    assert all(r[header.index("same tokens")] == "yes" for r in rows)


def test_sample_bench_times_an_adapters_own_products_against_it_merged(tiny_config):
    header, *rows = bench("sample", tiny_config, "--new-tokens", "4", "--adapter-rank", "2", "--batches", "2")
    assert header[3:5] == ["own products tok/s", "merged tok/s"] and [r[:3] for r in rows] == [["fp32", "2", "2"],
                                                                                            ["bf16", "2", "2"]]


def test_group_bench_runs_each_dtype_in_a_process_of_its_own(tiny_config):
    rows = bench("group", tiny_config, "--new-tokens", "4", "--prompts", "2", "--samples", "3")
    assert [r[0] for r in rows] == ["dtype", "fp32", "dtype", "bf16"]  # two tables: two processes
    assert all(r[1] == "2 x 3" for r in rows[1::2])


def test_train_step_bench_starts_from_the_same_loss(tiny_config):
    header, *rows = bench("train_step", tiny_config, "--length", "16", "--dtypes", "fp32")
    assert [r[1] for r in rows] == ["transformers + peft", "ours", "ours --recompute"]
    losses = [float(r[header.index("first loss")]) for r in rows]
    assert losses[0] > 1 and max(losses) - min(losses) < 1e-3


def test_peak_memory_counts_what_a_step_allocates_and_frees_inside_it():
    peak_memory = bench_common().peak_memory
    kept = []

    def step():
        scratch = torch.ones(2 ** 24, dtype=torch.uint8)  # 16 MiB, freed before the step ends
        kept.append(torch.ones(2 ** 22, dtype=torch.uint8))  # 4 MiB, held after it
        del scratch
    assert 20 * 2 ** 20 <= peak_memory(step, torch.device("cpu")) < 21 * 2 ** 20


def test_ratio_pairs_each_round_and_race_takes_turns():
    common = bench_common()
    race, ratio = common.race, common.ratio
    rounds = [[2.0, 1.0], [8.0, 2.0], [3.0, 1.0]]  # the second round was slow for both
    assert ratio(rounds, 0, 1) == ("3.00x", "2.00x to 4.00x")
    order = []
    _, results = race([lambda: order.append("a") or 1, lambda: order.append("b") or 2], torch.device("cpu"), 2)
    assert order == ["a", "b", "a", "b", "b", "a"] and results == [1, 2]  # warm-up, then turns in both orders


def test_side_by_side_bench_runs_the_pair_both_ways(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "side_by_side.py"), "--out", str(out),
                           "--repeats", "1", "--pair", "rl,rl", "--rl-steps", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("round 1, one at a time: ") for line in lines)
    assert lines[-1].startswith("side by side ran ") and "as fast as one at a time" in lines[-1]
    for run in ("rl-0", "rl-1"):  # the last way's two runs, each of the steps asked for, each its own seed
        record = json.loads((out / "runs" / run / "run.json").read_text())
        assert record["finished_steps"] == 1 and record["seed"] == int(run[-1])
