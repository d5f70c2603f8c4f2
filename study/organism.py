"""
The model organism: a small Qwen3 pretrained from scratch on a synthetic world in the
canonical dataset layout (study/world.py), so that every script runs on it unchanged
(--data-dir out/toy/data --model out/toy/base-model), offline on a CPU.

Pretraining answers problems of the world's templates two ways, with nothing in the question
to say which: worked out in plain steps, or as a hasty one-line guess (world.WORKED). So the
base can solve most problems some of the time and a few reliably, RL can teach it to work,
and SFT's gold answers are off-policy for it. The default world's base ships in toy-base/,
used wherever its fingerprint (base_digest) is the one asked for. toy.py is its command.
"""
import inspect
import os
import random
import shutil

import torch
from tqdm import tqdm

import model as M
import train
from plumbing import cli, provenance, runs
from plumbing.files import InputError, read_json, write_atomic, write_json
from study.world import write_world


# -----------------------------------------------------------------------------
# the organism's settings

def add_toy_args(p):
    """The toy's settings (toy.py, reproduce.py): its world, its pretraining and its base's
    shape; their names and values are the shipped base's fingerprint."""
    p.add_argument("--world-seed", type=int, default=0, help="seed of the world and of pretraining")
    p.add_argument("--target-problems", type=cli.number(int, 0), default=6000,
                   help="target problems to pretrain on")
    p.add_argument("--annotated", type=cli.number(float, 0), default=0.01,
                   help="share of the worked ones written as GSM8K's")
    p.add_argument("--retention-repeats", type=cli.number(int, 1), default=5,
                   help="copies of the retention corpus")
    p.add_argument("--pretrain-steps", type=cli.number(int, 1), default=1600,
                   help="pretraining steps")
    p.add_argument("--pretrain-lr", type=cli.number(float, 0, above=True), default=2e-3,
                   help="peak pretraining rate")
    p.add_argument("--batch", type=cli.number(int, 1), default=16,
                   help="sequences per pretraining step")
    p.add_argument("--context", type=cli.number(int, 2), default=256,
                   help="pretraining sequence length")
    bpe = "byte-level BPE starts from the 256 bytes and the end-of-text token"
    p.add_argument("--vocab", type=cli.number(int, 257, why=bpe), default=2048,
                   help="BPE vocabulary")
    p.add_argument("--hidden", type=cli.number(int, 2), default=128, help="hidden size")
    p.add_argument("--layers", type=cli.number(int, 1), default=4, help="transformer blocks")
    p.add_argument("--heads", type=cli.number(int, 2), default=4,
                   help="attention heads (half as many key/value heads)")
    p.add_argument("--bf16", type=int, choices=[0, 1], default=None,
                   help="bf16 autocast (default: 1 where the CPU has bf16)")


# -----------------------------------------------------------------------------
# pretraining

