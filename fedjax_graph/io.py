"""Atomic file writes: every artefact and checkpoint of a run goes through ``atomic_write``.

Under ``jax.distributed`` (several processes run one program) only process 0
writes or removes files (``is_writer``); the others compute the same results.
"""

import os
import pathlib
import tempfile
from typing import IO, Callable


def is_writer() -> bool:
  """True on the process that writes files: process 0 (the only one without ``jax.distributed``)."""
  import jax  # the writers' import cost only

  return jax.process_index() == 0


def remove_file(path: str | os.PathLike) -> None:
  """Deletes ``path`` if it exists, on the writing process only (``is_writer``)."""
  if is_writer():
    pathlib.Path(path).unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool) -> None:
  """Writes a file so readers never observe a partial one (on process 0 only: ``is_writer``).

  The content goes to a temporary file in the destination directory (same
  filesystem, so ``os.replace`` is an atomic rename) and keeps the
  destination's suffix so format-sniffing writers behave. On any failure the
  temporary file is removed and an existing destination is left untouched.

  Args:
    path: Destination path; missing parent directories are created.
    write: Callback that writes the whole content to the open file object.
    binary: Open the temporary file in ``"wb"`` rather than text mode.
  """
  if not is_writer():
    return
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  base = os.path.basename(path)
  _, suffix = os.path.splitext(base)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=suffix)
  try:
    mode = "wb" if binary else "w"
    # newline="" lets the csv module control line endings itself.
    kwargs = {} if binary else {"encoding": "utf-8", "newline": ""}
    with os.fdopen(fd, mode, **kwargs) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp creates 0600; artefacts are meant to be shared like any output.
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
