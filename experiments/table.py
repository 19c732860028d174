r"""Base methods alone and "+FedIA": the paper-style comparison table (FedIA paper, Tables 2-5).

  python experiments/table.py --dataset twitch --setting s3 --seeds 0,1,2 \
      --methods fedavg,fedprox,moon,feddyn,fedopt,scaffold,majority,local,centralized
  python experiments/table.py --dataset wikinet --seeds 0,1,2 --select val --methods fedavg

Each method runs with all seeds in one compiled program, its own aggregation
next to its "+FedIA" cell. (rho, beta) come from configs/methods/defaults.yaml
(the paper's Table 7 for Twitch, 0.5/0.5 otherwise) or, with --select val,
from the best validation AVG over the 5x5 grid. Writes table.md, table.csv,
table.tex, table.png, config.json and runs/<method>.npz into --out. An
interrupted table continues with --resume DIR; --rows-so-far DIR reads the
methods it has finished (while it runs, too) into DIR/partial.md, .csv, .tex.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import cli, methods, references  # noqa: E402
from fedjax_graph.comparison import (AGGREGATORS, SELECTIONS, check_methods,  # noqa: E402
                                     finished_rows, recipe_overrides, resume_table, run_table,
                                     unmatched_setting_note)
from fedjax_graph.rundir import default_out_dir  # noqa: E402


def main(argv=None):
  parser = cli.sweep_parser(__doc__)
  every = list(methods.METHODS) + list(references.REFERENCES)
  parser.add_argument("--methods", type=cli.str_list, default=",".join(every),
                      help="comma list of base methods from " + ", ".join(methods.METHODS)
                           + " and reference rows from " + ", ".join(references.REFERENCES)
                           + " (majority class, local training alone, centralised training; "
                             "no +FedIA)"
                           + " (default: all)")
  parser.add_argument("--aggregators", type=cli.str_list, default="fedia",
                      help="comma list of server rules, each replacing every method's own "
                           f"averaging in a row of its own, from {', '.join(AGGREGATORS)} "
                           "(default: %(default)s, the paper's +FedIA)")
  parser.add_argument("--select", choices=SELECTIONS, default="fixed",
                      help="each aggregator's hyper-parameters: fixed (from --method-config) or "
                           "val (best validation AVG over its grid, each hyper-parameter over "
                           "0.1,...,0.9, in the method's one sweep) (default: %(default)s)")
  cli.add_method_config_flag(parser, "each method's hyper-parameters, FedIA's (rho, beta) "
                                     "and the other aggregators'", "hparams: {fgssl: {loss: code}}")
  parser.add_argument("--rows-so-far", type=pathlib.Path, default=None, metavar="DIR",
                      help="print the rows of the methods finished so far in the table run in "
                           "DIR (running or interrupted) and write them to DIR/partial.md, .csv "
                           "and .tex; no data is read and nothing trains (no other flag "
                           "applies)")
  args = cli.parse_args(parser, argv)
  if args.rows_so_far is not None:
    extra = [f for f in cli.given_flags(parser, argv) if f != "--rows-so-far"]
    if extra:
      parser.error(f"{', '.join(extra)}: not applicable to --rows-so-far, which only reads DIR")

  def run():
    if args.rows_so_far is not None:
      return finished_rows(args.rows_so_far)
    if args.resume:
      return resume_table(args.resume, **cli.resume_kwargs(args))
    config = cli.config_from_args(parser, args)
    args.out = args.out or default_out_dir(config, "table")  # so that Ctrl-C can name it
    defaults = methods.method_defaults(args.method_config)
    check_methods(args.methods, args.aggregators, config, defaults)  # before any note on them
    notes = recipe_overrides(args.methods, config, defaults, cli.preset_overrides(args))
    for line in notes + [unmatched_setting_note(defaults, config.dataset, config.setting)]:
      if line:
        print(f"note: {line}", file=sys.stderr)
    return run_table(config, args.methods, args.seeds, args.rounds, cli.last_from_args(args),
                     args.select, args.aggregators, defaults,
                     cli.run_controls(args, nonfinite="skip"))

  cli.guarded(parser, run, args)

if __name__ == "__main__":
  main()
