"""Command-line flags shared by the scripts in ``experiments/``."""

import argparse
import pathlib
import sys
from typing import Callable

from fedjax_graph.config import Config, load_preset
from fedjax_graph.models import BACKBONES, NORMS


def float_list(text: str) -> list[float]:
  """'0.1,0.3' -> [0.1, 0.3]; argparse reports a ValueError as a usage error."""
  try:
    return [float(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}")


def int_list(text: str) -> list[int]:
  """'0,1,2' -> [0, 1, 2]."""
  try:
    return [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")


def add_federation_flags(parser: argparse.ArgumentParser) -> None:
  """Dataset, preset, rounds, seeds, data locations and run controls."""
  parser.add_argument("--dataset", choices=["twitch", "wikinet"],
                      help="MUSAE dataset: twitch (6 countries) or wikinet (3 wikis); required "
                           "unless resuming")
  parser.add_argument("--setting", default=None,
                      help="preset in configs/: s1, s2, s3 for twitch (default s1); "
                           "default for wikinet")
  parser.add_argument("--rounds", type=int, default=200, help="rounds T (default: %(default)s)")
  parser.add_argument("--seeds", type=int_list, default="0",
                      help="comma list of seeds, run together in one batch (default: %(default)s)")
  parser.add_argument("--raw-dir", type=pathlib.Path, default=None,
                      help="raw MUSAE files in the SNAP layout (default: $FEDJAX_GRAPH_RAW, "
                           "else the cache, else download from SNAP)")
  parser.add_argument("--cache-dir", type=pathlib.Path, default=None,
                      help="prepared-data cache (default: $FEDJAX_GRAPH_CACHE or "
                           "~/.cache/fedjax_graph)")
  parser.add_argument("--no-verify", action="store_true",
                      help="accept raw files that differ from the SNAP release (edited or custom "
                           "data; they are still validated)")
  parser.add_argument("--chunk", type=int, default=10,
                      help="rounds per compiled call; progress updates per chunk "
                           "(default: %(default)s)")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a finished (or unfinished) run in --out")


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
  """Backbone, non-finite policy, checkpoints and resume, for long sweeps."""
  parser.add_argument("--backbone", default=None, choices=sorted(BACKBONES),
                      help="model (default: the preset's, pmlp_gcn)")
  parser.add_argument("--norm", default=None, choices=list(NORMS),
                      help="normalisation after each hidden layer: batch (batch norm with the "
                           "statistics of the graph processed, PMLP's reference) or none "
                           "(default: the preset's, batch)")
  parser.add_argument("--nonfinite", choices=["error", "skip"], default=None,
                      help="a client update with NaN/Inf is always kept out of the global model; "
                           "error: stop and name it, skip: go on and count it (default: error "
                           "for grid.py, skip for table.py and ablation.py, whose tables report "
                           "it; with --resume, the run's own)")
  parser.add_argument("--checkpoint-every", type=int, default=1,
                      help="chunks between checkpoints of the whole simulation state "
                           "(default: %(default)s)")
  parser.add_argument("--participation", type=float, default=None,
                      help="share of clients sampled each round, in (0, 1] (default: the "
                           "preset's, 1 = all)")
  parser.add_argument("--resume", type=pathlib.Path, default=None, metavar="DIR",
                      help="continue the interrupted run in DIR with its own config.json "
                           "(only --raw-dir, --cache-dir, --no-progress, --no-verify and "
                           "--nonfinite apply; other flags are ignored)")


def str_list(text: str) -> list[str]:
  """'fedavg,fedprox' -> ['fedavg', 'fedprox']."""
  return [v.strip() for v in text.split(",") if v.strip()]


def add_output_flags(parser: argparse.ArgumentParser) -> None:
  """--last and --out, as grid.py has them."""
  parser.add_argument("--last", type=int, default=None,
                      help="final rounds averaged per seed (default: 20, or all rounds when "
                           "fewer)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="output folder (default: results/<dataset>-<setting>-...-<timestamp>)")


def last_from_args(args) -> int:
  return min(20, args.rounds) if args.last is None else args.last


def config_from_args(parser: argparse.ArgumentParser, args) -> Config:
  """The preset named by the flags, or a usage error naming the bad value."""
  if args.dataset is None:
    parser.error("--dataset is required (unless --resume DIR)")
  try:
    return load_preset(args.dataset, args.setting, **preset_overrides(args))
  except ValueError as err:
    parser.error(str(err))


def preset_overrides(args) -> dict:
  """The preset fields the sweep flags set (None: keep the preset's)."""
  return dict(backbone=args.backbone, norm=args.norm, participation=args.participation)


def resume_kwargs(args) -> dict:
  """The flags that still apply when a script resumes a run (``resume_*`` keyword arguments)."""
  return dict(raw_dir=args.raw_dir, cache_dir=args.cache_dir, progress=not args.no_progress,
              verify=not args.no_verify, nonfinite=args.nonfinite)


def run_kwargs(args, nonfinite: str) -> dict:
  """Data locations and run controls shared by ``run_grid``, ``run_table`` and ``run_ablation``.

  ``nonfinite`` is the script's default policy when ``--nonfinite`` is not given.
  """
  return dict(out_dir=args.out, raw_dir=args.raw_dir, cache_dir=args.cache_dir, chunk=args.chunk,
              progress=not args.no_progress, nonfinite=args.nonfinite or nonfinite,
              checkpoint_every=args.checkpoint_every, overwrite=args.overwrite,
              verify=not args.no_verify)


def guarded(parser: argparse.ArgumentParser, run: Callable[[], object], interrupted: str) -> None:
  """Runs a script's body: a bad value is a usage error, a failure or Ctrl-C one line, no traceback."""
  from fedjax_graph.sweep import NonFiniteUpdateError  # the sweep's import cost only here

  try:
    run()
  except ValueError as err:
    parser.error(str(err))
  except (OSError, NonFiniteUpdateError) as err:  # Missing files, no network, bad paths.
    sys.exit(f"error: {err}")
  except KeyboardInterrupt:
    sys.exit(interrupted)
