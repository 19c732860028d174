"""Download, verify and unpack the SNAP archives into ``<cache>/raw``.

Nothing unverified ever appears under its final name: an archive is streamed
to a temporary file next to its destination and renamed only after its hash
checks out (when one is known), and it is unpacked into a temporary folder
whose data files are all verified before the folder is renamed into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from typing import Mapping

from tqdm import tqdm

from . import checksums as _checksums
from . import registry

__all__ = ["DEFAULT_BASE_URL", "BASE_URL_ENV", "resolve_base_url", "fetch", "unpack",
           "download_raw"]

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://snap.stanford.edu/data/"
BASE_URL_ENV = "FEDJAX_GRAPH_BASE_URL"
_CHUNK = 1 << 16


def resolve_base_url(base_url: str | None = None) -> str:
    """Returns ``base_url``, else env ``FEDJAX_GRAPH_BASE_URL``, else the SNAP URL; ends in '/'."""
    url = base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL
    return url if url.endswith("/") else url + "/"


def fetch(url: str, dest: str | os.PathLike, expected_sha256: str | None = None,
          progress: bool = True, timeout: float = 60.0) -> pathlib.Path:
    """Downloads ``url`` to ``dest`` atomically, with a tqdm progress bar.

    The bytes go to a temporary file in ``dest``'s folder, which is hashed and
    renamed to ``dest`` only when complete and (if ``expected_sha256`` is given)
    matching; on any failure the temporary file is removed.

    Returns:
        ``dest`` as a Path.

    Raises:
        ConnectionError: the server could not be reached or answered with an
            HTTP error (e.g. 404); the message names the URL.
        ChecksumError: the downloaded bytes do not match ``expected_sha256``.
    """
    dest = pathlib.Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = pathlib.Path(tmp_name)
    try:
        digest = hashlib.sha256()
        try:
            response = urllib.request.urlopen(url, timeout=timeout)
        except urllib.error.HTTPError as err:
            raise ConnectionError(
                f"download of {url} failed: HTTP {err.code} {err.reason}") from err
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(
                f"download of {url} failed: {getattr(err, 'reason', err)} (no internet? pass "
                "--raw-dir or set FEDJAX_GRAPH_RAW to a local copy of the SNAP files)") from err
        with response, os.fdopen(fd, "wb") as out:
            fd = None
            total = response.headers.get("Content-Length")
            with tqdm(total=int(total) if total else None, unit="B", unit_scale=True,
                      unit_divisor=1024, desc=dest.name, disable=not progress) as bar:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if total and tmp.stat().st_size != int(total):
            raise ConnectionError(f"download of {url} was cut short: got {tmp.stat().st_size} "
                                  f"of {total} bytes")
        if expected_sha256 is not None and digest.hexdigest() != expected_sha256.lower():
            raise _checksums.ChecksumError(
                f"checksum mismatch for {dest.name} downloaded from {url}: expected sha256 "
                f"{expected_sha256}, got {digest.hexdigest()}")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, dest)
        return dest
    finally:
        if fd is not None:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def unpack(archive: str | os.PathLike, raw_root: str | os.PathLike, top_folder: str,
           relpaths: list[str], checksums: Mapping[str, str]) -> pathlib.Path:
    """Unpacks ``top_folder/`` of a zip archive into ``raw_root`` after verifying it.

    Only members under ``top_folder/`` are extracted (SNAP zips may carry other
    entries). They go to a temporary folder inside ``raw_root``; every path in
    ``relpaths`` must be present there and match ``checksums`` before the
    folder is renamed to ``raw_root/top_folder`` (replacing an older copy).

    Returns:
        ``raw_root / top_folder``.

    Raises:
        FileNotFoundError: a required file is not in the archive (named).
        ChecksumError: an unpacked file does not match its sha256 (named).
        zipfile.BadZipFile: the archive is not a valid zip file.
    """
    raw_root = pathlib.Path(raw_root)
    raw_root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=raw_root, prefix=f".{top_folder}.unpack-"))
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [m for m in zf.namelist()
                       if m.startswith(top_folder + "/") and ".." not in m.split("/")]
            names = set(members)
            absent = [rel for rel in relpaths if rel not in names]
            if absent:
                raise FileNotFoundError(
                    f"{pathlib.Path(archive).name} lacks {', '.join(absent[:5])}"
                    f"{' and more' if len(absent) > 5 else ''}")
            zf.extractall(staging, members=members)
        for rel in relpaths:
            _checksums.verify_file(staging / rel, checksums[rel],
                                   f"{rel} (from {pathlib.Path(archive).name})")
        final = raw_root / top_folder
        if final.exists():
            # A folder cannot be renamed over a non-empty one: move the stale copy
            # into the staging folder, which is deleted below.
            os.replace(final, staging / ".stale")
        os.replace(staging / top_folder, final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_raw(dataset: str, raw_root: str | os.PathLike, base_url: str | None = None, *,
                 checksums: Mapping[str, str] | None = None,
                 archive_checksums: Mapping[str, str] | None = None,
                 progress: bool = True, timeout: float = 60.0) -> pathlib.Path:
    """Downloads and unpacks the SNAP archive of ``dataset`` into ``raw_root``.

    A verified archive left by an interrupted earlier run (``raw_root/<archive>``)
    is reused instead of downloaded again; after a successful unpack the archive
    is deleted, since the verified files are the cache entry. If unpacking or
    verification fails the archive is deleted too, so the next run downloads
    afresh, and no ``raw_root/<top_folder>`` is created.

    Args:
        dataset: ``"twitch"`` or ``"wikinet"``.
        raw_root: Destination, normally ``<cache>/raw``.
        base_url: Server folder holding ``twitch.zip``/``wikipedia.zip``; default
            from :func:`resolve_base_url`.
        checksums: ``{relpath: sha256}`` of the data files; default the project
            table (tests inject their own).
        archive_checksums: ``{archive name: sha256}``; default the known ones.
        progress: Show a tqdm progress bar.
        timeout: Socket timeout in seconds.

    Returns:
        ``raw_root``, now holding ``<top_folder>/...`` with every file verified.

    Raises:
        ValueError: unknown dataset.
        ConnectionError: the download failed (URL named).
        ChecksumError: the archive or a file in it has the wrong sha256 (named).
        FileNotFoundError: the archive lacks a required file (named).
    """
    source = registry.check_dataset(dataset)
    table = _checksums.FILE_SHA256 if checksums is None else checksums
    archives = _checksums.ARCHIVE_SHA256 if archive_checksums is None else archive_checksums
    raw_root = pathlib.Path(raw_root)
    relpaths = registry.dataset_files(dataset)
    missing_sums = [rel for rel in relpaths if rel not in table]
    if missing_sums:
        raise ValueError(f"no sha256 known for {missing_sums[:5]}")
    archive = raw_root / source.archive
    if archive.is_file() and (source.archive not in archives
                              or _checksums.sha256_file(archive) == archives[source.archive]):
        log.info("reusing downloaded %s", archive)
    else:
        url = resolve_base_url(base_url) + source.archive
        log.info("downloading %s", url)
        fetch(url, archive, archives.get(source.archive), progress=progress, timeout=timeout)
    try:
        unpack(archive, raw_root, source.top_folder, relpaths, table)
    finally:
        archive.unlink(missing_ok=True)
    return raw_root
