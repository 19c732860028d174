"""Turning raw edge rows into a clean, symmetric, sorted ``edge_index``."""

from __future__ import annotations

import numpy as np

__all__ = ["clean_edges"]


def clean_edges(edges: np.ndarray, num_nodes: int) -> tuple[np.ndarray, dict[str, int]]:
    """Symmetrises an undirected edge list and drops self-loops and duplicates.

    A row (u, v) and a later (v, u) or (u, v) describe the same undirected edge;
    all but one are counted as duplicates. Sorting makes the output independent
    of the order of rows in the raw file.

    Args:
        edges: int [E_raw, 2] raw rows with ids in [0, N) (already validated).
        num_nodes: N.

    Returns:
        (edge_index, stats): int32 [2, E] holding every undirected edge in both
        directions, sorted lexicographically by (source, target), E = 2 * the
        number of distinct undirected non-loop edges; and ``{"raw_edge_rows",
        "removed_self_loops", "removed_duplicate_edges", "num_undirected_edges",
        "num_edges"}``.
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    loops = edges[:, 0] == edges[:, 1]
    rest = edges[~loops]
    # One int64 key per unordered pair makes np.unique do the dedup and the sort.
    lo, hi = rest.min(axis=1), rest.max(axis=1)
    pairs = np.unique(lo * num_nodes + hi)
    lo, hi = np.divmod(pairs, num_nodes)
    directed = np.unique(np.concatenate([lo * num_nodes + hi, hi * num_nodes + lo]))
    src, dst = np.divmod(directed, num_nodes)
    edge_index = np.stack([src, dst]).astype(np.int32)
    stats = {
        "raw_edge_rows": int(len(edges)),
        "removed_self_loops": int(loops.sum()),
        "removed_duplicate_edges": int(len(rest) - len(pairs)),
        "num_undirected_edges": int(len(pairs)),
        "num_edges": int(edge_index.shape[1]),
    }
    return edge_index, stats
