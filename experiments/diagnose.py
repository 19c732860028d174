"""The dissection of client updates (FedIA paper, Sec. 3.2, Figures 2-5) on any preset.

  python experiments/diagnose.py --dataset wikinet --backbones pmlp_gcn,mlp,gcn \\
      --aggregators fedavg,fedia --checkpoints 1,50,100,200

Runs each backbone with the aggregators side by side (one compiled program per
backbone), computing inside the jitted rounds, at the checkpoint rounds: the
salient-update overlap (GSI, eq. 2), signed cosines between clients and with
the FedAvg aggregate, signal dilution (eqs. 3-4) and salient-coordinate
retention; then the domain discrepancies on the host. Writes figures, CSVs of
every plotted number, diagnostics.npz and headline.json into --out.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fedjax_graph import cli  # noqa: E402
from fedjax_graph.dissection import run_diagnose  # noqa: E402


def main(argv=None):
  parser = cli.Parser(__doc__)
  cli.add_federation_flags(parser, resumable=False)
  parser.add_argument("--backbones", type=cli.str_list, default="pmlp_gcn,mlp,gcn",
                      help="comma list of backbones (default: %(default)s)")
  parser.add_argument("--aggregators", type=cli.str_list, default="fedavg,fedia",
                      help="comma list from fedavg, fedia (default: %(default)s)")
  parser.add_argument("--checkpoints", type=cli.int_list, default=None,
                      help="1-based rounds at which to take the diagnostics, in [1, rounds] "
                           "(default: 1, rounds/4, rounds/2, rounds: 1,50,100,200 for 200)")
  parser.add_argument("--top", type=float, default=0.05,
                      help="salient share p of each client's coordinates, in (0, 1) "
                           "(default: %(default)s)")
  parser.add_argument("--rho", type=float, default=0.5, help="FedIA mask ratio (default: 0.5)")
  parser.add_argument("--beta", type=float, default=0.5, help="FedIA momentum (default: 0.5)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="output folder (default: results/<dataset>-<setting>-diagnose-<time>)")
  args = parser.parse_args(argv)
  if args.dataset is None:
    parser.error("--dataset is required")
  checkpoints = args.checkpoints or sorted({1, max(1, args.rounds // 4), max(1, args.rounds // 2),
                                            max(1, args.rounds)})
  try:
    headline = run_diagnose(args.dataset, args.setting, args.backbones, args.aggregators,
                            checkpoints, args.rounds, args.seeds, top=args.top, rho=args.rho,
                            beta=args.beta, out_dir=args.out, raw_dir=args.raw_dir,
                            cache_dir=args.cache_dir, chunk=args.chunk,
                            progress=not args.no_progress, overwrite=args.overwrite,
                            verify=not args.no_verify)
  except ValueError as err:
    parser.error(str(err))
  except OSError as err:  # Missing files, no network, bad paths.
    sys.exit(f"error: {err}")
  print(json.dumps(headline, indent=2, default=float))


if __name__ == "__main__":
  main()
