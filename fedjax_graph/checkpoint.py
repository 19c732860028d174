"""Atomic checkpoints of a sweep: the batched simulation state and the history so far.

A checkpoint is one msgpack file (``flax.serialization``) written with
``io.atomic_write`` (a temporary name, then a rename), so a crash leaves either
the previous checkpoint or the new one, never a torn file. It carries a
fingerprint of the sweep's setup, so a run is only ever resumed with the setup
it was started with.
"""

import hashlib
import json
import os
import pathlib
from typing import Any, NamedTuple

import numpy as np
from flax import serialization

from fedjax_graph.io import atomic_write

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
  """Writes ``checkpoint`` to ``path`` atomically (``io.atomic_write``)."""
  payload = serialization.msgpack_serialize({
      "version": FORMAT_VERSION,
      "state": serialization.to_state_dict(checkpoint.state),
      "metrics": {k: np.asarray(v) for k, v in checkpoint.metrics.items() if v is not None},
      "next_round": checkpoint.next_round,
      "fingerprint": checkpoint.fingerprint,
  })
  atomic_write(path, lambda f: f.write(payload), binary=True)


def load(path: os.PathLike, state_template: Any) -> Checkpoint:
  """Reads a checkpoint, restoring the state into the structure of ``state_template``.

  Raises:
    ValueError: if the file is truncated, damaged or not a checkpoint of this
      format; the message names the file and the way out.
  """
  path = pathlib.Path(path)
  raw, problem = None, ""
  try:
    raw = serialization.msgpack_restore(path.read_bytes())
  except ValueError as err:  # msgpack's errors (e.g. "incomplete input") are ValueErrors.
    problem = f" ({err})" if str(err) else ""
  if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
    # Writes are atomic, so a bad file was cut short or changed by something
    # else; the state it held is lost, and no older one is kept.
    raise ValueError(f"{path} is truncated, damaged or not a fedjax-graph checkpoint (format "
                     f"{FORMAT_VERSION}){problem}; the state it held is lost: delete it and "
                     f"continue with --resume {path.parent} (its sweep starts again from round "
                     f"1), or start the run again with --overwrite (and not --resume)")
  state = serialization.from_state_dict(state_template, raw["state"])
  return Checkpoint(state=state, metrics=dict(raw["metrics"]), next_round=int(raw["next_round"]),
                    fingerprint=str(raw["fingerprint"]))
