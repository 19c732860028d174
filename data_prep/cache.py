"""The prepared-data cache: ``<cache>/<dataset>/{<domain>.npz, meta.json}``.

``meta.json`` is written last and removed first on a rebuild, so it acts as the
commit marker: a folder whose meta.json records the current recipe holds
complete, current arrays. The recipe is built from constants and the expected
source checksums only, so deciding to reuse an entry reads no raw file.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import tempfile
import zipfile
from typing import Any

import numpy as np

from . import checksums as _checksums
from . import download, features, graph, musae, registry

__all__ = ["FORMAT_VERSION", "CACHE_ENV", "RAW_ENV", "default_cache_dir", "prepare",
           "load_domain", "load_meta", "recipe"]

log = logging.getLogger(__name__)

ARRAYS = ("x", "y", "edge_index")
"""The arrays of each prepared ``<domain>.npz``."""

FORMAT_VERSION = 1
"""Bump whenever the arrays written for the same raw files would change."""

CACHE_ENV = "FEDJAX_GRAPH_CACHE"
RAW_ENV = "FEDJAX_GRAPH_RAW"
META_NAME = "meta.json"

_LABEL_RECIPES = {
    "twitch": "Twitch 'mature' column: True -> 1, False -> 0 (int32); target rows repeating a "
              "new_id with the same label are dropped",
    "wikinet": "five equal-frequency bins of the 'target' traffic within each network: "
               "y = np.digitize(traffic, np.quantile(traffic, [0.2, 0.4, 0.6, 0.8])) (int32, "
               "closed on the left)",
}
_EDGE_RECIPE = ("undirected: every edge in both directions, self-loops and duplicates removed, "
                "sorted lexicographically by (source, target); int32 [2, E]; "
                "node i = raw node id i")


def default_cache_dir() -> pathlib.Path:
    """Returns env ``FEDJAX_GRAPH_CACHE`` if set, else ``~/.cache/fedjax_graph``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env or "~/.cache/fedjax_graph").expanduser()


def recipe(dataset: str, source_sha256: dict[str, str]) -> dict[str, Any]:
    """The JSON-able description that decides whether a cache entry is current.

    Args:
        dataset: Dataset name.
        source_sha256: ``{relative raw path: sha256}`` of the inputs.

    Raises:
        ValueError: unknown dataset.
    """
    source = registry.check_dataset(dataset)
    return {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "domains": list(registry.DATASETS[dataset]),
        "feature_dim": features.FEATURE_DIM,
        "feature_recipe": {**features.RECIPE, "svd_seed": features.SVD_SEED,
                           "fit": "one map on all domains stacked (shared vocabulary)"
                           if source.shared_vocabulary else "one map per domain"},
        "label_recipe": _LABEL_RECIPES[dataset],
        "edge_recipe": _EDGE_RECIPE,
        "source_sha256": dict(sorted(source_sha256.items())),
    }


def _atomic_write(path: pathlib.Path, write) -> None:
    """Calls ``write(fileobj)`` on a temp file next to ``path``, then renames it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cache is read like any other file
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _stale(out: pathlib.Path, want: dict[str, Any]) -> str | None:
    """Why the entry ``out`` cannot serve the recipe ``want``, or None when it can."""
    try:
        meta = json.loads((out / META_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "not prepared yet"
    except (OSError, ValueError):
        return f"{META_NAME} unreadable"
    if not isinstance(meta, dict) or meta.get("recipe") != want:
        return "prepared by another recipe (code version or raw files)"
    damaged = [f"{d}.npz" for d in want["domains"] if not _is_intact(out / f"{d}.npz")]
    return f"damaged or missing: {', '.join(damaged)}" if damaged else None


def _is_intact(path: pathlib.Path) -> bool:
    """Whether a prepared file reads back whole (a full disk or an edit can truncate it)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return (archive.testzip() is None
                    and {f"{key}.npy" for key in ARRAYS} <= set(archive.namelist()))
    except (OSError, zipfile.BadZipFile):
        return False


