"""The benchmarks on a tiny model: they run end to end, and the checks they print (ours
against transformers / peft on the same weights) come out as they must in fp32."""
import contextlib
import io
import os
import re
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def bench(name, *args, dtype="fp32"):
    """The table rows a benchmark prints for dtype, run as `python bench/NAME ...` runs it
    but in this process: a process of its own spent about 10 s importing transformers."""
    argv, path, stdout = sys.argv, list(sys.path), io.StringIO()
    sys.argv = [os.path.join(BENCH, name), "--dtypes", dtype, "--device", "cpu", *map(str, args)]
    sys.path.insert(0, BENCH)
    try:
        with contextlib.redirect_stdout(stdout):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    table = [line for line in stdout.getvalue().splitlines() if line.startswith(f"| {dtype}")]
    assert table, stdout.getvalue()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table]


def test_sample_bench_decodes_what_transformers_decodes(tiny_model):
    rows = bench("sample.py", "--config", tiny_model, "--batches", "1,3", "--new-tokens", "8", "--repeats", "3")
    speed, steps = rows[:2], rows[2:]  # the speed table, then where a decode step's time goes
    assert [r[1] for r in speed] == [r[1] for r in steps] == ["1", "3"], rows
    for row in speed:
        assert row[-1] == "yes", row
        low, high = (float(cell.rstrip("x")) for cell in row[6].split(" to "))
        assert 0 < low <= float(row[5].rstrip("x")) <= high, row  # the median of the rounds' ratios, in their range
    for row in steps:
        ours_ms, ref_ms, products_ms = map(float, row[3:6])
        assert ours_ms > 0 and ref_ms > 0 and products_ms > 0, row
        ceiling, rounding = float(row[-1].rstrip("x")), 0.005  # each figure is printed to 2 decimals
        assert (ref_ms - rounding) / (products_ms + rounding) - rounding <= ceiling, row
        assert ceiling <= (ref_ms + rounding) / (products_ms - rounding) + rounding, row


def test_group_bench_draws_the_same_groups_in_both_decode_loops(tiny_model):
    rows = bench("group.py", "--config", tiny_model, "--prompts", "2", "--samples", "3", "--new-tokens", "6",
                 "--prompt-tokens", "5", "--modes", "dropping,fixed", "--rank", "4")
    assert [(r[4], r[5]) for r in rows] == [("dropping", "rank 4, folded"), ("fixed", "rank 4, folded"),
                                            ("dropping", "rank 4, own products")], rows
    assert all(r[1] == "2x3" and r[3] == "6 / 6" and r[-1] == "100%" for r in rows), rows


def test_group_bench_runs_each_dtype_in_a_process_of_its_own(tiny_model):
    # the reference's peak in one dtype must not stack on what the one before left resident
    out = subprocess.run([sys.executable, os.path.join(BENCH, "group.py"), "--config", tiny_model, "--device", "cpu",
                          "--dtypes", "fp32,bf16", "--prompts", "2", "--samples", "2", "--new-tokens", "3",
                          "--prompt-tokens", "5", "--rank", "0"], capture_output=True, text=True, check=True).stdout
    assert out.count("device cpu") == 2, out  # each process says where it runs
    tables = out.split("| dtype |")[1:]
    assert len(tables) == 2 and "| fp32 |" in tables[0] and "| bf16 |" in tables[1], out
    assert "| bf16 |" not in tables[0] and "| fp32 |" not in tables[1], out


def test_group_bench_ends_rows_at_random_on_both_sides(tiny_model):
    rows = bench("group.py", "--config", tiny_model, "--prompts", "2", "--samples", "4", "--new-tokens", "40",
                 "--prompt-tokens", "5", "--modes", "dropping,fixed", "--rank", "0", "--finish-every", "4")
    assert len(rows) == 2 and all(r[-1] == "100%" for r in rows), rows  # both loops end rows alike
    for row in rows:
        ours, reference = map(float, row[3].split(" / "))
        # a row ends after 4 tokens on average: far from 40, and not all at the first token
        assert 1 < ours < 20 and 1 < reference < 20, row


