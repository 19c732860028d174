"""Command-line flags shared by the scripts in ``experiments/``."""

import argparse
import json
import logging
import os
import pathlib
import re
import sys
from typing import Any, Callable, Optional

from data_prep.registry import DATASETS
from fedjax_graph.config import FIELDS, Config, load_config, load_preset, parse_override
from fedjax_graph.controls import OverBudgetError, RunControls, parse_size
from fedjax_graph.models import BACKBONES, NORMS

RESUME_FLAGS = ("--raw-dir", "--cache-dir", "--no-progress", "--no-verify", "--nonfinite",
                "--devices", "--max-memory")
"""The flags that still apply with ``--resume DIR`` (none changes the results, but for float
rounding across device layouts); the run's config.json fixes the rest."""
SHORTCUTS = ("backbone", "norm", "participation")
"""Config fields with a flag of their own (``--backbone X`` is ``--set backbone=X``)."""


def _comma_list(text: str, convert: Callable[[str], Any], what: str) -> list:
  items = [v.strip() for v in text.split(",")]
  if "" in items:  # '0.1,,0.3' or a trailing comma: a typo, not a shorter list.
    raise argparse.ArgumentTypeError(f"empty item in {text!r}; expected a comma list of {what}")
  try:
    return [convert(v) for v in items]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}") from None


def float_list(text: str) -> list[float]:
  """'0.1,0.3' -> [0.1, 0.3]; an empty item or a non-number is a usage error naming ``text``."""
  return _comma_list(text, float, "numbers")


def int_list(text: str) -> list[int]:
  """'0,1,2' -> [0, 1, 2]; an empty item or a non-integer is a usage error naming ``text``."""
  return _comma_list(text, int, "integers")


def str_list(text: str) -> list[str]:
  """'fedavg,fedprox' -> ['fedavg', 'fedprox']; an empty item is a usage error naming ``text``."""
  return _comma_list(text, str, "names")


def override(text: str) -> tuple[str, Any]:
  """``--set key=value`` -> ``(key, value)`` (``config.parse_override``), or a usage error."""
  try:
    return parse_override(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


def memory_size(text: str) -> int:
  """'8G' -> bytes (``controls.parse_size``), or a usage error naming ``text``."""
  try:
    return parse_size(text)
  except ValueError as err:
    raise argparse.ArgumentTypeError(str(err)) from None


def add_federation_flags(parser: argparse.ArgumentParser, resumable: bool = True) -> None:
  """Dataset, preset, rounds, seeds, data locations and run controls.

  ``resumable``: the script also takes ``--config FILE`` and ``--resume DIR``.
  """
  parser.add_argument("--dataset", choices=list(DATASETS),
                      help="MUSAE dataset: twitch (6 countries) or wikinet (3 wikis); required" +
                           (" unless --config FILE or --resume DIR" if resumable else ""))
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


def add_config_flags(parser: argparse.ArgumentParser) -> None:
  """--config FILE and --set KEY=VALUE: a user's own config, instead of or over a preset."""
  parser.add_argument("--config", type=pathlib.Path, default=None, metavar="FILE",
                      help="a config file anywhere, with the fields of configs/*.yaml (dataset, "
                           "clients_per_domain and split required; setting defaults to the "
                           "file's name), instead of --dataset/--setting")
  parser.add_argument("--set", type=override, action="append", default=[], dest="overrides",
                      metavar="KEY=VALUE",
                      help="set one config field over the preset or --config FILE, repeatable; "
                           "VALUE is YAML, e.g. --set lr=0.01 --set weight_decay=1e-4 --set "
                           "'clients_per_domain={DE: 4, EN: 2, ES: 2, FR: 2, PT: 2, RU: 2}'; "
                           "fields: " + ", ".join(FIELDS))


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
  """Config file and overrides, backbone, non-finite policy, checkpoints and resume."""
  add_config_flags(parser)
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
                      help="share of clients sampled each round, in (0, 1]; only they train "
                           "(default: the preset's, 1 = all)")
  parser.add_argument("--eval-every", type=int, default=1, metavar="K",
                      help="evaluate the global model every K rounds and in each of the --last "
                           "rounds; other rounds hold NaN in the histories (default: "
                           "%(default)s, every round)")
  parser.add_argument("--devices", type=int, default=None, metavar="N",
                      help="split each batch of runs (seeds x cells) over the first N devices "
                           "(default, also with --resume: all); results equal one device's up to "
                           "float rounding")
  parser.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                      help="device memory a batch may take per device, e.g. 8G or 512M (binary "
                           "multiples); a batch estimated over it runs in equal sub-batches, one "
                           "after another (default: 80%% of a device's memory, on CPU of the "
                           "host's RAM shared by its devices; with --resume: the run's own)")
  parser.add_argument("--resume", type=pathlib.Path, default=None, metavar="DIR",
                      help="continue the interrupted run in DIR with its own config.json "
                           f"(only {', '.join(RESUME_FLAGS)} apply; any other flag is a usage "
                           "error)")


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
  """``parser.parse_args``; with ``--resume DIR``, a flag that does not apply is a usage error."""
  args = parser.parse_args(argv)
  if getattr(args, "resume", None) is not None:
    extra = [flag for flag in given_flags(parser, argv)
             if flag not in RESUME_FLAGS + ("--resume",)]
    if extra:
      parser.error(f"{', '.join(extra)}: not applicable to --resume, which continues the run "
                   f"with its own config.json; only {', '.join(RESUME_FLAGS)} apply")
  return args


