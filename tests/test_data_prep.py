"""Tests of data_prep: real MUSAE data (skipped if absent), a loopback download, bad inputs."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import pathlib
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp

import data_prep
from data_prep import cache, checksums, download, features, graph, musae, registry
from data_prep.__main__ import main as cli_main

REPO = pathlib.Path(__file__).resolve().parents[1]
RAW = pathlib.Path(os.environ.get("FEDJAX_GRAPH_RAW") or REPO.parent / "shared/datasets/musae")
needs_raw = pytest.mark.skipif(not (RAW / "wikipedia").is_dir() or not (RAW / "twitch").is_dir(),
                               reason=f"raw MUSAE data not found at {RAW}")

WIKI_NODES = {"chameleon": 2277, "squirrel": 5201, "crocodile": 11631}
# FR's target.csv has 6551 rows but lists two users twice; its graph has 6549 nodes.
TWITCH_NODES = {"DE": 9498, "EN": 7126, "ES": 4648, "FR": 6549, "PT": 1912, "RU": 4385}
TWITCH_RAW_ROWS = {"DE": 153138, "EN": 35324, "ES": 59382, "FR": 112666, "PT": 31299, "RU": 37304}


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No test sees the user's raw/cache/base-url settings or writes to ~/.cache."""
    for name in (cache.RAW_ENV, cache.CACHE_ENV, download.BASE_URL_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "default-cache"))
    # The loopback server must never be reached through a proxy.
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def _mtimes(path: pathlib.Path) -> dict[str, tuple[int, int]]:
    # The inode changes on every atomic replace, so this works even with coarse mtimes.
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


def _assert_clean_edges(edge_index: np.ndarray, n: int) -> None:
    assert edge_index.dtype == np.int32 and edge_index.shape[0] == 2
    src, dst = edge_index.astype(np.int64)
    assert src.min() >= 0 and dst.min() >= 0 and src.max() < n and dst.max() < n
    assert not np.any(src == dst), "self-loop"
    key = src * n + dst
    assert np.all(np.diff(key) > 0), "not strictly sorted (duplicates or unsorted)"
    assert np.array_equal(np.sort(dst * n + src), key), "not symmetric"


# --------------------------------------------------------------------------- real data

