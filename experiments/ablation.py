r"""FedAvg, FedAvg+IM and FedAvg+IM+CAM (FedIA) per setting: the paper's Table 6.

  python experiments/ablation.py --dataset twitch --settings s1,s3 --seeds 0,1,2
  python experiments/ablation.py --dataset wikinet --aggregators fedia,gma,fedheal

One compiled sweep per setting runs the three aggregations for all seeds, at
FedAvg's (rho, beta) from configs/methods/defaults.yaml (the paper's Table 7).
A run that does not converge (NaN accuracy, or one class predicted on every
domain through the final rounds) is reported as NC instead of a number.
Writes table.md, table.csv, table.tex, table.png, config.json and
runs/<setting>.npz into --out; an interrupted run continues with --resume DIR.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import cli, methods  # noqa: E402
from fedjax_graph.comparison import (AGGREGATORS, resume_ablation, run_ablation,  # noqa: E402
                                     unmatched_setting_note)
from fedjax_graph.rundir import default_out_dir  # noqa: E402


def main(argv=None):
  parser = cli.sweep_parser(__doc__)
  parser.add_argument("--settings", type=cli.str_list, default=None,
                      help="comma list of presets of --dataset (default: s1,s3 for twitch, "
                           "default for wikinet; --setting X alone means X)")
  parser.add_argument("--aggregators", type=cli.str_list, default="fedia",
                      help="comma list holding fedia; each other server rule (from "
                           f"{', '.join(a for a in AGGREGATORS if a != 'fedia')}) adds a row "
                           "FedAvg+<rule> to each setting (default: %(default)s)")
  cli.add_method_config_flag(parser, "FedAvg's (rho, beta) per setting",
                             "fedia: {twitch: {s1: {fedavg: [0.5, 0.5]}}}")
  args = cli.parse_args(parser, argv)

  def run():
    if args.resume:
      return resume_ablation(args.resume, **cli.resume_kwargs(args))
    if args.config is not None:
      if args.settings:
        parser.error("--settings names presets; with --config FILE the file is the one setting")
      args.settings = [None]
    elif args.dataset is None:
      parser.error("--dataset or --config FILE is required (unless --resume DIR)")
    elif args.settings is None:
      args.settings = ([args.setting] if args.setting
                       else ["s1", "s3"] if args.dataset == "twitch" else ["default"])
    elif args.setting and args.setting not in args.settings:
      parser.error(f"--setting {args.setting} is not in --settings {','.join(args.settings)}; "
                   "give one of the two")
    if not args.settings or len(set(args.settings)) != len(args.settings):
      parser.error(f"settings = {args.settings}; give at least one, without repeats")
    configs = [cli.config_from_args(parser, args, s) for s in args.settings]
    args.out = args.out or default_out_dir(configs[0], "ablation")  # so that Ctrl-C can name it
    defaults = methods.method_defaults(args.method_config)
    for config in configs:
      note = unmatched_setting_note(defaults, config.dataset, config.setting)
      if note:
        print(f"note: {note}", file=sys.stderr)
    return run_ablation(configs, args.seeds, args.rounds, cli.last_from_args(args), defaults,
                        cli.run_controls(args, nonfinite="skip"), aggregators=args.aggregators)

  cli.guarded(parser, run, args)

if __name__ == "__main__":
  main()
