"""Run folders: where results go, what a folder holds, and how a run is resumed.

Every experiment (grid, table, ablation, dissection) writes into one output
folder: a ``config.json`` (its setup, provenance and status), its results and,
while it runs, checkpoints. These helpers refuse to clobber a run, remove only
a tool's own files, check a run's length and seeds before anything is
written, and give a resumed run its own controls back.
"""

import contextlib
import datetime
import importlib.metadata
import json
import os
import pathlib
import socket
import subprocess
from typing import Mapping, Optional, Sequence

try:
  import fcntl
except ImportError:  # not POSIX: runs are not locked (``claimed``)
  fcntl = None

from fedjax_graph.config import Config
from fedjax_graph.controls import OverBudgetError, RunControls
from fedjax_graph.io import is_writer, remove_file

TOOLS = {"grid": "grid.py", "methods": "table.py", "ablation": "ablation.py"}
"""The key only each tool's config.json holds -> the tool."""

PACKAGES = ("jax", "jaxlib", "flax", "optax", "jraph", "numpy", "scipy")


def default_out_dir(config: Config, kind: str = "") -> pathlib.Path:
  """``results/<dataset>-<setting>[-<kind>]-<timestamp>``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  name = "-".join(part for part in (config.dataset, config.setting, kind, stamp) if part)
  return pathlib.Path("results") / name


def provenance() -> dict:
  """Package versions, the git commit and the writing process (host, pid), for config.json."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = None
  return {"packages": versions, "git_commit": commit,
          "writer": {"host": socket.gethostname(), "pid": os.getpid()}}


LOCK = ".lock"
_CLAIMED: set = set()  # folders this process holds (resolved paths)


@contextlib.contextmanager
def claimed(out_dir: pathlib.Path, resume: bool = False):
  """Holds ``out_dir`` for this process while the body runs; another process is refused.

  An exclusive ``flock`` on ``<out_dir>/.lock``, taken before the folder's
  run is checked (``prepare_out_dir``) and released, the file removed, when
  the body ends: two commands given the same ``--out`` cannot both pass the
  checks and then overwrite each other's checkpoints and results. The
  operating system drops the lock of a process that dies (kill -9, power
  loss), so a stopped run never blocks its ``--resume``. Re-entrant within a
  process. A folder this creates and leaves empty is removed again, so a
  run refused before writing anything leaves nothing behind. Only the
  writing process claims (``io.is_writer``); without ``fcntl`` (not POSIX)
  nothing is locked.

  Raises:
    ValueError: another live process holds the folder (its pid named, from
      the ``writer`` of its config.json where there is one); the advice it
      ends with is for a ``--resume`` when ``resume``, else for a new run.
  """
  key = out_dir.resolve()
  if fcntl is None or not is_writer() or key in _CLAIMED:
    yield
    return
  created = not out_dir.exists()
  out_dir.mkdir(parents=True, exist_ok=True)
  fd = _lock(out_dir / LOCK, resume)
  _CLAIMED.add(key)
  try:
    yield
  finally:
    _CLAIMED.discard(key)
    (out_dir / LOCK).unlink(missing_ok=True)  # before the unlock: a waiting open retries
    os.close(fd)
    if created:
      with contextlib.suppress(OSError):  # not empty (the run wrote), or gone
        out_dir.rmdir()


def _lock(path: pathlib.Path, resume: bool) -> int:
  """An open descriptor of ``path`` holding its exclusive lock (see ``claimed``)."""
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      advice = ("wait for it to end, or stop it and then resume" if resume
                else "wait for it to end or stop it, or choose another --out")
      raise ValueError(f"{path.parent} is being written by another run{_writer(path.parent)}; "
                       f"{advice}") from None
    try:
      current = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      current = False
    if current:
      return fd
    os.close(fd)  # locked a file its holder had just removed: lock the new one