def given_flags(parser: argparse.ArgumentParser, argv=None) -> list[str]:
  """The options ``argv`` gives (long names), even those given their default value."""
  defaults = [(action, action.default) for action in parser._actions]
  try:
    # With SUPPRESS as the default, only the flags given end up in the namespace.
    for action, _ in defaults:
      action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
  finally:
    for action, default in defaults:
      action.default = default
  return [max(action.option_strings, key=len) for action in parser._actions
          if action.option_strings and action.dest in given]


class Parser(argparse.ArgumentParser):
  """A script's parser: its usage errors are two lines, not the whole usage block."""

  def __init__(self, description: str):
    super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists the flags\n")


def sweep_parser(description: str) -> argparse.ArgumentParser:
  """A script's parser with the federation, sweep and output flags (grid, table, ablation)."""
  parser = Parser(description)
  add_federation_flags(parser)
  add_sweep_flags(parser)
  add_output_flags(parser)
  return parser


def add_method_config_flag(parser: argparse.ArgumentParser, what: str, example: str) -> None:
  """--method-config FILE: the YAML of methods' and aggregators' hyper-parameters (table, ablation).

  ``what``: what the script reads from it; ``example``: a one-value change, as YAML.
  """
  from fedjax_graph.methods import METHODS_FILE  # the methods' import cost only here

  parser.add_argument("--method-config", type=pathlib.Path, default=METHODS_FILE,
                      help=f"YAML with {what}; its entries replace those of "
                           f"configs/methods/defaults.yaml key by key (e.g. '{example}' "
                           "changes one value)")


def add_output_flags(parser: argparse.ArgumentParser) -> None:
  """--last and --out, as grid.py has them."""
  parser.add_argument("--last", type=int, default=None,
                      help="final rounds averaged per seed (default: 20, or all rounds when "
                           "fewer)")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="output folder (default: results/<dataset>-<setting>-...-<timestamp>)")


def last_from_args(args) -> int:
  return min(20, args.rounds) if args.last is None else args.last


def config_from_args(parser: argparse.ArgumentParser, args,
                     setting: Optional[str] = None) -> Config:
  """The config the flags choose, or a usage error naming the bad value.

  Args:
    parser: the script's parser, for usage errors.
    args: its flags: ``--config FILE`` or the preset ``--dataset``/``--setting``,
      with the shortcut flags and every ``--set`` over it (``preset_overrides``).
    setting: a preset to take instead of ``--setting`` (ablation.py's ``--settings``).
  """
  try:
    fields = _flag_fields(args)
  except ValueError as err:
    parser.error(str(err))
  overrides = {key: value for key, (value, _) in fields.items()}
  try:
    if args.config is not None:
      if args.dataset or args.setting:
        parser.error("give --config FILE or --dataset/--setting, not both")
      try:
        return load_config(args.config, **overrides)
      except OSError as err:
        parser.error(f"--config {args.config}: {err.strerror or err}")
    if args.dataset is None:
      parser.error("--dataset or --config FILE is required (unless --resume DIR)")
    return load_preset(args.dataset, setting or args.setting, **overrides)
  except ValueError as err:
    parser.error(_naming_flags(str(err), fields))


def _naming_flags(message: str, fields: dict) -> str:
  """``message`` with the flags that set the fields it faults: ``lr = -1.0; ... (--set lr=...)``.

  ``fields``: ``_flag_fields``'s ``{field: (value, flag)}``.
  """
  flags = [flag for key, (_, flag) in fields.items() if re.search(rf"(^|; ){key}( =|\[)", message)]
  return f"{message} ({', '.join(flags)})" if flags else message


def _flag_fields(args) -> dict:
  """``{field: (value, flag)}`` for each config field a flag sets, in the flags' order.

  Raises:
    ValueError: a field set twice (by its shortcut and ``--set``, or by two ``--set``).
  """
  fields = {name: (getattr(args, name), f"--{name}") for name in SHORTCUTS
            if getattr(args, name, None) is not None}
  for key, value in getattr(args, "overrides", []):
    if key in ("dataset", "setting"):
      raise ValueError(f"--set {key}=... cannot change the {key}: choose it with --{key}, "
                       "or in the file of --config FILE")
    if key in fields:
      raise ValueError(f"{key} is set twice ({fields[key][1]} and --set {key}=...); give it once")
    fields[key] = (value, f"--set {key}=...")
  return fields


