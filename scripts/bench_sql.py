#!/usr/bin/env python3
"""SQL benchmark: hslake (DataFusion) vs DuckDB over the same Parquet shards.

Writes a synthetic dataset with `hslake synth` (unless it exists), then times a metadata query
and a tensor query through `hslake sql` (in-process query time and bytes read, from its
"query done" log line) and the metadata query through DuckDB on the very same shard files.
Usage: .venv/bin/python scripts/bench_sql.py [--samples 1000000] [--dir /tmp/hslake-bench-sql]
"""
import argparse
import json
import os
import pathlib
import platform
import re
import subprocess
import time

import duckdb

ROOT = pathlib.Path(__file__).resolve().parents[1]
HSLAKE = os.environ.get("HSLAKE_BIN", str(ROOT / "target" / "release" / "hslake"))

METADATA = ("SELECT count(*) AS n, avg(seq_len) AS avg_len, sum(num_loss_tokens) AS loss, "
            "count(*) FILTER (WHERE layer_30_max_abs > 50000) AS big FROM samples")
FILTERED = "SELECT count(*) AS n, avg(seq_len) AS avg_len FROM samples WHERE layer_30_max_abs > 50000"
TENSOR = "SELECT avg(tensor_norm(layer_30)) AS mean_norm FROM samples"


def hslake_query(url, q, runs):
    best = None
    for _ in range(runs):
        r = subprocess.run([HSLAKE, "sql", url, q, "--format", "csv"], capture_output=True, text=True,
                           env={**os.environ, "NO_COLOR": "1"})
        r.check_returncode()
        line = [l for l in r.stderr.splitlines() if "query done" in l][-1]
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        ms = int(re.search(r"elapsed_ms=(\d+)", line).group(1))
        read = int(re.search(r"bytes_read=(\d+)", line).group(1))
        if best is None or ms < best[0]:
            best = (ms, read, r.stdout.strip())
    return best


def duck_query(files, q, runs):
    con = duckdb.connect()
    con.execute(f"CREATE VIEW samples AS SELECT * FROM read_parquet({files!r})")
    best = None
    for _ in range(runs):
        t = time.perf_counter()
        res = con.execute(q).fetchall()
        ms = (time.perf_counter() - t) * 1000
        if best is None or ms < best[0]:
            best = (ms, res)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/hslake-bench-sql")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    path = pathlib.Path(a.dir)
    url = f"file://{path}"
    if not (path / "_hslake").exists():
        t = time.time()
        subprocess.run([HSLAKE, "synth", url, "--samples", str(a.samples), "--seq-len", "4:16", "--hidden", "16",
                        "--layers", "2,30", "--seed", "1"], check=True)
        print(f"synth: {time.time() - t:.1f} s")
    manifest = json.loads(sorted((path / "_hslake" / "versions").glob("*.json"))[-1].read_text())
    files = [str(path / s["path"]) for s in manifest["shards"]]
    total = sum(s["bytes"] for s in manifest["shards"])
    samples = sum(s["rows"] for s in manifest["shards"])
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"dataset: {samples} samples, {len(files)} shards, {total / 1e6:.1f} MB")
    rows = []
    for name, q in [("metadata", METADATA), ("metadata, WHERE", FILTERED), ("tensor", TENSOR)]:
        ms, read, out = hslake_query(url, q, a.runs)
        rows.append((name, "hslake", ms, read, out.replace("\n", " | ")))
        if q is not TENSOR:
            # DuckDB cannot decode plane_zstd tensors, so only the metadata queries run there.
            dms, res = duck_query(files, q, a.runs)
            rows.append((name, "duckdb", dms, None, str(res)))
    print(f"| query | engine | time (ms, best of {a.runs}) | bytes read | % of dataset | result |")
    print("|---|---|---|---|---|---|")
    for name, eng, ms, read, out in rows:
        pct = f"{100 * read / total:.3f}%" if read is not None else "n/a"
        rd = f"{read:,}" if read is not None else "n/a"
        print(f"| {name} | {eng} | {ms:.0f} | {rd} | {pct} | {out} |")


if __name__ == "__main__":
    main()