def _writer(out_dir: pathlib.Path) -> str:
  """`` (pid N, ...)`` from a config.json that says ``running``: not an earlier, ended run's."""
  try:
    record = json.loads((out_dir / "config.json").read_text())
    pid = record["writer"]["pid"] if record["status"] == "running" else None
  except (OSError, ValueError, KeyError, TypeError):
    pid = None
  return "" if pid is None else f" (pid {pid}, says its config.json)"


CHECKPOINT = "checkpoint.msgpack"


def prepare_out_dir(out_dir: pathlib.Path, resume: bool, overwrite: bool,
                    finished_marker: str = "summary.csv", resumable: bool = True,
                    record_key: Optional[str] = None) -> None:
  """Refuses to clobber a run: a finished one needs ``overwrite``, an unfinished one ``resume``.

  With ``record_key`` (the key only this tool's config.json holds: ``grid``,
  ``methods``, ``ablation``), a folder of another tool is refused even with
  ``overwrite``: its outputs have other names and would stay beside the new ones.

  Called inside ``claimed(out_dir)``, which refuses a folder another live
  process is writing, whatever the flags.

  Nothing is deleted here: with ``overwrite``, the caller removes its own
  outputs (``remove_outputs``) once the data has loaded, and makes the
  folder, so a failure before that leaves everything as it was. Only the
  writing process checks (``io.is_writer``): under ``jax.distributed`` the
  others could see the files process 0 has just begun to write.

  Raises:
    ValueError: naming the folder and the flag that would proceed.
  """
  if not is_writer():
    return
  if record_key is not None and (out_dir / "config.json").exists():
    try:
      read_record(out_dir, record_key)
    except ValueError as err:
      raise ValueError(f"{err}; choose another --out") from None
  finished = (out_dir / finished_marker).exists()
  unfinished = not finished and ((out_dir / CHECKPOINT).exists()
                                 or (out_dir / "config.json").exists())
  if overwrite:
    return
  if resume:
    if finished:
      raise ValueError(f"{out_dir} holds a finished run; nothing to resume "
                       "(to run it again, start it anew with --out and --overwrite)")
    if not unfinished:
      raise ValueError(f"{out_dir} holds no run to resume")
  elif finished:
    raise ValueError(f"{out_dir} holds a finished run; pass --overwrite to replace it or "
                     "choose another --out")
  elif unfinished and not resumable:
    raise ValueError(f"{out_dir} holds an unfinished run that cannot be resumed; pass "
                     "--overwrite to replace it or choose another --out")
  elif unfinished:
    raise ValueError(f"{out_dir} holds an unfinished run; continue it with --resume {out_dir}"
                     + (" --max-memory SIZE (it stopped over its memory budget)"
                        if _status(out_dir) == STOPPED_OVER_BUDGET else "")
                     + " or pass --overwrite to start again")


def _status(out_dir: pathlib.Path) -> Optional[str]:
  try:
    return read_record(out_dir, "status")["status"]
  except (OSError, ValueError):  # no record or an unreadable one: no hint to add
    return None


def remove_outputs(out_dir: pathlib.Path, names) -> None:
  """Deletes the named files of a previous run in ``out_dir`` (others' files are left alone)."""
  for name in names:
    remove_file(out_dir / name)


MAX_SEED = 2**31 - 1


def check_run_args(rounds: int, last: int, seeds: Sequence[int]) -> None:
  """Checks a run's length and seeds before anything is written (``RunControls`` checks itself).

  Raises:
    ValueError: naming the first bad value and what is allowed.
  """
  if rounds < 1:
    raise ValueError(f"rounds = {rounds}; must be >= 1")
  if not 1 <= last <= rounds:
    raise ValueError(f"last = {last}; must be in [1, rounds = {rounds}]")
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"seeds = {list(seeds)}; give at least one, without repeats")
  bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
  if bad:
    raise ValueError(f"seeds = {list(seeds)}; each must be in [0, {MAX_SEED}]")


