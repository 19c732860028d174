"""Atomic checkpoints of a sweep: the batched simulation state and the history so far.

A checkpoint is one msgpack file (``flax.serialization``) written to a
temporary name and renamed, so a crash leaves either the previous checkpoint
or the new one, never a torn file. It carries a fingerprint of the sweep's
setup, so a run is only ever resumed with the setup it was started with.
"""

import hashlib
import json
import os
import pathlib
from typing import Any, NamedTuple

import numpy as np
from flax import serialization

FORMAT_VERSION = 1


class Checkpoint(NamedTuple):
  """What a resumed sweep needs.

  Attributes:
    state: the ``SimState`` with leaves [S, G', ...] after ``next_round`` rounds.
    metrics: ``{name: array [S, G', next_round, ...]}`` the history so far.
    next_round: the first round still to run.
    fingerprint: ``fingerprint(setup)`` of the sweep that wrote it.
  """
  state: Any
  metrics: dict[str, np.ndarray]
  next_round: int
  fingerprint: str


def fingerprint(setup: Any) -> str:
  """sha256 of a JSON-able description of a sweep (config, cells, seeds, rounds, chunk)."""
  text = json.dumps(setup, sort_keys=True, default=lambda v: np.asarray(v).tolist())
  return hashlib.sha256(text.encode()).hexdigest()


def save(path: os.PathLike, checkpoint: Checkpoint) -> None:
  """Writes ``checkpoint`` to ``path`` atomically (temp file in the same folder, then rename)."""
  path = pathlib.Path(path)
  payload = serialization.msgpack_serialize({
      "version": FORMAT_VERSION,
      "state": serialization.to_state_dict(checkpoint.state),
      "metrics": {k: np.asarray(v) for k, v in checkpoint.metrics.items() if v is not None},
      "next_round": checkpoint.next_round,
      "fingerprint": checkpoint.fingerprint,
  })
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    with open(tmp, "wb") as f:
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def load(path: os.PathLike, state_template: Any) -> Checkpoint:
  """Reads a checkpoint, restoring the state into the structure of ``state_template``.

  Raises:
    ValueError: if the file is not a checkpoint of this format.
  """
  raw = serialization.msgpack_restore(pathlib.Path(path).read_bytes())
  if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
    raise ValueError(f"{path} is not a fedjax-graph checkpoint (format {FORMAT_VERSION})")
  state = serialization.from_state_dict(state_template, raw["state"])
  return Checkpoint(state=state, metrics=dict(raw["metrics"]), next_round=int(raw["next_round"]),
                    fingerprint=str(raw["fingerprint"]))
