"""
A study's report from its run folders (study/report.py): the table in the layout of the
paper's Table 2 with the paper's numbers beside ours, seeds merged into a mean and a spread,
what predicts forgetting, and the readings; results.md, results.json and results.png in the
study folder. --study frontier writes the frontier study's (study/frontier.py) instead, --study
size the size study's (study/size.py).

    python results.py out                               # the table of out/'s runs
    python results.py out/toy                           # reproduce.py writes it at a study's end
    python results.py out/toy/frontier --study frontier # frontier.md, .json, .png again
    python results.py out/toy/size --study size         # size.md, .json, .png again
    python results.py --curves out/rl out/mild          # training curves, into out/curves.png
"""
import argparse
import os

from plumbing import cli
from plumbing.files import InputError
from study import figures, frontier, report, size


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?",
                   help="the study folder: the base's eval.json and the run folders beside it")
    p.add_argument("--study", choices=["main", "frontier", "size"], default="main",
                   help="main: the paper's table; frontier: forgetting at matched gain; size: at "
                        "a matched update norm")
    p.add_argument("--curves", nargs="+", metavar="RUN",
                   help="instead, training curves of these run folders, into curves.png beside "
                        "the first")
    args = p.parse_args(argv)
    if args.curves:
        beside = os.path.dirname(os.path.normpath(args.curves[0])) or "."
        path = figures.curves(args.curves, os.path.join(beside, "curves.png"))
        print(f"curves in {path}" if path else f"no log.jsonl to draw in {', '.join(args.curves)}")
    elif not args.root:
        p.error("name the study folder, or --curves and run folders")
    elif args.study != "main":
        if not os.path.isfile(os.path.join(args.root, "eval.json")):
            raise InputError(f"{args.root} holds no base evaluation (eval.json); run python "
                             f"reproduce.py --study {args.study}")
        print({"frontier": frontier, "size": size}[args.study].write_report(args.root))
    else:
        print(report.write_results(args.root))


if __name__ == "__main__":
    cli.run_script(main)
