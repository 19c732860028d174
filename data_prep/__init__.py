"""Data preparation for fedjax-graph: the MUSAE Twitch and Wikipedia networks.

Turns the raw SNAP files into one ``<cache>/<dataset>/<domain>.npz`` per domain
(``x`` float32 [N, 128], ``y`` int32 [N], ``edge_index`` int32 [2, E]) plus a
``meta.json``. Pure numpy/scipy: this package must not import jax.

Example:
    >>> import data_prep
    >>> path = data_prep.prepare("wikinet", raw_dir="../shared/datasets/musae")
    >>> data_prep.load_domain(path, "chameleon")["x"].shape
    (2277, 128)
"""

from .cache import default_cache_dir, load_domain, load_meta, prepare
from .checksums import ChecksumError
from .registry import DATASETS

__all__ = ["DATASETS", "prepare", "load_domain", "load_meta", "default_cache_dir",
           "ChecksumError"]