def _explicit_raw(raw_dir) -> pathlib.Path | None:
    if raw_dir is not None:
        return pathlib.Path(raw_dir).expanduser()
    env = os.environ.get(RAW_ENV)
    return pathlib.Path(env).expanduser() if env else None


def prepare(dataset: str, raw_dir: str | os.PathLike | None = None,
            cache_dir: str | os.PathLike | None = None, base_url: str | None = None,
            force: bool = False, verify: bool = True) -> pathlib.Path:
    """Builds (or reuses) the prepared arrays of every domain of a dataset.

    Raw files are taken from, in order: ``raw_dir``; env ``FEDJAX_GRAPH_RAW``;
    ``<cache>/raw`` if it holds all files of the dataset; else the SNAP archive
    is downloaded there (see :func:`data_prep.download.download_raw`).

    With ``verify=True`` an entry is reused when its meta.json records the
    current recipe (which includes the expected source checksums) and its
    files read back whole (CRC-checked; a damaged entry is rebuilt); no raw
    file is read then. With ``verify=False`` (custom data) the raw files are hashed,
    not checked against the table, and the hashes enter the recipe, so editing
    a raw file triggers a rebuild.

    Output per domain: ``<cache>/<dataset>/<domain>.npz`` with ``x`` float32
    [N, 128], ``y`` int32 [N], ``edge_index`` int32 [2, E]; plus ``meta.json``.

    Args:
        dataset: ``"twitch"`` or ``"wikinet"``.
        raw_dir: Folder holding the SNAP layout (``twitch/DE/musae_DE_edges.csv``...).
        cache_dir: Cache root; default :func:`default_cache_dir`.
        base_url: Download location of the archives; default env
            ``FEDJAX_GRAPH_BASE_URL`` or ``https://snap.stanford.edu/data/``.
        force: Rebuild even if the cache entry is current.
        verify: Check raw files against the sha256 table (downloads are always checked).

    Returns:
        ``<cache>/<dataset>``.

    Raises:
        ValueError: unknown dataset (valid ones listed) or invalid raw contents
            (file and problem named).
        FileNotFoundError: raw files missing (named).
        ChecksumError: a raw file differs from the table (named); a subclass of ValueError.
        ConnectionError: a needed download failed.
    """
    registry.check_dataset(dataset)
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = cache / dataset
    relpaths = registry.dataset_files(dataset)
    raw_root = _explicit_raw(raw_dir)

    if verify:
        table = _checksums.FILE_SHA256
        unknown = [rel for rel in relpaths if rel not in table]
        if unknown:
            raise ValueError(f"no sha256 known for {unknown[:5]}; "
                             f"pass verify=False for custom data")
        sources = {rel: table[rel] for rel in relpaths}
    else:
        raw_root = raw_root or _cached_or_downloaded_raw(dataset, cache, base_url)
        sources = _checksums.hash_files(raw_root, relpaths)
    want = recipe(dataset, sources)
    reason = "--force" if force else _stale(out, want)
    if reason is None:
        log.debug("reusing %s", out)
        return out
    log.info("preparing %s: %s", out, reason)

    if raw_root is None:
        raw_root = _cached_or_downloaded_raw(dataset, cache, base_url)
    if verify:
        _checksums.verify_files(raw_root, relpaths)
    else:
        _checksums.require_files(raw_root, relpaths)
    log.info("building %s from %s", out, raw_root)
    _build(dataset, raw_root, out, want)
    return out


def _cached_or_downloaded_raw(dataset: str, cache: pathlib.Path,
                              base_url: str | None) -> pathlib.Path:
    raw_root = cache / "raw"
    if all((raw_root / rel).is_file() for rel in registry.dataset_files(dataset)):
        return raw_root
    return download.download_raw(dataset, raw_root, base_url)