def test_sample_bench_with_a_shared_prefix_runs_it_once_and_decodes_what_transformers_decodes(tiny_model, monkeypatch):
    import sample
    groups, plain_groups = [], sample.prompt_groups
    monkeypatch.setattr(sample, "prompt_groups", lambda prompts: groups.append(plain_groups(prompts)) or groups[-1])
    [speed, _] = bench("sample.py", "--config", tiny_model, "--batches", "3", "--shared-prefix", "20",
                       "--new-tokens", "8", "--repeats", "1")
    assert groups and all(trunks == [0] for _, trunks in groups), groups  # one group: the prefix runs once
    assert speed[-1] == "yes", speed  # greedy tokens: transformers' own


def test_train_step_bench_starts_from_the_same_loss(tiny_model):
    rows = bench("train_step.py", "--config", tiny_model, "--batch", "2", "--length", "16", "--rank", "4", "--steps", "1")
    rows, [anatomy] = rows[:2], rows[2:]  # the step table, then where the step's time goes
    assert [r[2] for r in rows] == ["no", "yes"], rows  # sft.py's default, then --recompute
    ours_s, peft_s, products_s = map(float, anatomy[2:5])  # 4 significant digits
    # the same seconds printed to 3 decimals and to 4 significant digits: each rounding moves
    # them by at most 5e-4 below 10 s
    assert abs(ours_s - float(rows[0][3])) <= 1e-3 and abs(peft_s - float(rows[0][4])) <= 1e-3, (anatomy, rows)
    assert products_s > 0 and abs(float(anatomy[-1].rstrip("x")) - peft_s / products_s) <= 0.005 + 2e-3 * peft_s / products_s
    for row in rows:
        ours, peft = row[-1].split(" / ")
        assert abs(float(ours) - float(peft)) < 1e-3, row
        assert float(row[9].rstrip("x")) > 0, row  # both peaks measured (the ratio of two byte counts)
    assert int(rows[1][7]) <= int(rows[0][7]), rows  # recomputing never holds more


def test_train_step_bench_on_gsm8k_lengths_shares_rows_and_starts_from_the_same_loss(tiny_model, data_dir):
    common = ("--config", tiny_model, "--data-dir", data_dir, "--gsm8k-batch", "8", "--rank", "4", "--steps", "1")
    rows = bench("train_step.py", *common)
    # sft.py's first 8 examples, end to end in one row on the CPU (model.training_rows)
    assert [r[3] for r in rows] == ["1 shared row of 1,507", "8 rows"], rows
    assert [r[1] for r in rows] == ["8, 114 to 273"] * 2, rows
    assert rows[0][2] == "100%" and int(rows[1][2].rstrip("%")) < 100, rows  # padding in one row each alone
    for row in rows:  # ours shared, ours a row each, peft: one loss on the same batch and weights
        ours, peft = row[-1].split(" / ")
        assert abs(float(ours) - float(peft)) < 1e-4, row
    rows = bench("train_step.py", *common, "--without-peft")
    assert rows[1][5:8] == ["-", "1.00x", "1.00x to 1.00x"] and rows[1][9:11] == ["-", "1.00x"], rows


@pytest.mark.parametrize("workload", [("--group-size", "4"), ("--cuts", "3")])  # rl.py's batch, opd.py's
def test_train_step_bench_lays_common_prefixes_out_once_and_starts_from_the_same_loss(tiny_model, data_dir, workload):
    rows = bench("train_step.py", "--config", tiny_model, "--data-dir", data_dir, "--gsm8k-batch", "2", *workload,
                 "--rank", "4", "--steps", "1")
    sequences = "6" if workload[0] == "--cuts" else "8"  # 2 samples cut at 3 points each; 2 x 4 samples
    assert [r[1].split(",")[0] for r in rows] == [sequences] * 2, rows
    laid_out, total = re.search(r"([\d,]+) of ([\d,]+) tokens \(prefixes shared\)", rows[0][3]).groups()
    assert int(laid_out.replace(",", "")) < int(total.replace(",", "")), rows
    for row in rows:  # ours sharing prefixes, ours a row each, peft: one loss on the same batch and weights
        ours, peft = row[-1].split(" / ")
        assert abs(float(ours) - float(peft)) < 1e-4, row


def test_mmlu_bench_scores_what_the_loop_scores(tiny_model, data_dir):
    [row] = bench("mmlu.py", "--config", tiny_model, "--data-dir", data_dir, "--questions", "3", "--shots", "1")
    assert float(row[-1]) < 1e-3, row


