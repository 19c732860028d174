"""Names and file layout of the supported datasets (the SNAP MUSAE archives).

This module is the single place that knows which domains a dataset has, which
raw folder and archive they live in, and which CSV columns hold what; every
other module asks it instead of hard-coding paths.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

__all__ = ["DATASETS", "Source", "SOURCES", "check_dataset", "check_domain",
           "domain_files", "dataset_files"]


@dataclasses.dataclass(frozen=True)
class Source:
    """How one dataset is laid out in its SNAP archive.

    Attributes:
        archive: Archive file name on the SNAP server, e.g. ``"twitch.zip"``.
        top_folder: Folder the archive unpacks into, e.g. ``"twitch"``.
        raw_folders: Domain name -> raw folder name under ``top_folder``
            (Twitch's EN and PT live in ``ENGB`` and ``PTBR``).
        id_column: Column of ``target.csv`` holding the node index.
        label_column: Column of ``target.csv`` the label is derived from.
        edge_columns: The two node-index columns of ``edges.csv``.
        shared_vocabulary: Whether feature ids mean the same thing in every
            domain (then one feature map is fitted on all domains together).
    """

    archive: str
    top_folder: str
    raw_folders: Mapping[str, str]
    id_column: str
    label_column: str
    edge_columns: tuple[str, str]
    shared_vocabulary: bool


SOURCES: Mapping[str, Source] = MappingProxyType({
    "twitch": Source(
        archive="twitch.zip",
        top_folder="twitch",
        raw_folders=MappingProxyType({"DE": "DE", "EN": "ENGB", "ES": "ES",
                                      "FR": "FR", "PT": "PTBR", "RU": "RU"}),
        id_column="new_id",
        label_column="mature",
        edge_columns=("from", "to"),
        shared_vocabulary=True,
    ),
    "wikinet": Source(
        archive="wikipedia.zip",
        top_folder="wikipedia",
        raw_folders=MappingProxyType({"chameleon": "chameleon", "squirrel": "squirrel",
                                      "crocodile": "crocodile"}),
        id_column="id",
        label_column="target",
        edge_columns=("id1", "id2"),
        shared_vocabulary=False,
    ),
})

DATASETS: dict[str, tuple[str, ...]] = {
    name: tuple(source.raw_folders) for name, source in SOURCES.items()
}
"""Dataset name -> its domain names, in the canonical order."""

FILE_KINDS = ("edges", "features", "target")
_SUFFIX = {"edges": "edges.csv", "features": "features.json", "target": "target.csv"}


def check_dataset(dataset: str) -> Source:
    """Returns the layout of ``dataset``.

    Raises:
        ValueError: ``dataset`` is not a known name; the message lists the valid ones.
    """
    try:
        return SOURCES[dataset]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown dataset {dataset!r}; valid datasets: {', '.join(DATASETS)}") from None


def check_domain(dataset: str, domain: str) -> None:
    """Raises ValueError (listing the valid domains) if ``domain`` is not in ``dataset``."""
    check_dataset(dataset)
    if domain not in DATASETS[dataset]:
        raise ValueError(f"unknown domain {domain!r} for dataset {dataset!r}; "
                         f"valid domains: {', '.join(DATASETS[dataset])}")


def domain_files(dataset: str, domain: str) -> dict[str, str]:
    """Relative raw paths of one domain, e.g. ``twitch/ENGB/musae_ENGB_edges.csv``.

    Returns:
        ``{"edges": ..., "features": ..., "target": ...}``, POSIX paths relative to
        the raw root (the folder that holds ``twitch/`` and ``wikipedia/``), which
        are also the keys of the checksum table.

    Raises:
        ValueError: unknown dataset or domain.
    """
    check_domain(dataset, domain)
    source = SOURCES[dataset]
    folder = source.raw_folders[domain]
    return {kind: f"{source.top_folder}/{folder}/musae_{folder}_{_SUFFIX[kind]}"
            for kind in FILE_KINDS}


def dataset_files(dataset: str) -> list[str]:
    """All relative raw paths a dataset needs, in domain order (see :func:`domain_files`)."""
    check_dataset(dataset)
    return [path for domain in DATASETS[dataset]
            for path in domain_files(dataset, domain).values()]