def _build(dataset: str, raw_root: pathlib.Path, out: pathlib.Path, want: dict[str, Any]) -> None:
    source = registry.SOURCES[dataset]
    domains = [musae.read_domain(raw_root, dataset, d) for d in registry.DATASETS[dataset]]

    groups = [domains] if source.shared_vocabulary else [[d] for d in domains]
    x: dict[str, np.ndarray] = {}
    fits = []
    for group in groups:
        # Vocabulary = max id + 1 over exactly the data this map is fitted on.
        vocab = 1 + max((int(d.feature_ids.max()) for d in group if d.feature_ids.size), default=-1)
        mats = [features.binary_matrix(d.feature_nodes, d.feature_ids, d.num_nodes, vocab)
                for d in group]
        feats, info = features.reduce_features(mats)
        info["domains"] = [d.name for d in group]
        fits.append(info)
        x.update({d.name: f for d, f in zip(group, feats)})

    out.mkdir(parents=True, exist_ok=True)
    # Drop the commit marker first so an interrupted rebuild is never taken as current.
    (out / META_NAME).unlink(missing_ok=True)
    per_domain = {}
    for d in domains:
        edge_index, stats = graph.clean_edges(d.edges, d.num_nodes)
        arrays = {"x": x[d.name], "y": d.y.astype(np.int32), "edge_index": edge_index}
        _atomic_write(out / f"{d.name}.npz", lambda f, a=arrays: np.savez(f, **a))
        counts = np.bincount(d.y, minlength=2 if dataset == "twitch" else 5)
        per_domain[d.name] = {
            "num_nodes": d.num_nodes,
            **stats,
            "class_counts": counts.tolist(),
            "nodes_without_features": d.nodes_without_features,
            "removed_duplicate_target_rows": d.duplicate_target_rows,
            **({"label_bin_edges": d.label_bin_edges} if d.label_bin_edges is not None else {}),
        }
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "domains": list(registry.DATASETS[dataset]),
        "recipe": want,
        "source_sha256": want["source_sha256"],
        "domain_stats": per_domain,
        "feature_fits": fits,
    }
    text = json.dumps(meta, indent=2) + "\n"
    _atomic_write(out / META_NAME, lambda f: f.write(text.encode("utf-8")))


def load_meta(prepared_dir: str | os.PathLike) -> dict:
    """Reads ``meta.json`` of a prepared dataset folder.

    Returns:
        The metadata: ``dataset``, ``domains``, ``recipe``, ``source_sha256``,
        ``domain_stats`` (per domain: ``num_nodes``, ``num_edges`` (directed
        entries of edge_index), ``num_undirected_edges``, ``raw_edge_rows``,
        ``removed_self_loops``, ``removed_duplicate_edges``, ``class_counts``,
        ...), ``feature_fits``, ``format_version``.

    Raises:
        FileNotFoundError: no meta.json (the folder is not prepared).
    """
    path = pathlib.Path(prepared_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run data_prep.prepare(...) first")
    return json.loads(path.read_text(encoding="utf-8"))


def load_domain(prepared_dir: str | os.PathLike, domain: str) -> dict[str, np.ndarray]:
    """Loads one prepared domain.

    Args:
        prepared_dir: ``<cache>/<dataset>`` as returned by :func:`prepare`.
        domain: A domain of that dataset, e.g. ``"DE"`` or ``"chameleon"``.

    Returns:
        ``{"x": float32 [N, 128], "y": int32 [N], "edge_index": int32 [2, E]}``
        (E counts both directions of every undirected edge).

    Raises:
        FileNotFoundError: the folder is not prepared.
        ValueError: ``domain`` is not one of the dataset's domains (valid ones listed), or
            its file is damaged (named, with the way to rebuild it).
    """
    prepared_dir = pathlib.Path(prepared_dir)
    meta = load_meta(prepared_dir)
    if domain not in meta["domains"]:
        raise ValueError(f"unknown domain {domain!r} for dataset {meta['dataset']!r}; "
                         f"valid domains: {', '.join(meta['domains'])}")
    path = prepared_dir / f"{domain}.npz"
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in ARRAYS}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        # A truncated or edited cache file: name it and the way out, not numpy's internals.
        raise ValueError(f"{path}: damaged prepared file ({type(err).__name__}: {err}); delete "
                         f"{prepared_dir} or run `python -m data_prep --dataset {meta['dataset']} "
                         f"--force`") from err