@pytest.fixture(scope="module")
def wikinet_dir(tmp_path_factory):
    if not (RAW / "wikipedia").is_dir():
        pytest.skip(f"raw MUSAE data not found at {RAW}")
    return data_prep.prepare("wikinet", raw_dir=RAW, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def twitch_dir(tmp_path_factory):
    if not (RAW / "twitch").is_dir():
        pytest.skip(f"raw MUSAE data not found at {RAW}")
    return data_prep.prepare("twitch", raw_dir=RAW, cache_dir=tmp_path_factory.mktemp("cache"))


@needs_raw
def test_wikinet_arrays(wikinet_dir):
    meta = data_prep.load_meta(wikinet_dir)
    assert meta["domains"] == ["chameleon", "squirrel", "crocodile"]
    for domain, n in WIKI_NODES.items():
        d = data_prep.load_domain(wikinet_dir, domain)
        assert d["x"].shape == (n, 128) and d["x"].dtype == np.float32
        assert np.isfinite(d["x"]).all()
        np.testing.assert_allclose(d["x"].mean(0, dtype=np.float64), 0, atol=1e-4)
        np.testing.assert_allclose(d["x"].std(0, dtype=np.float64), 1, atol=1e-3)
        assert d["y"].shape == (n,) and d["y"].dtype == np.int32
        shares = np.bincount(d["y"], minlength=5) / n
        assert set(np.unique(d["y"])) == set(range(5))
        if domain == "crocodile":
            # 1333 pages have traffic exactly 87 = the 20 % quantile; bins are closed on
            # the left, so they all land in class 1 (shares 9.7 % / 30.3 %).
            np.testing.assert_allclose(shares[2:], 0.2, atol=0.02)
            np.testing.assert_allclose(shares[0] + shares[1], 0.4, atol=0.02)
            assert meta["domain_stats"][domain]["label_bin_edges"][0] == 87.0
        else:
            np.testing.assert_allclose(shares, 0.2, atol=0.02)
        _assert_clean_edges(d["edge_index"], n)
        stats = meta["domain_stats"][domain]
        assert stats["num_nodes"] == n and stats["class_counts"] == np.bincount(d["y"]).tolist()
        assert d["edge_index"].shape[1] == stats["num_edges"] == 2 * stats["num_undirected_edges"]
        removed = stats["removed_self_loops"] + stats["removed_duplicate_edges"]
        assert stats["num_undirected_edges"] == stats["raw_edge_rows"] - removed
    # Raw-file facts: wikipedia rows list many edges in both directions and a few self-loops.
    cham = meta["domain_stats"]["chameleon"]
    assert (cham["raw_edge_rows"], cham["removed_self_loops"], cham["num_undirected_edges"]) == (
        36101, 50, 31371)
    assert meta["source_sha256"] == {rel: checksums.FILE_SHA256[rel]
                                     for rel in registry.dataset_files("wikinet")}


@needs_raw
def test_wikinet_is_bit_identical_across_builds(wikinet_dir, tmp_path):
    other = data_prep.prepare("wikinet", raw_dir=RAW, cache_dir=tmp_path)
    for domain in WIKI_NODES:
        a, b = data_prep.load_domain(wikinet_dir, domain), data_prep.load_domain(other, domain)
        for key in ("x", "y", "edge_index"):
            assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key
    assert data_prep.load_meta(other)["recipe"] == data_prep.load_meta(wikinet_dir)["recipe"]


@needs_raw
def test_wikinet_cache_is_reused_without_raw_files(wikinet_dir, tmp_path):
    before = _mtimes(wikinet_dir)
    # A raw dir that does not exist proves no raw file is read for a current entry.
    again = data_prep.prepare("wikinet", raw_dir=tmp_path / "nowhere",
                              cache_dir=wikinet_dir.parent)
    assert again == wikinet_dir and _mtimes(wikinet_dir) == before


@needs_raw
def test_twitch_arrays(twitch_dir):
    meta = data_prep.load_meta(twitch_dir)
    assert meta["domains"] == list(data_prep.DATASETS["twitch"])
    xs = []
    for domain, n in TWITCH_NODES.items():
        d = data_prep.load_domain(twitch_dir, domain)
        stats = meta["domain_stats"][domain]
        assert d["x"].shape == (n, 128) and d["x"].dtype == np.float32
        assert np.isfinite(d["x"]).all()
        assert d["y"].dtype == np.int32 and set(np.unique(d["y"])) == {0, 1}
        _assert_clean_edges(d["edge_index"], n)
        assert stats["raw_edge_rows"] == TWITCH_RAW_ROWS[domain]
        removed = stats["removed_self_loops"] + stats["removed_duplicate_edges"]
        assert d["edge_index"].shape[1] == 2 * (TWITCH_RAW_ROWS[domain] - removed)
        xs.append(d["x"])
    assert meta["domain_stats"]["FR"]["removed_duplicate_target_rows"] == 2
    assert meta["feature_fits"][0]["vocab_size"] == 3170
    assert meta["feature_fits"][0]["domains"] == list(TWITCH_NODES)
    # One pooled standardisation: pooled moments are 0/1 while countries keep their shift.
    pooled = np.concatenate(xs).astype(np.float64)
    np.testing.assert_allclose(pooled.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(pooled.std(0), 1, atol=1e-3)
    country_means = np.stack([x.mean(0) for x in xs])
    assert np.abs(country_means).max() > 0.1


@needs_raw
def test_corrupt_or_missing_raw_file_is_named(tmp_path):
    raw = tmp_path / "raw"
    for rel in registry.dataset_files("wikinet"):
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        (raw / rel).symlink_to(RAW / rel)
    bad = "wikipedia/squirrel/musae_squirrel_target.csv"
    (raw / bad).unlink()
    (raw / bad).write_bytes((RAW / bad).read_bytes().replace(b"\n1,", b"\n1,9", 1))
    with pytest.raises(checksums.ChecksumError, match=bad) as err:
        data_prep.prepare("wikinet", raw_dir=raw, cache_dir=tmp_path / "cache")
    assert "--no-verify" in str(err.value)  # the way out for data changed on purpose
    (raw / bad).unlink()
    with pytest.raises(FileNotFoundError, match=bad):
        data_prep.prepare("wikinet", raw_dir=raw, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "wikinet").exists()


# --------------------------------------------------------------------------- fake data

def _fake_domain(folder: pathlib.Path, stem: str, dataset: str, seed: int,
                 n: int = 12, no_features: tuple[int, ...] = ()) -> None:
    """Writes a tiny MUSAE-layout domain: a ring plus a self-loop and duplicate rows."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    edges = [(i, (i + 1) % n) for i in range(n)] + [(3, 3), (0, 1), (1, 0), (2, 5)]
    cols = ("from", "to") if dataset == "twitch" else ("id1", "id2")
    (folder / f"{stem}_edges.csv").write_text(
        ",".join(cols) + "\n" + "".join(f"{u},{v}\n" for u, v in edges))
    feats = {str(i): [int(v) for v in rng.integers(0, 20, 6)] + [int(i) % 3, int(i) % 3]
             for i in rng.permutation(n).tolist() if i not in no_features}
    (folder / f"{stem}_features.json").write_text(json.dumps(feats))
    order = rng.permutation(n).tolist()  # rows not in id order, as in the Twitch release
    if dataset == "twitch":
        rows = [f"{1000 + i},100,{'True' if i % 2 else 'False'},5,False,{i}" for i in order]
        text = "id,days,mature,views,partner,new_id\n" + "\n".join(rows) + "\n"
    else:
        text = "id,target\n" + "".join(f"{i},{10 * i + 3}\n" for i in order)
    (folder / f"{stem}_target.csv").write_text(text)


def _fake_raw(root: pathlib.Path, dataset: str) -> dict[str, str]:
    """Writes a fake SNAP layout for every domain of ``dataset``; returns its sha table."""
    source = registry.SOURCES[dataset]
    for k, (domain, folder) in enumerate(source.raw_folders.items()):
        _fake_domain(root / source.top_folder / folder, f"musae_{folder}", dataset, seed=k,
                     n=10 + k, no_features=(4, 7) if domain in ("FR", "squirrel") else ())
    return {rel: checksums.sha256_file(root / rel) for rel in registry.dataset_files(dataset)}


def _zip(raw_root: pathlib.Path, dataset: str, dest: pathlib.Path, drop: str | None = None) -> str:
    top = registry.SOURCES[dataset].top_folder
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w") as zf:
        for path in sorted((raw_root / top).rglob("*")):
            rel = path.relative_to(raw_root).as_posix()
            if path.is_file() and rel != drop:
                zf.write(path, rel)
        zf.writestr("__MACOSX/._junk", b"ignored")
    return hashlib.sha256(dest.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A loopback HTTP server (127.0.0.1 only) serving a temp folder; counts GETs."""
    root = tmp_path_factory.mktemp("www")
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}", hits
    httpd.shutdown()
    httpd.server_close()


def _publish(server, tmp_path, name: str, dataset: str = "wikinet", drop=None):
    """Builds a fake archive under ``<www>/<name>/``; returns (base_url, table, archive sha)."""
    root, url, _ = server
    table = _fake_raw(tmp_path / "src", dataset)
    archive = registry.SOURCES[dataset].archive
    sha = _zip(tmp_path / "src", dataset, root / name / archive, drop=drop)
    return f"{url}/{name}", table, sha


def _leftovers(cache_dir: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(cache_dir).as_posix() for p in cache_dir.rglob("*")) \
        if cache_dir.exists() else []


@pytest.mark.parametrize("dataset", ["wikinet", "twitch"])
def test_download_unpack_and_prepare(server, tmp_path, monkeypatch, dataset):
    base, table, sha = _publish(server, tmp_path, f"ok-{dataset}", dataset)
    archive = registry.SOURCES[dataset].archive
    monkeypatch.setattr(checksums, "FILE_SHA256", table)
    monkeypatch.setattr(checksums, "ARCHIVE_SHA256", {archive: sha})
    hits = server[2]
    n_hits = len(hits)
    cache_dir = tmp_path / "cache"
    out = data_prep.prepare(dataset, cache_dir=cache_dir, base_url=base)
    assert hits[n_hits:] == [f"/ok-{dataset}/{archive}"]
    top = registry.SOURCES[dataset].top_folder
    # Only verified files under their final names; archive and temp files are gone.
    assert sorted(p.name for p in (cache_dir / "raw").iterdir()) == [top]
    assert not (cache_dir / "raw" / "__MACOSX").exists()
    meta = data_prep.load_meta(out)
    for k, domain in enumerate(data_prep.DATASETS[dataset]):
        d = data_prep.load_domain(out, domain)
        n = 10 + k
        assert d["x"].shape == (n, 128) and d["x"].dtype == np.float32 and np.isfinite(d["x"]).all()
        assert d["y"].shape == (n,) and d["y"].dtype == np.int32
        _assert_clean_edges(d["edge_index"], n)
        stats = meta["domain_stats"][domain]
        # Ring of n edges + (3,3) loop + (0,1),(1,0) duplicates of ring edge 0-1; (2,5) new.
        assert (stats["removed_self_loops"], stats["removed_duplicate_edges"]) == (1, 2)
        assert stats["num_edges"] == 2 * (n + 1)
    if dataset == "twitch":
        assert meta["feature_fits"][0]["domains"] == list(data_prep.DATASETS["twitch"])
        fr = data_prep.load_domain(out, "FR")["x"]
        assert meta["domain_stats"]["FR"]["nodes_without_features"] == 2
        assert np.array_equal(fr[4], fr[7])  # both were zero rows before the shared map
    else:
        assert len(meta["feature_fits"]) == 3
    # Second call: cache reused, no new request even without a raw dir.
    before = _mtimes(out)
    data_prep.prepare(dataset, cache_dir=cache_dir, base_url=base)
    assert len(hits) == n_hits + 1 and _mtimes(out) == before
    # Without the prepared entry it is rebuilt from <cache>/raw, again without a download.
    for path in out.iterdir():
        path.unlink()
    data_prep.prepare(dataset, cache_dir=cache_dir, base_url=base)
    assert len(hits) == n_hits + 1 and sorted(_mtimes(out)) == sorted(before)


def test_download_archive_checksum_mismatch(server, tmp_path):
    base, table, _ = _publish(server, tmp_path, "badzip")
    raw = tmp_path / "cache" / "raw"
    with pytest.raises(checksums.ChecksumError, match="wikipedia.zip"):
        download.download_raw("wikinet", raw, base, checksums=table,
                              archive_checksums={"wikipedia.zip": "0" * 64}, progress=False)
    assert _leftovers(raw) == []


def test_download_file_checksum_mismatch(server, tmp_path):
    base, table, _ = _publish(server, tmp_path, "badfile")
    bad = "wikipedia/crocodile/musae_crocodile_edges.csv"
    table = {**table, bad: "f" * 64}
    raw = tmp_path / "cache" / "raw"
    with pytest.raises(checksums.ChecksumError, match=bad):
        download.download_raw("wikinet", raw, base, checksums=table, archive_checksums={},
                              progress=False)
    assert _leftovers(raw) == []


def test_download_missing_file_in_archive(server, tmp_path):
    missing = "wikipedia/squirrel/musae_squirrel_features.json"
    base, table, _ = _publish(server, tmp_path, "missing", drop=missing)
    raw = tmp_path / "cache" / "raw"
    with pytest.raises(FileNotFoundError, match=missing):
        download.download_raw("wikinet", raw, base, checksums=table, archive_checksums={},
                              progress=False)
    assert _leftovers(raw) == []


def test_failed_download_leaves_no_cache_entry(server, tmp_path, monkeypatch):
    base, table, _ = _publish(server, tmp_path, "prep-fail")
    monkeypatch.setattr(checksums, "FILE_SHA256", table)
    monkeypatch.setattr(checksums, "ARCHIVE_SHA256", {"wikipedia.zip": "0" * 64})
    cache_dir = tmp_path / "cache"
    with pytest.raises(checksums.ChecksumError, match="wikipedia.zip"):
        data_prep.prepare("wikinet", cache_dir=cache_dir, base_url=base)
    assert _leftovers(cache_dir) == ["raw"]
    # A 404 names the URL and leaves nothing either.
    with pytest.raises(ConnectionError, match="nothere/wikipedia.zip"):
        data_prep.prepare("wikinet", cache_dir=cache_dir, base_url=f"{server[1]}/nothere/")
    assert _leftovers(cache_dir) == ["raw"]
    # No server at all: the message names the flag that avoids the download.
    with pytest.raises(ConnectionError, match="--raw-dir"):
        data_prep.prepare("wikinet", cache_dir=cache_dir, base_url="http://127.0.0.1:1/")
    assert _leftovers(cache_dir) == ["raw"]


def test_base_url_from_env(monkeypatch):
    assert download.resolve_base_url() == "https://snap.stanford.edu/data/"
    monkeypatch.setenv("FEDJAX_GRAPH_BASE_URL", "http://127.0.0.1:1/mirror")
    assert download.resolve_base_url() == "http://127.0.0.1:1/mirror/"
    assert download.resolve_base_url("http://127.0.0.1:2/x/") == "http://127.0.0.1:2/x/"


# --------------------------------------------------------------------------- cache logic

def test_recipe_change_or_raw_edit_rebuilds(tmp_path, monkeypatch):
    _fake_raw(tmp_path / "raw", "wikinet")
    monkeypatch.setenv("FEDJAX_GRAPH_RAW", str(tmp_path / "raw"))  # raw dir from the env
    out = data_prep.prepare("wikinet", verify=False)
    assert out == tmp_path / "default-cache" / "wikinet"
    first = _mtimes(out)
    assert _mtimes(data_prep.prepare("wikinet", verify=False)) == first
    monkeypatch.setattr(cache, "FORMAT_VERSION", cache.FORMAT_VERSION + 1)
    second = _mtimes(data_prep.prepare("wikinet", verify=False))
    assert all(second[k] != first[k] for k in first)
    assert data_prep.load_meta(out)["recipe"]["format_version"] == cache.FORMAT_VERSION
    # Custom data: the recorded hashes change when a raw file does.
    target = tmp_path / "raw/wikipedia/chameleon/musae_chameleon_target.csv"
    target.write_text(target.read_text().replace(",13\n", ",14\n"))
    assert _mtimes(data_prep.prepare("wikinet", verify=False)) != second
    # force rebuilds a current entry.
    third = _mtimes(out)
    assert _mtimes(data_prep.prepare("wikinet", verify=False, force=True)) != third


def test_interrupted_rebuild_is_not_taken_as_current(tmp_path, monkeypatch):
    _fake_raw(tmp_path / "raw", "wikinet")
    kwargs = dict(raw_dir=tmp_path / "raw", cache_dir=tmp_path / "c", verify=False)
    out = data_prep.prepare("wikinet", **kwargs)
    calls = []

    def failing_savez(f, **arrays):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        np.savez(f, **arrays)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(np, "savez", failing_savez)
        data_prep.prepare("wikinet", force=True, **kwargs)
    assert not (out / "meta.json").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # temp file removed
    data_prep.prepare("wikinet", **kwargs)
    assert (out / "meta.json").exists()


def test_verify_rejects_custom_data(tmp_path):
    _fake_raw(tmp_path / "raw", "wikinet")
    with pytest.raises(checksums.ChecksumError, match="musae_chameleon_edges.csv"):
        data_prep.prepare("wikinet", raw_dir=tmp_path / "raw", cache_dir=tmp_path / "c")


def test_cli_summary(tmp_path, capsys):
    _fake_raw(tmp_path / "raw", "twitch")
    args = ["--dataset", "twitch", "--raw-dir", str(tmp_path / "raw"),
            "--cache-dir", str(tmp_path / "c"), "--no-verify"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "built" in out and "FR" in out and "50.0%" in out
    # Readable like any file (mkstemp's 0600 is not kept), the metadata too.
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "c" / "twitch").iterdir()} == {0o644}
    assert cli_main(args) == 0
    assert "reused" in capsys.readouterr().out
    assert cli_main(["--dataset", "twitch", "--raw-dir", str(tmp_path / "nope"),
                     "--cache-dir", str(tmp_path / "c2")]) == 1
    assert "musae_DE_edges.csv" in capsys.readouterr().err
    # Bad data is exit 2, as in the experiments' scripts.
    (tmp_path / "raw" / "twitch" / "FR" / "musae_FR_target.csv").write_text("id,mature\n0,x\n")
    assert cli_main(args + ["--force"]) == 2
    # The last line (a script run before may have routed the "building ..." log to stderr).
    assert capsys.readouterr().err.splitlines()[-1].startswith("python -m data_prep: error: ")