def test_layout_bench_computes_the_same_in_both_orders(tiny_model):
    rows = bench("layout.py", "--config", tiny_model, "--batches", "1,3", "--new-tokens", "6", "--train", "2x16",
                 "--rank", "4", "--repeats", "1")
    assert [r[1] for r in rows] == ["decode, batch 1", "decode, batch 3", "LoRA forward+backward, 2x16"], rows
    assert all(r[-1] == "yes" and float(r[4].rstrip("x")) > 0 for r in rows), rows


def test_layout_bench_times_the_few_row_forms_in_bf16(tiny_model):
    rows = bench("layout.py", "--config", tiny_model, "--batches", "1,3", "--new-tokens", "6", "--train", "0",
                 "--repeats", "1", dtype="bf16")
    layouts, forms = rows[:2], rows[2:]  # row-major against column-major, then the three forms of the products
    assert [r[1] for r in layouts] == ["decode, batch 1", "decode, batch 3"], rows
    assert [(r[1], r[2]) for r in forms] == [(f"decode, batch {b}", form) for b in (1, 3)
                                             for form in ("F.linear", "few-row forms", "packed")], rows
    assert all(float(r[4].rstrip("x")) > 0 for r in rows), rows
    assert all(r[4] == "1.00x" and r[-1] == "yes" for r in forms if r[2] == "F.linear"), rows  # each against itself


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_head_bench_computes_what_the_full_logits_compute(tiny_model, dtype):
    rows = bench("head.py", "--config", tiny_model, "--states", "37", "--repeats", "1", dtype=dtype)
    assert [(r[1], r[2]) for r in rows] == [("log-probs", "no"), ("log-probs", "yes"),
                                            ("reverse KL", "no"), ("reverse KL", "yes")], rows
    # fp32: float rounding only; bf16: the probabilities are rounded to bf16 before their
    # product with the output layer, and the two pass the logits through different kernels
    value_bound, grad_bound = (1e-5, 1e-5) if dtype == "fp32" else (5e-2, 5e-2)
    for row in rows:
        assert float(row[6].rstrip("x")) > 0 and float(row[10].rstrip("x")) > 0, row
        assert float(row[11]) <= value_bound, row
        assert row[12] == "-" if row[2] == "no" else float(row[12]) <= grad_bound, row


def test_peak_memory_sees_what_an_autograd_function_allocates_and_frees_inside():
    # the kind of allocation HeadLogprob makes: a large scratch tensor that lives and dies
    # within one custom Function's forward
    import torch
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import step_peak_memory

    class Scratch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            scratch = torch.ones(2 ** 21)  # 8 MiB
            return x * scratch[:1]

        @staticmethod
        def backward(ctx, grad):
            return grad

    x = torch.ones(1, requires_grad=True)
    peak = step_peak_memory(lambda: Scratch.apply(x).sum().backward(), torch.device("cpu"))
    assert 2 ** 23 <= peak < 2 ** 23 + 2 ** 16, peak


def test_race_ratio_pairs_the_rounds():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import Race
    # round by round the second function runs twice as fast as the first, while the machine
    # slows fourfold between rounds; best times from different rounds would give 0.5x
    timing = Race([[1.0, 0.5], [4.0, 2.0], [2.0, 1.0]], [None, None])
    assert timing.best == [1.0, 0.5]
    assert timing.ratio(0, 1) == (2.0, 2.0, 2.0)
    assert Race([[4.0, 1.0], [1.0, 0.5], [3.0, 1.0], [8.0, 1.0]], [None, None]).ratio(0, 1) == (3.5, 2.0, 8.0)
    assert Race([[4.0, 1.0], [1.0, 0.5], [3.0, 1.0]], [None, None]).ratio_cells(1, 0) == ("0.33x", "0.25x to 0.50x")


def test_race_alternates_the_order_and_keeps_each_functions_own_times():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import time
    from common import race
    import torch
    calls = []

    def sleeper(name, seconds):
        def fn():
            calls.append(name)
            time.sleep(seconds)
            return name
        return fn

    timing = race([sleeper("a", 0.0), sleeper("b", 0.05), sleeper("c", 0.2)], torch.device("cpu"), repeats=3)
    assert calls == list("abccbaabc")
    assert timing.results == list("abc") and len(timing.rounds) == 3
    for a, b, c in timing.rounds:  # each time in its own function's column, whatever the order it ran in
        assert a < 0.05 <= b < 0.2 <= c, timing.rounds