def read_record(out_dir: pathlib.Path, required: str) -> dict:
  """The config.json of the run in ``out_dir``, which must hold the key ``required``.

  Raises:
    ValueError: without a config.json, or for another kind of run.
  """
  try:
    record = json.loads((out_dir / "config.json").read_text())
  except (FileNotFoundError, NotADirectoryError):
    if not out_dir.is_dir():
      raise ValueError(f"{out_dir} is not a folder (give the --out of an earlier run)")
    raise ValueError(f"{out_dir} holds no config.json (no run of these tools)")
  except json.JSONDecodeError as err:
    raise ValueError(f"{out_dir / 'config.json'} is not valid JSON: {err}")
  if required not in record:
    tool = next((f"{tool}'s " for key, tool in TOOLS.items() if key in record), "")
    raise ValueError(f"{out_dir} holds another kind of run ({tool}config.json, which has no "
                     f"{required!r})")
  return record


def resumed(controls: RunControls, record: Mapping, out_dir: pathlib.Path,
            nonfinite: Optional[str] = None) -> RunControls:
  """The controls of a resumed run: the run's own, but for the data locations, progress,
  checks, devices and memory budget of ``controls`` (a budget not given: the run's) and the
  policy ``nonfinite`` (None: the run's)."""
  return controls.replace(
      out_dir=out_dir, resume=True, overwrite=False, chunk=record["chunk"],
      checkpoint_every=record.get("checkpoint_every", 1),
      eval_every=record.get("eval_every", 1),
      raw_dir=controls.raw_dir or record.get("raw_dir"),
      cache_dir=controls.cache_dir or record.get("cache_dir"),
      max_memory=controls.max_memory or record.get("max_memory"),
      nonfinite=nonfinite or record["nonfinite"])


def earlier_plans(out_dir: pathlib.Path, resume: bool) -> dict:
  """What a resumed run's new config.json keeps of the old: the batch plans of earlier calls.

  Returns:
    ``{"batch": ..., "batches": ..., "earlier_batches": ...}`` where the old
    record has them (``record_plan``); ``{}`` for a new run.
  """
  if not resume or not (out_dir / "config.json").exists():
    return {}
  old = json.loads((out_dir / "config.json").read_text())
  return {key: old[key] for key in ("batch", "batches", "earlier_batches") if key in old}


def record_plan(record: dict, plan: dict, run: Optional[str] = None) -> None:
  """Puts a call's batch plan (``devices.Plan.record()``) into a run's config.json contents.

  A grid's plan is ``record["batch"]``, a table's of one method or reference
  ``record["batches"][run]``; the plan of an earlier call that this one
  replaces (a resumed run is laid out anew) moves to
  ``record["earlier_batches"]`` (a table's tagged with its ``run``).
  """
  holder, name = (record, "batch") if run is None else (record.setdefault("batches", {}), run)
  if name in holder:
    record.setdefault("earlier_batches", []).append(
        holder[name] if run is None else {"run": run, **holder[name]})
  holder[name] = plan


STOPPED_OVER_BUDGET = "stopped: over the memory budget"


@contextlib.contextmanager
def marks_stopped(out_dir: pathlib.Path, record: Optional[dict]):
  """Around a sweep: a run that stops says so in its config.json, and resumes as it says.

  ``record`` (the run's config.json contents, if any) gets the status
  ``stopped: over the memory budget`` for a batch that fits no layout (the
  error is raised again with the command that continues the run: ``--resume``
  takes a new ``--max-memory``), or ``stopped: <exception name>`` for any
  other exception (Ctrl-C: ``stopped: KeyboardInterrupt``), instead of
  ``running``.

  Raises:
    controls.OverBudgetError: the sweep's, with that advice; any other
      exception as it was.
  """
  def mark(status):
    if record is not None and is_writer():
      from fedjax_graph import report  # matplotlib's import cost only here

      report.write_json(out_dir / "config.json", {**record, "status": status})

  try:
    yield
  except OverBudgetError as err:
    mark(STOPPED_OVER_BUDGET)
    raise OverBudgetError(f"{err}. {out_dir} keeps the run: continue it with --resume {out_dir} "
                          "--max-memory SIZE") from None
  except BaseException as err:
    mark(f"stopped: {type(err).__name__}")
    raise
