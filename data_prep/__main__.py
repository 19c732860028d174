"""Command line: ``python -m data_prep --dataset wikinet [--raw-dir DIR] ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from . import cache, registry


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Prepare the MUSAE Twitch / Wikipedia networks for fedjax-graph: one "
                    "<cache>/<dataset>/<domain>.npz per domain (x float32 [N,128], y int32 [N], "
                    "edge_index int32 [2,E]) plus meta.json. A current cache entry is reused.",
        epilog="Raw files are taken from --raw-dir, else $FEDJAX_GRAPH_RAW, else <cache>/raw, "
               "else the SNAP archive is downloaded into <cache>/raw and verified.")
    parser.add_argument("--dataset", required=True, choices=list(registry.DATASETS),
                        help="twitch: DE, EN, ES, FR, PT, RU; wikinet: chameleon, squirrel, "
                             "crocodile")
    parser.add_argument("--raw-dir", metavar="DIR",
                        help="folder holding the SNAP layout, e.g. DIR/twitch/DE/"
                             "musae_DE_edges.csv (default: $FEDJAX_GRAPH_RAW)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="cache root (default: $FEDJAX_GRAPH_CACHE or ~/.cache/fedjax_graph)")
    parser.add_argument("--base-url", metavar="URL",
                        help="where to download twitch.zip / wikipedia.zip from (default: "
                             "$FEDJAX_GRAPH_BASE_URL or https://snap.stanford.edu/data/)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if the cache entry is current")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check raw files against the sha256 table (custom data)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.cache_dir if args.cache_dir is not None else cache.default_cache_dir()
    meta_path = os.path.join(os.path.expanduser(root), args.dataset, cache.META_NAME)
    # The meta.json mtime tells the user whether this run rebuilt or reused the entry.
    before = os.stat(meta_path).st_mtime_ns if os.path.exists(meta_path) else None
    start = time.perf_counter()
    try:
        out = cache.prepare(args.dataset, raw_dir=args.raw_dir, cache_dir=args.cache_dir,
                            base_url=args.base_url, force=args.force, verify=not args.no_verify)
    except ValueError as err:  # bad data or flags: exit 2, as the experiments' scripts do
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # missing files, no network
        print(f"error: {err}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    after = os.stat(out / cache.META_NAME).st_mtime_ns
    status = "reused" if before == after else "built"
    meta = cache.load_meta(out)
    print(f"{args.dataset}: {status} {out} in {elapsed:.1f} s")
    print(f"{'domain':<10} {'nodes':>7} {'edges':>8}  class shares")
    for domain in meta["domains"]:
        st = meta["domain_stats"][domain]
        shares = " ".join(f"{c / st['num_nodes']:.1%}" for c in st["class_counts"])
        print(f"{domain:<10} {st['num_nodes']:>7} {st['num_edges']:>8}  {shares}")
    print("(edges: directed entries of edge_index, i.e. 2 x undirected edges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

