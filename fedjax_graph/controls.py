"""How a run is carried out (not what it computes): data locations, chunks, checkpoints, policies."""

import dataclasses
import math
import pathlib
import re
from typing import Optional

NONFINITE_POLICIES = ("error", "skip")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
  """'8G' -> 8 * 2**30: bytes, with an optional K, M, G or T (binary multiples; 'GB', 'GiB' too).

  Plain and scientific numbers are bytes ('1e9', '512'); fractions are rounded down.

  Raises:
    ValueError: for anything else or a size below one byte, naming ``text``.
  """
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text),
                       re.I)
  if not match:
    raise ValueError(f"memory size {text!r}: give a number of bytes with an optional K, M, G "
                     "or T suffix (binary multiples), e.g. 8G, 512M or 1e9")
  value = float(match[1]) * _UNITS[match[2].lower()]
  if not math.isfinite(value):
    raise ValueError(f"memory size {text!r} is too large to be a number of bytes; e.g. 8G or "
                     "512M")
  size = int(value)
  if size < 1:
    raise ValueError(f"memory size {text!r} is {size} bytes; give at least one byte, e.g. 8G "
                     "or 512M")
  return size


class OverBudgetError(ValueError):
  """A batch of runs needs more memory per device than ``RunControls.max_memory`` in any layout."""


@dataclasses.dataclass(frozen=True)
class RunControls:
  """The run controls shared by every experiment (grid, table, ablation, dissection).

  None of them changes what a run computes: a run gives the same results with
  any chunk size, checkpoint interval, progress bar, evaluation interval or
  resume (``eval_every`` only leaves some rounds' scores unrecorded), and (up
  to float rounding) on any number of devices and in any split.

  Attributes:
    out_dir: where to write; None: ``results/<dataset>-<setting>[-<kind>]-<timestamp>``.
    raw_dir, cache_dir: data locations (see ``data.load_dataset``), made absolute.
    verify: check the raw files against the SNAP checksums.
    chunk: rounds per compiled call; progress and checkpoints per chunk.
    progress: show a progress bar.
    nonfinite: ``error``: stop after a chunk in which a client update held a
      NaN or Inf, naming it; ``skip``: leave such updates out and go on,
      counting them. Either way no such update reaches a global model.
    checkpoint_every: chunks between checkpoints of the whole simulation state.
    resume: continue the unfinished run in ``out_dir``.
    overwrite: replace a finished or unfinished run in ``out_dir``.
    eval_every: evaluate the global model every k rounds and in every one of
      the final rounds the summaries read (``last``); the scores of the other
      rounds are NaN (predicted classes -1) and cost nothing. 1: every round.
    devices: split each batch of runs over this many devices (None: all; see
      ``devices``); the results are those of one device up to float rounding.
    max_memory: bytes per device a batch may take (None: 80 % of a device's
      memory); a batch over it runs in equal sub-batches, one after another.

  Raises:
    ValueError: (on construction) naming the first bad value and what is allowed.
  """
  out_dir: Optional[pathlib.Path] = None
  raw_dir: Optional[pathlib.Path] = None
  cache_dir: Optional[pathlib.Path] = None
  verify: bool = True
  chunk: int = 10
  progress: bool = True
  nonfinite: str = "error"
  checkpoint_every: int = 1
  resume: bool = False
  overwrite: bool = False
  eval_every: int = 1
  devices: Optional[int] = None
  max_memory: Optional[int] = None

  def __post_init__(self):
    for name in ("chunk", "checkpoint_every", "eval_every", "devices", "max_memory"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"{name} = {getattr(self, name)}; must be >= 1")
    if self.devices is not None:
      import jax  # only when devices are named

      available = jax.devices()
      if self.devices > len(available):
        raise ValueError(f"devices = {self.devices}; this process sees {len(available)} "
                         f"{available[0].platform} device(s): choose 1 to {len(available)}")
    if self.nonfinite not in NONFINITE_POLICIES:
      raise ValueError(f"nonfinite = {self.nonfinite!r}; choose one of {NONFINITE_POLICIES}")
    if self.out_dir is not None:
      object.__setattr__(self, "out_dir", pathlib.Path(self.out_dir))
    for name in ("raw_dir", "cache_dir"):  # absolute: config.json's record resumes from any folder
      if getattr(self, name) is not None:
        object.__setattr__(self, name, pathlib.Path(getattr(self, name)).expanduser().absolute())
    for name in ("out_dir", "raw_dir", "cache_dir"):
      path = getattr(self, name)
      if path is not None and path.exists() and not path.is_dir():
        raise ValueError(f"{name} = {path}; must be a folder, not a file")

  def replace(self, **changes) -> "RunControls":
    return dataclasses.replace(self, **changes)
