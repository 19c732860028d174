"""Node features: binary bag-of-ids matrix -> truncated SVD -> standardised columns.

Determinism matters more than speed here: two runs must give bit-identical
features, so the SVD starts from a fixed vector and its components are put in
a fixed order and given a fixed sign. With ``threadpoolctl`` installed BLAS runs
on one thread during the SVD, which also makes the bits independent of the
machine's core count (multi-threaded BLAS sums in a thread-dependent order).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import svds

try:  # Optional: without it BLAS keeps its default thread count.
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the environment
    threadpool_limits = None

__all__ = ["FEATURE_DIM", "SVD_SEED", "binary_matrix", "truncated_svd", "standardise",
           "reduce_features", "RECIPE"]

FEATURE_DIM = 128
SVD_SEED = 0

RECIPE = {
    "input": "binary node x vocabulary matrix (scipy CSR); repeated ids in a node's list count "
             "once; nodes without an entry get a zero row; vocabulary size = max id + 1 over the "
             "data the map is fitted on",
    "reduction": "truncated SVD: scipy.sparse.linalg.svds(k=dim, solver='arpack', "
                 "v0=numpy.random.default_rng(0).uniform(-1, 1, min(N, V))); when "
                 "min(N, V) <= 2*dim+1 the exact eigendecomposition of the smaller Gram matrix "
                 "instead; components in decreasing singular value; each right singular vector "
                 "signed so its largest-|value| entry is positive; components with singular value "
                 "<= 1e-10 * largest are zeroed; zero columns pad up to dim",
    "output": "X @ V (= U * S), then column standardisation (mean 0, std 1, ddof 0) over the "
              "fitted nodes, std 0 -> 1; float32",
}
"""What the features are, recorded in meta.json and compared to decide cache reuse."""


def binary_matrix(nodes: np.ndarray, ids: np.ndarray, num_nodes: int,
                  vocab_size: int) -> sp.csr_matrix:
    """Builds the 0/1 node x vocabulary matrix.

    Args:
        nodes: int [nnz] node index of each pair, in [0, N).
        ids: int [nnz] vocabulary id of each pair, in [0, V); repeats allowed.
        num_nodes: N.
        vocab_size: V.

    Returns:
        float64 CSR [N, V] with 1 where a node lists an id (once or more).
    """
    matrix = sp.csr_matrix((np.ones(len(nodes)), (nodes, ids)), shape=(num_nodes, vocab_size))
    matrix.sum_duplicates()
    matrix.data[:] = 1.0
    return matrix


def truncated_svd(matrix: sp.spmatrix, k: int,
                  seed: int = SVD_SEED) -> tuple[np.ndarray, np.ndarray, str]:
    """Top-``k`` right singular vectors of a sparse matrix, deterministically.

    Args:
        matrix: [N, V] sparse matrix.
        k: Number of components wanted.
        seed: Seed of the fixed ARPACK start vector.

    Returns:
        (V, s, solver): float64 [V, k] right singular vectors (columns, in
        decreasing singular value, sign-fixed, zero columns for components that
        do not exist or have a vanishing singular value), float64 [k] singular
        values (0 for those), and the solver used (``"arpack"`` or ``"gram"``).
    """
    with _one_blas_thread():
        return _truncated_svd(matrix, k, seed)


def _one_blas_thread():
    # ARPACK makes thousands of small BLAS calls; multi-threaded OpenBLAS spins on
    # them and runs ~10x slower when other processes (a JAX job) hold the CPUs.
    # One thread also keeps the rounding independent of the machine's core count.
    if threadpool_limits is None:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _truncated_svd(matrix: sp.spmatrix, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    n, v = matrix.shape
    matrix = sp.csr_matrix(matrix, dtype=np.float64)
    if min(n, v) <= 2 * k + 1:
        vecs, s = _gram_svd(matrix)
        solver = "gram"
    else:
        v0 = np.random.default_rng(seed).uniform(-1.0, 1.0, min(n, v))
        _, s, vt = svds(matrix, k=k, solver="arpack", v0=v0)
        vecs = vt.T
        solver = "arpack"
    order = np.argsort(-s, kind="stable")[:k]
    s, vecs = s[order], vecs[:, order]
    if s.size:
        dead = s <= 1e-10 * max(s[0], 0.0)
        s = np.where(dead, 0.0, s)
        vecs[:, dead] = 0.0
    # Singular vectors are defined up to sign; pin it so reruns agree exactly.
    if vecs.size:
        pivot = np.abs(vecs).argmax(axis=0)
        signs = np.sign(vecs[pivot, np.arange(vecs.shape[1])])
        vecs = vecs * np.where(signs == 0, 1.0, signs)
    pad = k - vecs.shape[1]
    if pad:
        vecs = np.hstack([vecs, np.zeros((v, pad))])
        s = np.concatenate([s, np.zeros(pad)])
    return vecs, s, solver


def _gram_svd(matrix: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """All right singular vectors and values via the smaller Gram matrix (small inputs)."""
    n, v = matrix.shape
    if v <= n:
        evals, vecs = np.linalg.eigh((matrix.T @ matrix).toarray())
        return vecs, np.sqrt(np.clip(evals, 0.0, None))
    evals, u = np.linalg.eigh((matrix @ matrix.T).toarray())
    s = np.sqrt(np.clip(evals, 0.0, None))
    vecs = np.asarray(matrix.T @ u)
    return vecs / np.where(s > 0, s, 1.0), s


def standardise(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column standardisation with a guard for constant columns.

    Args:
        z: float [N, F].

    Returns:
        ((z - mean) / std as float64 [N, F], mean [F], std [F]) where std is
        the population std (ddof 0) with zeros replaced by 1.
    """
    mean = z.mean(axis=0)
    std = z.std(axis=0)
    std = np.where(std == 0, 1.0, std)
    return (z - mean) / std, mean, std


def reduce_features(matrices: Sequence[sp.spmatrix], dim: int = FEATURE_DIM,
                    seed: int = SVD_SEED) -> tuple[list[np.ndarray], dict]:
    """Fits ONE SVD + standardisation on the stacked matrices and applies it to each.

    Pass several matrices to share the map (Twitch: one vocabulary, so a shift
    between countries stays visible); call once per matrix to fit separately.

    Args:
        matrices: [N_d, V] sparse matrices with the same V.
        dim: F, the output dimension.
        seed: ARPACK start-vector seed.

    Returns:
        (features, info): float32 [N_d, F] per input, and ``{"solver",
        "vocab_size", "num_fitted_nodes", "singular_values"}``.

    Raises:
        ValueError: the matrices have different widths.
    """
    widths = {m.shape[1] for m in matrices}
    if len(widths) != 1:
        raise ValueError(f"matrices must share one vocabulary, got widths {sorted(widths)}")
    stacked = sp.vstack(matrices, format="csr")
    vecs, s, solver = truncated_svd(stacked, dim, seed)
    z, _, _ = standardise(np.asarray(stacked @ vecs))
    bounds = np.cumsum([0] + [m.shape[0] for m in matrices])
    features = [z[a:b].astype(np.float32) for a, b in zip(bounds[:-1], bounds[1:])]
    info = {"solver": solver, "vocab_size": int(stacked.shape[1]),
            "num_fitted_nodes": int(stacked.shape[0]),
            "singular_values": [float(x) for x in s]}
    return features, info