def test_unknown_names_list_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="twitch, wikinet"):
        data_prep.prepare("cora", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="chameleon, squirrel, crocodile"):
        registry.check_domain("wikinet", "cora")
    _fake_raw(tmp_path / "raw", "wikinet")
    out = data_prep.prepare("wikinet", raw_dir=tmp_path / "raw", cache_dir=tmp_path, verify=False)
    with pytest.raises(ValueError, match="chameleon, squirrel, crocodile"):
        data_prep.load_domain(out, "DE")
    with pytest.raises(FileNotFoundError, match="prepare"):
        data_prep.load_meta(tmp_path / "empty")


def test_a_damaged_prepared_file_is_named(tmp_path):
    _fake_raw(tmp_path / "raw", "wikinet")
    out = data_prep.prepare("wikinet", raw_dir=tmp_path / "raw", cache_dir=tmp_path, verify=False)
    path = out / "squirrel.npz"
    path.write_bytes(path.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(ValueError, match=r"squirrel.npz: damaged prepared file \(BadZipFile.*"
                                         r"python -m data_prep --dataset wikinet --force"):
        data_prep.load_domain(out, "squirrel")
    assert data_prep.load_domain(out, "chameleon")["x"].shape[1] == 128
    # prepare() (every run calls it) sees the damage and rebuilds the entry from the raw files.
    assert data_prep.prepare("wikinet", raw_dir=tmp_path / "raw", cache_dir=tmp_path,
                             verify=False) == out
    assert data_prep.load_domain(out, "squirrel")["x"].shape[1] == 128


def test_public_api_and_no_jax():
    assert data_prep.DATASETS == {"twitch": ("DE", "EN", "ES", "FR", "PT", "RU"),
                                  "wikinet": ("chameleon", "squirrel", "crocodile")}
    assert registry.domain_files("twitch", "EN")["edges"] == "twitch/ENGB/musae_ENGB_edges.csv"
    assert data_prep.default_cache_dir().name == "default-cache"  # from the env (fixture)
    assert len(checksums.FILE_SHA256) == 27
    code = "import sys, data_prep; assert 'jax' not in sys.modules, 'data_prep imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --------------------------------------------------------------------------- bad inputs

def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    return path


def test_bad_edges(tmp_path):
    with pytest.raises(ValueError, match=r"edges\.csv: missing column\(s\) 'to'"):
        musae.read_edges(_write(tmp_path / "edges.csv", "from,too\n0,1\n"), ("from", "to"), 3)
    with pytest.raises(ValueError, match=r"line 3: column 'to' holds a non-numeric id 'x7'"):
        musae.read_edges(_write(tmp_path / "edges.csv", "from,to\n0,1\n1,x7\n"), ("from", "to"), 3)
    with pytest.raises(ValueError, match=r"line 2: edge \(0, 3\) points outside .*\[0, 3\)"):
        musae.read_edges(_write(tmp_path / "edges.csv", "from,to\n0,3\n"), ("from", "to"), 3)
    with pytest.raises(ValueError, match="line 2: expected 2 fields"):
        musae.read_edges(_write(tmp_path / "edges.csv", "from,to\n0\n"), ("from", "to"), 3)


def test_bad_targets(tmp_path):
    path = tmp_path / "target.csv"
    with pytest.raises(ValueError, match="missing column.*'mature'"):
        musae.read_target(_write(path, "new_id,adult\n0,True\n"), "new_id", "mature",
                          musae.parse_mature)
    with pytest.raises(ValueError, match=r"must hold exactly the ids 0\.\.1 .*absent: \[1\]"):
        musae.read_target(_write(path, "new_id,mature\n0,True\n2,False\n"), "new_id", "mature",
                          musae.parse_mature)
    with pytest.raises(ValueError, match="line 3: bad 'mature' value"):
        musae.read_target(_write(path, "new_id,mature\n0,True\n1,maybe\n"), "new_id", "mature",
                          musae.parse_mature)
    with pytest.raises(ValueError, match="non-numeric id 'a'"):
        musae.read_target(_write(path, "id,target\na,5\n"), "id", "target", musae.parse_traffic)
    with pytest.raises(ValueError, match="appears again with a different 'mature'"):
        musae.read_target(_write(path, "new_id,mature\n0,True\n1,True\n0,False\n"), "new_id",
                          "mature", musae.parse_mature)
    # A repeated row with the same label is dropped and counted (Twitch FR has two).
    values, dups = musae.read_target(_write(path, "new_id,mature\n1,True\n0,False\n1,True\n"),
                                     "new_id", "mature", musae.parse_mature)
    assert values.tolist() == [0.0, 1.0] and dups == 1


def test_bad_features(tmp_path):
    path = tmp_path / "features.json"
    with pytest.raises(ValueError, match="non-numeric node id 'a'"):
        musae.read_features(_write(path, '{"a": [1]}'), 2)
    with pytest.raises(ValueError, match="node id '5' is outside"):
        musae.read_features(_write(path, '{"5": [1]}'), 2)
    with pytest.raises(ValueError, match="list of non-negative integer"):
        musae.read_features(_write(path, '{"0": [1, "2"]}'), 2)
    with pytest.raises(ValueError, match="expected a JSON object"):
        musae.read_features(_write(path, "[1, 2]"), 2)
    nodes, ids, without = musae.read_features(_write(path, '{"1": [3, 3, 0]}'), 3)
    assert nodes.tolist() == [1, 1, 1] and ids.tolist() == [3, 3, 0] and without == 2


def test_clean_edges_counts():
    raw = np.array([[0, 1], [1, 0], [2, 2], [1, 2], [0, 1], [3, 0]])
    edge_index, stats = graph.clean_edges(raw, 4)
    assert edge_index.tolist() == [[0, 0, 1, 1, 2, 3], [1, 3, 0, 2, 1, 0]]
    assert stats == {"raw_edge_rows": 6, "removed_self_loops": 1, "removed_duplicate_edges": 2,
                     "num_undirected_edges": 3, "num_edges": 6}


def test_traffic_bins_closed_on_the_left():
    y, edges = musae.traffic_bins(np.array([1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 9, 10.0]))
    assert y.dtype == np.int32
    assert np.array_equal(y, np.digitize([1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 9, 10], edges))
    assert y[np.flatnonzero(np.isclose([1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 9, 10], edges[1]))].min() == 2


def test_svd_is_deterministic_and_solvers_agree():
    rng = np.random.default_rng(1)
    x = features.binary_matrix(rng.integers(0, 400, 4000), rng.integers(0, 300, 4000), 400, 300)
    assert x.max() == 1.0  # repeated (node, id) pairs count once
    v1, s1, solver = features.truncated_svd(x, 10)
    v2, s2, _ = features.truncated_svd(x, 10)
    assert solver == "arpack" and v1.tobytes() == v2.tobytes() and s1.tobytes() == s2.tobytes()
    full_v, full_s = features._gram_svd(sp.csr_matrix(x))
    order = np.argsort(-full_s)[:10]
    ref = full_v[:, order] * np.sign(full_v[np.abs(full_v[:, order]).argmax(0), order])
    np.testing.assert_allclose(s1, full_s[order], rtol=1e-8)
    np.testing.assert_allclose(v1, ref, atol=1e-6)
    # Fewer components than asked: zero padding, zero std guarded.
    small = features.binary_matrix(np.array([0, 1, 2]), np.array([0, 1, 1]), 3, 2)
    (z,), info = features.reduce_features([small], dim=8)
    assert z.shape == (3, 8) and np.isfinite(z).all() and not z[:, 2:].any()
    assert info["solver"] == "gram"
