"""FedAvg vs FedAvg+FedIA over a rho x beta grid, as one compiled program.

  python experiments/grid.py --dataset wikinet
  python experiments/grid.py --dataset twitch --setting s3 --seeds 0,1,2

Writes config.json, history.npz, summary.csv, heatmap.png and curves.png into
--out (default results/<dataset>-<setting>-<timestamp>/). The simulation state
is checkpointed every chunk; an interrupted run continues with

  python experiments/grid.py --resume results/<run>
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import cli  # noqa: E402
from fedjax_graph.experiment import resume_grid, run_grid  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_federation_flags(parser)
  cli.add_sweep_flags(parser)
  parser.add_argument("--rho", type=cli.float_list, default="0.1,0.3,0.5,0.7,0.9",
                      help="FedIA mask ratios, comma list in (0, 1] (default: %(default)s)")
  parser.add_argument("--beta", type=cli.float_list, default="0.1,0.3,0.5,0.7,0.9",
                      help="FedIA momentum factors, comma list in [0, 1] (default: %(default)s)")
  cli.add_output_flags(parser)
  args = parser.parse_args(argv)

  def run():
    if args.resume:
      return resume_grid(args.resume, **cli.resume_kwargs(args))
    config = cli.config_from_args(parser, args)
    return run_grid(config, args.rho, args.beta, args.seeds, args.rounds,
                    cli.last_from_args(args), **cli.run_kwargs(args, nonfinite="error"))

  cli.guarded(parser, run, "interrupted; the run's last checkpoint is kept: continue it with "
                           "--resume DIR")

if __name__ == "__main__":
  main()
