"""Shared fixtures: a tiny synthetic federation and the real MUSAE data location."""

import gc
import importlib.util
import os
import pathlib
import shutil
import tempfile

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


_XLA_CACHE = "FEDJAX_GRAPH_TEST_XLA_CACHE"


def pytest_configure(config):
  """One persistent XLA compilation cache per test session.

  Many tests compile the same program (a fixture's simulation in several
  files, a subprocess that compiles again what its parent ran); the cache
  compiles each once per session. It is made by the first process (the
  xdist controller) and reaches the workers and subprocesses through the
  environment; results do not change (an entry is the same executable).
  """
  if _XLA_CACHE not in os.environ:
    os.environ[_XLA_CACHE] = tempfile.mkdtemp(prefix="fedjax-graph-xla-")
    config._fedjax_graph_owns_cache = True
  path = os.environ[_XLA_CACHE]
  for name, value in (("jax_compilation_cache_dir", path),
                      ("jax_persistent_cache_min_compile_time_secs", 0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)):
    os.environ[name.upper()] = str(value)  # for subprocesses
    jax.config.update(name, value)


def pytest_unconfigure(config):
  if getattr(config, "_fedjax_graph_owns_cache", False):
    shutil.rmtree(os.environ.pop(_XLA_CACHE), ignore_errors=True)


def fake_domain(num_nodes: int, num_edges: int, num_classes: int, features: int,
                seed: int) -> dict:
  """A random undirected graph in the prepared-data format (both edge directions)."""
  rng = np.random.default_rng(seed)
  edges = rng.integers(0, num_nodes, (2, num_edges))
  edges = edges[:, edges[0] != edges[1]]
  edges = np.unique(np.concatenate([edges, edges[::-1]], axis=1), axis=1)
  return dict(x=rng.standard_normal((num_nodes, features)).astype(np.float32),
              y=rng.integers(0, num_classes, num_nodes).astype(np.int32),
              edge_index=edges.astype(np.int32))


def script_main(name: str):
  """The ``main`` of ``experiments/<name>.py``, loaded as a module (scripts are not a package)."""
  spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def usage_error(script: str, argv: list, capsys) -> str:
  """Runs ``experiments/<script>.py`` expecting argparse's usage error; returns its stderr."""
  with pytest.raises(SystemExit) as exit_info:
    script_main(script)(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "usage:" not in err and err.endswith(" --help lists the flags\n")  # cli.Parser
  return err


def vmapped_and_looped(sim, federation, *inputs):
  """``sim``'s local training of every client, vmapped in one jit and in a Python loop.

  ``inputs``: ``simulation.for_each_client``'s (start, global params, shards,
  keys[, client state, server state]). They enter the jit as arguments, not
  closed-over constants: XLA folds work on constants at compile time with
  other rounding (FGGP's updates then drifted 3 % from the loop's on an AMD
  EPYC host).
  """
  from fedjax_graph import simulation

  run = lambda update, backend, *inputs: simulation.for_each_client(
      update, federation, sim.training_input, *inputs, backend=backend)
  vmapped = jax.jit(lambda *inputs: run(sim.local_update, "vmap", *inputs))(*inputs)
  return vmapped, run(jax.jit(sim.local_update), "loop", *inputs)


def random_graph(n: int, num_edges: int, seed: int) -> np.ndarray:
  """int[2, 2 * num_edges]: a random simple undirected graph, both directions."""
  rng = np.random.default_rng(seed)
  pairs = set()
  while len(pairs) < num_edges:
    a, b = rng.integers(0, n, 2)
    if a != b:
      pairs.add((min(a, b), max(a, b)))
  pairs = np.array(sorted(pairs)).T
  return np.concatenate([pairs, pairs[::-1]], axis=1)


def dense_norm_adj(edge_index: np.ndarray, n: int) -> np.ndarray:
  """Reference D^-1/2 (A+I) D^-1/2 in float64, built independently of the library."""
  a = np.eye(n)
  for s, r in edge_index.T:
    a[r, s] += 1.0
  d = a.sum(axis=1)
  return a / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]


@pytest.fixture(scope="session")
def tiny_wikinet() -> dict:
  """Three small random graphs named like the WikiNet domains (5 classes, 8 features)."""
  sizes = {"chameleon": 40, "squirrel": 60, "crocodile": 90}
  return {d: fake_domain(n, 2 * n, 5, 8, i) for i, (d, n) in enumerate(sizes.items())}


@pytest.fixture(scope="session")
def raw_dir() -> pathlib.Path:
  """The raw MUSAE files: $FEDJAX_GRAPH_RAW, else ../shared/datasets/musae; skip if absent."""
  path = pathlib.Path(os.environ.get("FEDJAX_GRAPH_RAW", REPO.parent / "shared/datasets/musae"))
  if not (path / "wikipedia").is_dir():
    pytest.skip(f"raw MUSAE data not found at {path}")
  return path


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory) -> pathlib.Path:
  """One prepared-data cache shared by the end-to-end tests of a session."""
  return tmp_path_factory.mktemp("fedjax_graph_cache")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Frees each test module's compiled programs once it is done.

  A process (or xdist worker) runs many modules; without this, every module's
  XLA executables stay cached to its end (CI once crashed compiling late in a
  single-process run of the suite).
  """
  yield
  from fedjax_graph import devices, simulation

  simulation._SIMULATIONS.clear()
  devices._SHARDED.clear()
  jax.clear_caches()
  gc.collect()
