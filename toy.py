"""
The toy study's model organism (study/organism.py): writes the synthetic world and takes
its base, the one shipped in toy-base/ where it is of these settings, else one pretrained
here; then says how far SFT's gold answers lie from the base's own samples.

    python toy.py                       # -> out/toy/data and out/toy/base-model
    python toy.py --pretrain --out out/ship
"""
import argparse

import drift
from plumbing import cli
from study import organism


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/toy", help="folder for data/ and base-model/")
    p.add_argument("--pretrain", action="store_true",
                   help="pretrain here even where the shipped base is the same")
    organism.add_toy_args(p)
    args = p.parse_args(argv)
    if args.heads % 2 or args.hidden % (2 * args.heads):
        p.error(f"--hidden {args.hidden} --heads {args.heads}: need an even number of heads (half "
                f"as many key/value) of even size")
    print(vars(args))
    out, fresh = vars(args).pop("out"), vars(args).pop("pretrain")  # not settings of the base
    data_dir, model_dir = organism.pretrain(out, args, None if fresh else organism.SHIPPED)
    print(f"world in {data_dir}, base model in {model_dir}")
    drift.report_offpolicy_gap(model_dir, data_dir)


if __name__ == "__main__":
    cli.run_script(main)
