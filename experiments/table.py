r"""Base methods alone and "+FedIA": the paper-style comparison table (FedIA paper, Tables 2-5).

  python experiments/table.py --dataset twitch --setting s3 --seeds 0,1,2 \
      --methods fedavg,fedprox,moon,feddyn,fedopt,scaffold,majority,local,centralized
  python experiments/table.py --dataset wikinet --seeds 0,1,2 --select val --methods fedavg

Each method runs with all seeds in one compiled program, its own aggregation
next to its "+FedIA" cell. (rho, beta) come from configs/methods/defaults.yaml
(the paper's Table 7 for Twitch, 0.5/0.5 otherwise) or, with --select val,
from the best validation AVG over the 5x5 grid. Writes table.md, table.csv,
table.tex, table.png, config.json and runs/<method>.npz into --out. An
interrupted table continues with --resume DIR.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import cli, methods, references  # noqa: E402
from fedjax_graph.comparison import SELECTIONS, resume_table, run_table  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_federation_flags(parser)
  cli.add_sweep_flags(parser)
  cli.add_output_flags(parser)
  every = list(methods.METHODS) + list(references.REFERENCES)
  parser.add_argument("--methods", type=cli.str_list, default=",".join(every),
                      help="comma list of base methods from " + ", ".join(methods.METHODS)
                           + " and reference rows from " + ", ".join(references.REFERENCES)
                           + " (majority class, local training alone, centralised training; "
                             "no +FedIA)"
                           + " (default: all)")
  parser.add_argument("--select", choices=SELECTIONS, default="fixed",
                      help="(rho, beta) of +FedIA: fixed (from --method-config) or val (best "
                           "validation AVG over the 5x5 grid, one sweep per method) "
                           "(default: %(default)s)")
  parser.add_argument("--method-config", type=pathlib.Path, default=methods.METHODS_FILE,
                      help="YAML with each method's hyper-parameters and (rho, beta) "
                           "(default: configs/methods/defaults.yaml)")
  args = parser.parse_args(argv)

  def run():
    if args.resume:
      return resume_table(args.resume, **cli.resume_kwargs(args))
    config = cli.config_from_args(parser, args)
    return run_table(config, args.methods, args.seeds, args.rounds, cli.last_from_args(args),
                     select=args.select, defaults=methods.method_defaults(args.method_config),
                     **cli.run_kwargs(args, nonfinite="skip"))

  cli.guarded(parser, run, "interrupted; finished methods (and the running one's last "
                           "checkpoint, if one was written) are kept: continue with --resume on "
                           "the output folder")

if __name__ == "__main__":
  main()
