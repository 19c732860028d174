"""Reading and validating one raw MUSAE domain: targets, edges, feature lists, labels.

Every error is a ValueError that names the file (and line, where there is
one), because a mistake in a hand-prepared raw folder is the common failure.
Parsing uses the stdlib ``csv``/``json`` modules; numbers are converted with
numpy in bulk and re-checked row by row only to build an error message.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import pathlib
from typing import Callable

import numpy as np

from . import registry

__all__ = ["RawDomain", "read_domain", "read_target", "read_edges", "read_features",
           "parse_mature", "parse_traffic", "traffic_bins", "TRAFFIC_QUANTILES"]

TRAFFIC_QUANTILES = (0.2, 0.4, 0.6, 0.8)
"""Quantiles of a network's traffic used as the edges of its five label bins."""


@dataclasses.dataclass
class RawDomain:
    """One domain as read from its raw files (before feature reduction).

    Attributes:
        name: Domain name, e.g. ``"DE"``.
        num_nodes: N, the number of distinct node ids in ``target.csv``.
        y: int32 [N] labels, row i = node id i.
        edges: int64 [E_raw, 2] the raw edge rows, unchanged (cleaned later).
        feature_nodes: int64 [nnz] node id of each (node, feature id) pair.
        feature_ids: int64 [nnz] feature (vocabulary) id of each pair; may repeat.
        nodes_without_features: nodes with no entry in ``features.json``.
        duplicate_target_rows: ``target.csv`` rows repeating an id (dropped).
        label_bin_edges: the four traffic quantiles (Wikipedia) or None.
    """

    name: str
    num_nodes: int
    y: np.ndarray
    edges: np.ndarray
    feature_nodes: np.ndarray
    feature_ids: np.ndarray
    nodes_without_features: int
    duplicate_target_rows: int
    label_bin_edges: list[float] | None = None


def _read_csv(path: pathlib.Path,
              required: tuple[str, ...]) -> tuple[dict[str, list[str]], list[int]]:
    """Returns the ``required`` columns as string lists plus each row's line number."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: file is empty; expected a header with columns "
                             f"{', '.join(required)}")
        header = [name.strip() for name in header]
        missing = [name for name in required if name not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(map(repr, missing))}; "
                             f"the header has {', '.join(map(repr, header))}")
        index = [header.index(name) for name in required]
        columns: dict[str, list[str]] = {name: [] for name in required}
        lines: list[int] = []
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}, line {reader.line_num}: expected {len(header)} "
                                 f"fields ({', '.join(header)}), got {len(row)}")
            for name, i in zip(required, index):
                columns[name].append(row[i])
            lines.append(reader.line_num)
    return columns, lines


def _int_column(values: list[str], lines: list[int], path: pathlib.Path, column: str) -> np.ndarray:
    """Converts a column of integer strings to int64, naming the first bad cell on failure."""
    try:
        return np.array(values, dtype=np.int64).reshape(len(values))
    except (ValueError, OverflowError):
        for value, line in zip(values, lines):
            try:
                int(value)
            except ValueError:
                raise ValueError(f"{path}, line {line}: column {column!r} holds a non-numeric "
                                 f"id {value!r} (node ids must be integers)") from None
        raise ValueError(f"{path}: column {column!r} holds an id too large for int64") from None


def parse_mature(text: str) -> int:
    """Maps the Twitch ``mature`` strings ``True``/``False`` (any case) to 1/0.

    Raises:
        ValueError: any other string.
    """
    value = text.strip().lower()
    if value == "true":
        return 1
    if value == "false":
        return 0
    raise ValueError(f"expected True or False, got {text!r}")


def parse_traffic(text: str) -> float:
    """Parses a Wikipedia ``target`` traffic count as a finite float.

    Raises:
        ValueError: not a number, or not finite.
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def read_target(path: str | os.PathLike, id_column: str, value_column: str,
                parse: Callable[[str], float]) -> tuple[np.ndarray, int]:
    """Reads ``target.csv`` and returns the parsed values ordered by node id.

    Rows that repeat an id are dropped if their parsed value equals the first
    row's (the Twitch FR release lists two users twice); a repeat with another
    value is an error. After that the ids must be exactly 0..N-1.

    Args:
        path: The CSV file.
        id_column: Column holding the node index (``new_id`` / ``id``).
        value_column: Column to parse (``mature`` / ``target``).
        parse: str -> value; raises ValueError on bad input.

    Returns:
        (values, duplicate_rows): float64 [N] values where entry i belongs to
        node id i, and the number of dropped repeated rows.

    Raises:
        ValueError: missing column, non-numeric id, unparsable value, a repeated
            id with a different value, or ids that are not exactly 0..N-1.
    """
    path = pathlib.Path(path)
    columns, lines = _read_csv(path, (id_column, value_column))
    ids = _int_column(columns[id_column], lines, path, id_column)
    values = np.empty(len(ids), dtype=np.float64)
    for i, (text, line) in enumerate(zip(columns[value_column], lines)):
        try:
            values[i] = parse(text)
        except ValueError as err:
            raise ValueError(f"{path}, line {line}: bad {value_column!r} value: {err}") from None
    order = np.argsort(ids, kind="stable")
    ids, values, lines_sorted = ids[order], values[order], np.asarray(lines)[order]
    repeat = np.zeros(len(ids), dtype=bool)
    repeat[1:] = ids[1:] == ids[:-1]
    for i in np.flatnonzero(repeat):
        if values[i] != values[i - 1]:
            raise ValueError(f"{path}, line {lines_sorted[i]}: {id_column} {ids[i]} appears again "
                             f"with a different {value_column!r} value")
    ids, values = ids[~repeat], values[~repeat]
    n = len(ids)
    if n == 0:
        raise ValueError(f"{path}: no data rows")
    if ids[0] != 0 or ids[-1] != n - 1:
        expected = np.arange(max(n, int(ids[-1]) + 1))
        absent = np.setdiff1d(expected, ids)[:5].tolist()
        raise ValueError(f"{path}: column {id_column!r} must hold exactly the ids 0..{n - 1} "
                         f"(found {n} distinct ids from {ids[0]} to {ids[-1]}; "
                         f"absent: {absent})")
    return values, int(repeat.sum())


