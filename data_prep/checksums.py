"""sha256 table of the raw MUSAE files and verification against it.

The table is the file ``SHA256SUMS`` next to this module (``sha256sum`` format,
paths relative to the raw root), read once at import. Archive checksums are
kept separately because only the Wikipedia archive's hash is published.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
from types import MappingProxyType
from typing import Iterable, Mapping

__all__ = ["ChecksumError", "FILE_SHA256", "ARCHIVE_SHA256", "parse_sha256sums",
           "sha256_file", "verify_file", "verify_files", "require_files", "hash_files"]

SHA256SUMS_PATH = pathlib.Path(__file__).with_name("SHA256SUMS")

_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class ChecksumError(ValueError):
    """A file's sha256 differs from the expected value (corrupt or different data)."""


def parse_sha256sums(text: str, source: str = "SHA256SUMS") -> dict[str, str]:
    """Parses ``sha256sum`` output (``<hex>  <path>`` per line) into ``{path: hex}``.

    Raises:
        ValueError: a non-blank line is not in that format (names ``source`` and the line).
    """
    table = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.match(line.rstrip())
        if match is None:
            raise ValueError(f"{source}, line {lineno}: expected '<sha256>  <path>', got {line!r}")
        table[match.group(2)] = match.group(1).lower()
    return table


FILE_SHA256: Mapping[str, str] = MappingProxyType(
    parse_sha256sums(SHA256SUMS_PATH.read_text(encoding="utf-8"), str(SHA256SUMS_PATH)))
"""Relative raw path (e.g. ``twitch/DE/musae_DE_edges.csv``) -> sha256 hex digest."""

ARCHIVE_SHA256: Mapping[str, str] = MappingProxyType({
    # Published in the datasets README; SNAP publishes no hash for twitch.zip, whose
    # contents are still checked file by file after unpacking.
    "wikipedia.zip": "aeef409fca6b08abe9e3751bf41839b2544d499f0eca174701f87c9f93c71b86",
})
"""Archive file name -> sha256 hex digest, where known."""


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Returns the sha256 hex digest of a file, read in chunks.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: str | os.PathLike, expected: str, label: str | None = None) -> None:
    """Checks one file against an expected sha256.

    Args:
        path: File to hash.
        expected: Expected hex digest.
        label: Name used in the error message (default: ``path``).

    Raises:
        FileNotFoundError: the file is missing.
        ChecksumError: the digest differs.
    """
    label = label or str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file {label} (looked for {path})")
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(f"checksum mismatch for {label}: expected sha256 {expected}, "
                            f"got {actual} (file at {path} is corrupt or not the SNAP release; "
                            "for other data on purpose, pass --no-verify)")


def verify_files(root: str | os.PathLike, relpaths: Iterable[str],
                 table: Mapping[str, str] | None = None) -> dict[str, str]:
    """Checks raw files under ``root`` against the checksum table.

    All files are checked for existence before any is hashed, so a missing
    file is reported even when another one is also corrupt.

    Args:
        root: Raw root folder (holds ``twitch/`` and/or ``wikipedia/``).
        relpaths: POSIX paths relative to ``root``.
        table: ``{relpath: sha256}``; default :data:`FILE_SHA256`.

    Returns:
        ``{relpath: sha256}`` of the verified files.

    Raises:
        FileNotFoundError: files are missing (all are named, up to five).
        ChecksumError: a file's digest differs (the file is named).
        ValueError: the table has no entry for a path.
    """
    table = FILE_SHA256 if table is None else table
    root = pathlib.Path(root)
    relpaths = list(relpaths)
    unknown = [rel for rel in relpaths if rel not in table]
    if unknown:
        raise ValueError(f"no sha256 known for {unknown[:5]}; pass --no-verify to use custom data")
    require_files(root, relpaths)
    for rel in relpaths:
        verify_file(root / rel, table[rel], rel)
    return {rel: table[rel].lower() for rel in relpaths}


def require_files(root: str | os.PathLike, relpaths: Iterable[str]) -> None:
    """Raises FileNotFoundError naming the missing files (up to five) under ``root``."""
    root = pathlib.Path(root)
    relpaths = list(relpaths)
    missing = [rel for rel in relpaths if not (root / rel).is_file()]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise FileNotFoundError(
            f"missing raw file(s) under {root}: {', '.join(missing[:5])}{more} "
            f"(the raw folder must hold the SNAP archive layout, e.g. <raw>/{relpaths[0]})")


def hash_files(root: str | os.PathLike, relpaths: Iterable[str]) -> dict[str, str]:
    """Returns ``{relpath: sha256}`` of existing files (custom data, no table).

    Raises:
        FileNotFoundError: files are missing.
    """
    relpaths = list(relpaths)
    require_files(root, relpaths)
    return {rel: sha256_file(pathlib.Path(root) / rel) for rel in relpaths}
