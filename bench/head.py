"""
The output layer's share of training and scoring, ours against the plain full-vocabulary
computation, over Qwen3-0.6B's output layer (random weights, 151,936 x 1,024): per-state
log-probs of given targets (sft.py's loss, RL's reference log-probs, answer scoring), and
the reverse KL between the next-token distributions of two sets of states (OPD's logged
state KL and its --signal logits loss), each without and with the gradient with respect
to the (student's) states. Ours is model.token_logprobs and model.token_kl with the
output layer frozen, as LoRA training has it (HeadLogprob, HeadKL: 4,096 output columns
at a time, no tensor of vocabulary width). The reference builds the [states, vocab] logits
and their log-softmax, as transformers' loss and a plain PyTorch KL do, with autograd for
the gradient. The two take turns for --repeats rounds: seconds are each one's fastest
round, the speed ratio the median over rounds of the ratio within a round (with its
range); peak memory by bench/common.step_peak_memory; the differences are the largest
between the two in the values and, relative to the largest gradient entry, in the
gradients.

    python bench/head.py
    python bench/head.py --states 2048 --dtypes bf16
"""
import argparse

import torch
import torch.nn.functional as F

from common import M, add_args, markdown, race, setup, step_peak_memory


def frozen_head(config_dir, dtype, device, seed=0):
    """Our model with only its output layer real (random, frozen): token_logprobs and
    token_kl read nothing else, so the rest stays on the meta device."""
    config = M.read_config(config_dir)
    with torch.device("meta"):
        model = M.Qwen3(config)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.02
    model.lm_head.weight = torch.nn.Parameter(weight.to(device, dtype), requires_grad=False)
    return model


def full_logprobs(weight, h, targets):
    return F.linear(h, weight).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def full_reverse_kl(weight, hs, ht):
    log_s, log_t = F.linear(hs, weight).float().log_softmax(-1), F.linear(ht, weight).float().log_softmax(-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def pass_of(fn, states, with_grad):
    """fn(states) as a function of no arguments returning (values, gradient or None)."""
    def run():
        if not with_grad:
            with torch.no_grad():
                return fn(states), None
        h = states.detach().requires_grad_(True)
        values = fn(h)
        values.sum().backward()
        return values.detach(), h.grad
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--states", type=int, default=1024, help="states (rows); sft's 4 x 256 step has 1,020")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, the two taking turns")
    args = p.parse_args()
    device = setup(args)
    rows = []
    for dtype_name in args.dtypes.split(","):
        _, dtype = M.resolve_device(device, dtype_name)
        model = frozen_head(args.config, dtype, device)
        weight = model.lm_head.weight
        g = torch.Generator().manual_seed(1)
        student, teacher = (torch.randn(args.states, weight.shape[1], generator=g).to(device, dtype) for _ in range(2))
        targets = torch.randint(0, weight.shape[0], (args.states,), generator=g).to(device)
        works = [("log-probs", lambda h: model.token_logprobs(h, targets), lambda h: full_logprobs(weight, h, targets)),
                 ("reverse KL", lambda h: model.token_kl(h, teacher), lambda h: full_reverse_kl(weight, h, teacher))]
        for name, ours, full in works:
            for with_grad in (False, True):
                fns = [pass_of(ours, student, with_grad), pass_of(full, student, with_grad)]
                for fn in fns:
                    fn()  # warm-up
                timing = race(fns, device, args.repeats)
                (t_ours, t_full), ((v_ours, g_ours), (v_full, g_full)) = timing.best, timing.results
                peaks = [step_peak_memory(fn, device) for fn in fns]
                grad_diff = "-" if not with_grad else \
                    f"{((g_ours.float() - g_full.float()).abs().max() / g_full.float().abs().max()).item():.1e}"
                rows.append((dtype_name, name, "yes" if with_grad else "no", args.states, f"{t_ours:.3f}",
                             f"{t_full:.3f}", *timing.ratio_cells(1, 0), f"{peaks[0] / 2**20:.0f}",
                             f"{peaks[1] / 2**20:.0f}", f"{peaks[0] / peaks[1]:.2f}x",
                             f"{(v_ours - v_full).abs().max().item():.1e}", grad_diff))
                print(" ".join(map(str, rows[-1])), flush=True)
        del model, weight, student, teacher
    print()
    print(markdown(["dtype", "work", "gradient", "states", "ours s", "full logits s", "speed ratio",
                    "speed ratio's range", "ours peak MiB", "full peak MiB", "memory ratio", "max value difference",
                    "max gradient difference"], rows))


if __name__ == "__main__":
    main()
