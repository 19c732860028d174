"""How a run is carried out (not what it computes): data locations, chunks, checkpoints, policies."""

import dataclasses
import pathlib
from typing import Optional

NONFINITE_POLICIES = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class RunControls:
  """The run controls shared by every experiment (grid, table, ablation, dissection).

  None of them changes what a run computes: a run gives the same results with
  any chunk size, checkpoint interval, progress bar, evaluation interval or
  resume (``eval_every`` only leaves some rounds' scores unrecorded).

  Attributes:
    out_dir: where to write; None: ``results/<dataset>-<setting>[-<kind>]-<timestamp>``.
    raw_dir, cache_dir: data locations (see ``data.load_dataset``).
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

  def __post_init__(self):
    for name in ("chunk", "checkpoint_every", "eval_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} = {getattr(self, name)}; must be >= 1")
    if self.nonfinite not in NONFINITE_POLICIES:
      raise ValueError(f"nonfinite = {self.nonfinite!r}; choose one of {NONFINITE_POLICIES}")
    for name in ("out_dir", "raw_dir", "cache_dir"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, pathlib.Path(getattr(self, name)))

  def replace(self, **changes) -> "RunControls":
    return dataclasses.replace(self, **changes)