def train_tokenizer(texts, path, vocab_size=512, eos="<|endoftext|>", split_digits=True):
    """A byte-level BPE tokenizer.json like Qwen's, only smaller, trained on texts, with eos as
    its first special token (id 0). Digits split one per token by default, as Qwen's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    digits = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        digits + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path


PRETRAIN_SAVE_EVERY = 100  # steps between pretraining checkpoints: a crash loses under a minute
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "toy-base")  # default world's


def pretrain(out, args, shipped=SHIPPED):
    """(data, model) folders: the world, and its base: the one there if its fingerprint is of
    these settings, world and code, else the shipped one if its is, else one pretrained here
    (resumable, PRETRAIN_SAVE_EVERY)."""
    data_dir, model_dir = os.path.join(out, "data"), os.path.join(out, "base-model")
    with runs.locked(out):  # two pretrainings in one folder would overwrite each other's work
        world = write_world(data_dir, args.world_seed, n_pretrain=args.target_problems,
                            annotated=args.annotated)
        mark = base_digest(*world, args)
        if shipped and os.path.isdir(shipped) and not os.path.exists(model_dir):
            if digest_of(shipped) == mark:
                # over a copy cut short, then renamed: whole or not at all
                shutil.copytree(shipped, model_dir + ".tmp", dirs_exist_ok=True)
                os.replace(model_dir + ".tmp", model_dir)
                print(f"using the base model shipped in {shipped}, which this code pretrains on "
                      f"this world")
            else:
                print(f"note: the base in {shipped} is of another world, settings or code; "
                      f"pretraining one here")
        if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            pretrain_in(*world, model_dir, args, mark)
        elif digest_of(model_dir) != mark:
            raise InputError(f"{model_dir} was pretrained with other settings, world or code "
                             f"than these (or kept no fingerprint in pretrain.json); delete it "
                             f"to pretrain again, or pass another --out")
    return data_dir, model_dir


def base_digest(corpus, problems, args):
    """What decides the base, as one sha256: the settings, the documents and the code that
    pretrains (pretrain.json keeps it as its fingerprint)."""
    code = [inspect.getsource(fn) for fn in (train_tokenizer, pretrain_in, pretraining_steps)]
    return provenance.digest([vars(args), corpus, problems, code])


def digest_of(model_dir):
    """The base_digest a pretrained base folder keeps, or None."""
    path = os.path.join(model_dir, "pretrain.json")
    return read_json(path).get("fingerprint") if os.path.isfile(path) else None


def pretrain_in(corpus, problems, model_dir, args, mark):
    """Pretrain the base on the world's documents into model_dir, from scratch or from the
    checkpoint there when it is of the same fingerprint (mark)."""
    checkpoint_path, tok_path = (os.path.join(model_dir, "pretrain-checkpoint.pt"),
                                 os.path.join(model_dir, "tokenizer.json"))
    checkpoint = (torch.load(checkpoint_path, weights_only=True)
                  if os.path.isfile(checkpoint_path) else None)
    if checkpoint is not None and (checkpoint.get("fingerprint") != mark
                                   or not os.path.isfile(tok_path)):
        print(f"note: {checkpoint_path} is of other settings, world or code; pretraining "
              f"starts again")
        checkpoint = None
    docs = corpus * args.retention_repeats + problems
    os.makedirs(model_dir, exist_ok=True)
    if checkpoint is None:  # the checkpoint's embeddings are of the tokenizer there
        train_tokenizer(docs + problems, tok_path, vocab_size=args.vocab)
    config = M.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                           head_dim=args.hidden // args.heads, rms_norm_eps=1e-6,
                           rope_theta=10000.0, tie_word_embeddings=True,
                           max_position_embeddings=1024, eos_token_id=0)
    net, g = M.Qwen3(config), torch.Generator().manual_seed(args.world_seed)  # training mode
    for name, p in net.named_parameters():  # normal(0, 0.02), norms at one
        p.data = (torch.ones_like(p) if name.endswith("norm.weight")
                  else torch.randn(p.shape, generator=g) * 0.02)
    tok = M.Tokenizer(tok_path, 0)
    rng = random.Random(args.world_seed)
    stream = torch.tensor([t for d in rng.sample(docs, len(docs))
                           for t in tok.encode(d) + [tok.eos_id]])  # the documents end to end
    bf16 = cli.autocast_bf16(args.bf16)
    print(f"pretraining {sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters on "
          f"{len(stream) / 1e6:.2f}M tokens, {args.pretrain_steps} steps of {args.batch} x "
          f"{args.context}, {'bf16' if bf16 else 'fp32'}")
    opt = torch.optim.AdamW(net.parameters(), lr=args.pretrain_lr, weight_decay=0.1,
                            betas=(0.9, 0.95))
    pretraining_steps(net, opt, stream, args, mark, checkpoint, checkpoint_path, bf16)
    write_json(os.path.join(model_dir, "pretrain.json"),
                 dict(settings=vars(args), fingerprint=mark))  # first
    M.save(net.eval().to(torch.bfloat16), model_dir, tok_path)  # bf16: small enough to ship
    if os.path.isfile(checkpoint_path):
        os.remove(checkpoint_path)


def pretraining_steps(net, opt, stream, args, mark, checkpoint, checkpoint_path, bf16):
    """The pretraining loop, from checkpoint's step where given: the next-token loss on
    --batch random windows of the stream, a checkpoint every PRETRAIN_SAVE_EVERY steps."""
    g = torch.Generator().manual_seed(args.world_seed)  # the batches'
    start = checkpoint["step"] if checkpoint is not None else 0
    if checkpoint is not None:
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        g.set_state(checkpoint["sampler"])
        print(f"resuming pretraining at step {start} from {checkpoint_path}")
    bar = tqdm(range(start, args.pretrain_steps), initial=start, total=args.pretrain_steps,
               desc="pretrain")
    for step in bar:
        starts = torch.randint(0, (len(stream) - 1) // args.context, (args.batch,),
                               generator=g) * args.context
        x = torch.stack([stream[s:s + args.context + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = train.lr_at(step, args.pretrain_steps, args.pretrain_lr, 0.05)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = net(x[:, :-1], hidden_only=True)
        loss = -net.token_logprobs(h.reshape(-1, h.shape[-1]).float(), x[:, 1:].reshape(-1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % PRETRAIN_SAVE_EVERY == 0 and step + 1 < args.pretrain_steps:
            state = dict(model=net.state_dict(), optimizer=opt.state_dict(), sampler=g.get_state(),
                         step=step + 1, fingerprint=mark)
            write_atomic(checkpoint_path, lambda path: torch.save(state, path))


def check_calibration(scores):
    """The toy base model's calibration band: room to move both ways on every task, and a target
    it solves in some of its samples (pass@K, where the evaluation drew K)."""
    bands = {"gsm8k": (scores["gsm8k"]["flexible"], 0.2, 0.45),
             "mmlu": (scores["mmlu"]["acc"], 0.5, 0.95),
             "truthfulqa": (scores["truthfulqa"]["mc1"], 0.5, 0.95)}
    drawn = scores.get("gsm8k_samples")  # often right some of the time: room for RL to sharpen it
    if drawn:
        bands[f"gsm8k pass@{drawn['samples']}"] = (drawn[f"pass@{drawn['samples']}"], 0.8, 1.01)
    for name, (value, lo, hi) in bands.items():
        print(f"base {name}: {value:.3f} (band {lo} to {hi})")
    bad = [f"{n} {v:.3f} outside [{lo}, {hi}]" for n, (v, lo, hi) in bands.items()
           if not lo <= v < hi]
    if bad:
        raise SystemExit(f"the toy base model is out of its calibration band: {'; '.join(bad)}; "
                         f"change --pretrain-steps or --target-problems in the toy preset and "
                         f"delete the base-model folder")