def read_edges(path: str | os.PathLike, columns: tuple[str, str], num_nodes: int) -> np.ndarray:
    """Reads ``edges.csv`` as raw rows.

    Returns:
        int64 [E_raw, 2], rows in file order (self-loops and duplicates kept).

    Raises:
        ValueError: missing column, non-numeric id, or an id outside [0, N)
            (the message names the file, line and edge).
    """
    path = pathlib.Path(path)
    cells, lines = _read_csv(path, columns)
    edges = np.stack([_int_column(cells[c], lines, path, c) for c in columns], axis=1)
    bad = np.flatnonzero(((edges < 0) | (edges >= num_nodes)).any(axis=1))
    if bad.size:
        u, v = edges[bad[0]]
        raise ValueError(f"{path}, line {lines[bad[0]]}: edge ({u}, {v}) points outside the node "
                         f"range [0, {num_nodes}) given by target.csv "
                         f"({bad.size} such edge(s) in total)")
    return edges.reshape(-1, 2)


def read_features(path: str | os.PathLike, num_nodes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Reads ``features.json`` (``{"node id": [feature ids]}``) as (node, feature) pairs.

    Returns:
        (nodes, feature_ids, nodes_without_features): two int64 [nnz] arrays of
        pairs in file order (repeats kept; the matrix builder counts them once),
        and how many of the N nodes have no entry.

    Raises:
        ValueError: not a JSON object, a non-numeric or out-of-range node key, a
            key given twice, or a feature list that is not a list of
            non-negative integers.
    """
    path = pathlib.Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object {{node id: [feature ids]}}, "
                         f"got {type(data).__name__}")
    nodes = np.empty(len(data), dtype=np.int64)
    lengths = np.empty(len(data), dtype=np.int64)
    flat: list[int] = []
    for i, (key, items) in enumerate(data.items()):
        try:
            nodes[i] = int(key)
        except (ValueError, OverflowError):
            raise ValueError(
                f"{path}: non-numeric node id {key!r} (keys must be integers)") from None
        if not 0 <= nodes[i] < num_nodes:
            raise ValueError(f"{path}: node id {key!r} is outside the node range [0, {num_nodes}) "
                             f"given by target.csv")
        if not isinstance(items, list) or not all(type(v) is int and v >= 0 for v in items):
            raise ValueError(f"{path}: node {key!r} must map to a list of non-negative integer "
                             f"feature ids, got {str(items)[:80]}")
        lengths[i] = len(items)
        flat.extend(items)
    if np.unique(nodes).size != nodes.size:
        raise ValueError(f"{path}: a node id appears twice as a key (e.g. '1' and '01')")
    feature_ids = np.array(flat, dtype=np.int64)
    return np.repeat(nodes, lengths), feature_ids, num_nodes - len(data)


def traffic_bins(traffic: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Five equal-frequency classes of Wikipedia traffic (the Geom-GCN recipe).

    Bins are closed on the left: a value equal to an edge goes to the upper
    bin, so heavy ties at an edge make the classes unequal.

    Args:
        traffic: float [N] monthly traffic of one network.

    Returns:
        (y, edges): int32 [N] classes in 0..4 and float64 [4] bin edges
        ``np.quantile(traffic, [0.2, 0.4, 0.6, 0.8])``.
    """
    edges = np.quantile(np.asarray(traffic, dtype=np.float64), TRAFFIC_QUANTILES)
    return np.digitize(traffic, edges).astype(np.int32), edges


def read_domain(raw_root: str | os.PathLike, dataset: str, domain: str) -> RawDomain:
    """Reads and validates the three raw files of one domain.

    Args:
        raw_root: Folder holding the SNAP layout (``twitch/``, ``wikipedia/``).
        dataset: ``"twitch"`` or ``"wikinet"``.
        domain: A name from ``DATASETS[dataset]``.

    Returns:
        The domain's labels, raw edge rows and feature pairs (see RawDomain).

    Raises:
        ValueError: unknown dataset/domain or invalid file contents (named).
        FileNotFoundError: a raw file is missing.
    """
    source = registry.check_dataset(dataset)
    files = {kind: pathlib.Path(raw_root) / rel
             for kind, rel in registry.domain_files(dataset, domain).items()}
    if dataset == "twitch":
        values, duplicates = read_target(files["target"], source.id_column, source.label_column,
                                         parse_mature)
        y, bin_edges = values.astype(np.int32), None
    else:
        values, duplicates = read_target(files["target"], source.id_column, source.label_column,
                                         parse_traffic)
        y, edges_ = traffic_bins(values)
        bin_edges = edges_.tolist()
    n = len(y)
    edges = read_edges(files["edges"], source.edge_columns, n)
    nodes, feature_ids, without = read_features(files["features"], n)
    return RawDomain(name=domain, num_nodes=n, y=y, edges=edges, feature_nodes=nodes,
                     feature_ids=feature_ids, nodes_without_features=without,
                     duplicate_target_rows=duplicates, label_bin_edges=bin_edges)