def preset_overrides(args) -> dict:
  """The config fields the flags set: the shortcuts (``SHORTCUTS``) and each ``--set``.

  Raises:
    ValueError: a field set twice (by its shortcut and ``--set``, or by two ``--set``).
  """
  return {key: value for key, (value, _) in _flag_fields(args).items()}


def resume_kwargs(args) -> dict:
  """The flags that still apply when a script resumes a run (``resume_*`` keyword arguments)."""
  return dict(controls=RunControls(raw_dir=args.raw_dir, cache_dir=args.cache_dir,
                                   progress=not args.no_progress, verify=not args.no_verify,
                                   devices=args.devices, max_memory=args.max_memory),
              nonfinite=args.nonfinite)


def run_controls(args, nonfinite: str) -> RunControls:
  """The run controls the flags give ``run_grid``, ``run_table`` and ``run_ablation``.

  ``nonfinite`` is the script's default policy when ``--nonfinite`` is not given.

  Raises:
    ValueError: for a chunk, checkpoint or evaluation interval, device count or memory
      size < 1.
  """
  return RunControls(out_dir=args.out, raw_dir=args.raw_dir, cache_dir=args.cache_dir,
                     verify=not args.no_verify, chunk=args.chunk, progress=not args.no_progress,
                     nonfinite=args.nonfinite or nonfinite,
                     checkpoint_every=args.checkpoint_every, overwrite=args.overwrite,
                     eval_every=args.eval_every, devices=args.devices,
                     max_memory=args.max_memory)


def guarded(parser: argparse.ArgumentParser, run: Callable[[], object],
            args: argparse.Namespace) -> None:
  """Runs a script's body: a bad value is a usage error, a failure or Ctrl-C one line, no traceback.

  Args:
    parser: the script's parser, for usage errors.
    run: the script's body.
    args: its flags; on Ctrl-C, ``args.resume`` or ``args.out`` (which ``run``
      sets once it knows the run's folder) is the folder ``interrupted`` describes.
  """
  from fedjax_graph.sweep import NonFiniteUpdateError  # the sweep's import cost only here

  data_log = logging.getLogger("data_prep")  # preparing, downloading, rebuilding, and why
  if not any(isinstance(h, _Stderr) for h in data_log.handlers):
    data_log.addHandler(_Stderr())
    data_log.setLevel(logging.INFO)
  try:
    run()
  except OverBudgetError as err:  # not a usage error: the flags were fine, the machine small
    sys.exit(f"error: {err}")
  except ValueError as err:
    parser.error(str(err))
  except (OSError, NonFiniteUpdateError) as err:  # Missing files, no network, bad paths.
    sys.exit(f"error: {err}")
  except KeyboardInterrupt:
    print(interrupted(args.resume or args.out, _script(parser)), file=sys.stderr)
    exit_now(INTERRUPTED)


INTERRUPTED = 130
"""The exit status of a run stopped by Ctrl-C: the shell's for SIGINT (128 + 2)."""


def exit_now(status: int) -> None:
  """Ends the process at once (``os._exit``), without the interpreter's teardown.

  Ctrl-C can stop Python while XLA still runs a dispatched computation on its
  own threads, and tearing the interpreter down under it segfaults. What a
  stopped run must leave (config.json's status, checkpoints, the released
  folder lock) was written by the ``finally`` blocks the interrupt passed.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


class _Stderr(logging.Handler):
  """Writes each record's message to the sys.stderr of the moment (a test's capture too)."""

  def emit(self, record):
    print(record.getMessage(), file=sys.stderr)


def _script(parser: argparse.ArgumentParser) -> str:
  """The path the script was started by (``experiments/table.py``), for a command to copy."""
  started = pathlib.Path(sys.argv[0])
  return str(started) if started.name == parser.prog else f"experiments/{parser.prog}"


def interrupted(out_dir: Optional[pathlib.Path], script: str) -> str:
  """The line for a run stopped by Ctrl-C: what ``out_dir`` kept and the command that goes on.

  ``script``: the script's path as the user would type it (``experiments/table.py``).
  """
  if out_dir is None:
    return "interrupted before the run chose its output folder; nothing was saved"
  out_dir = pathlib.Path(out_dir)
  try:
    status = json.loads((out_dir / "config.json").read_text()).get("status")
  except (OSError, ValueError):
    status = None
  if status == "finished":  # Stopped before --overwrite removed anything.
    return f"interrupted; {out_dir} still holds the finished run it held"
  # A grid's checkpoint.msgpack; a table's finished runs/<name>.npz and checkpoint-<name>.msgpack.
  kept = sorted(path.relative_to(out_dir).as_posix()
                for pattern in ("checkpoint*.msgpack", "runs/*.npz")
                for path in out_dir.glob(pattern))
  if kept:
    return (f"interrupted; {out_dir} keeps {', '.join(kept)}: continue with "
            f"python {script} --resume {out_dir}")
  if status is not None:
    return (f"interrupted before the first checkpoint: no round was saved; python {script} "
            f"--resume {out_dir} starts the run again from round 1 with its config.json")
  return f"interrupted before anything was written to {out_dir}; nothing was saved"
