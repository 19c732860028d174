"""FedAvg vs FedAvg+<aggregator> over a grid of its hyper-parameters, as one compiled program.

  python experiments/grid.py --dataset wikinet
  python experiments/grid.py --dataset twitch --setting s3 --seeds 0,1,2
  python experiments/grid.py --dataset wikinet --aggregator gma --tau 0.1,0.3,0.5

The aggregator (default fedia) runs at every combination of its
hyper-parameters' values (default for each: 0.1,0.3,0.5,0.7,0.9, the FedIA
paper's search space), next to one FedAvg cell, all seeds in one batch.

Writes config.json, history.npz, summary.csv, heatmap.png and curves.png into
--out (default results/<dataset>-<setting>-<timestamp>/). The simulation state
is checkpointed every chunk; an interrupted run continues with

  python experiments/grid.py --resume results/<run>
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import aggregators, cli  # noqa: E402
from fedjax_graph.comparison import GRID  # noqa: E402
from fedjax_graph.experiment import resume_grid, run_grid  # noqa: E402
from fedjax_graph.rundir import default_out_dir  # noqa: E402


def main(argv=None):
  parser = cli.sweep_parser(__doc__)
  names = [n for n in aggregators.REGISTRY if n != "fedavg"]
  parser.add_argument("--aggregator", default="fedia", choices=names,
                      help="the server rule compared with FedAvg (default: %(default)s)")
  hparams = {}  # every hyper-parameter of any aggregator, and whose it is
  for name in names:
    for hparam in aggregators.get(name).hparams:
      hparams.setdefault(hparam, []).append(name)
  for hparam, owners in hparams.items():
    parser.add_argument(f"--{hparam}", type=cli.float_list, default=None,
                        help=f"comma list of values of {hparam} ({', '.join(owners)}; default: "
                             f"{','.join(f'{v:g}' for v in GRID)})")
  args = cli.parse_args(parser, argv)

  def run():
    if args.resume:
      return resume_grid(args.resume, **cli.resume_kwargs(args))
    config = cli.config_from_args(parser, args)
    args.out = args.out or default_out_dir(config)  # so that Ctrl-C can name it
    own = aggregators.get(args.aggregator).hparams
    foreign = [f"--{h}" for h in hparams if getattr(args, h) is not None and h not in own]
    if foreign:
      parser.error(f"{', '.join(foreign)}: not a hyper-parameter of --aggregator "
                   f"{args.aggregator}, whose are {', '.join(own) or 'none'}")
    grid = {h: getattr(args, h) or list(GRID) for h in own}
    return run_grid(config, args.aggregator, grid, args.seeds, args.rounds,
                    cli.last_from_args(args), cli.run_controls(args, nonfinite="error"))

  cli.guarded(parser, run, args)

if __name__ == "__main__":
  main()
