#!/usr/bin/env python3
"""SQL benchmark: hslake (DataFusion) vs DuckDB over the same Parquet shards.

Writes a synthetic dataset with `hslake synth` (unless it exists), then times the metadata
queries and a tensor query through `hslake sql` (in-process query time and bytes read, from its
"query done" log line) and the metadata queries through DuckDB on the very same shard files.
Each engine is timed twice: "cold", a fresh engine per run (a new `hslake sql` process, a new
DuckDB connection: footers are read and parsed again; the OS page cache is warm for both), and
"warm", the query repeated in one engine (one `hslake sql` session reading statements from stdin,
one DuckDB connection).
Usage: .venv/bin/python benchmarks/cpu/sql.py [--samples 1000000] [--dir /tmp/hslake-bench-sql]
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

ROOT = pathlib.Path(__file__).resolve().parents[2]
HSLAKE = os.environ.get("HSLAKE_BIN", str(ROOT / "target" / "release" / "hslake"))

METADATA = ("SELECT count(*) AS n, avg(seq_len) AS avg_len, sum(num_loss_tokens) AS loss, "
            "count(*) FILTER (WHERE layer_30_max_abs > 50000) AS big FROM samples")
FILTERED = "SELECT count(*) AS n, avg(seq_len) AS avg_len FROM samples WHERE layer_30_max_abs > 50000"
TENSOR = "SELECT avg(tensor_norm(layer_30)) AS mean_norm FROM samples"


def hslake_runs(url, q, runs, warm):
    """(ms, bytes read, output) of every run: one process per run, or all runs in one session."""
    env = {**os.environ, "NO_COLOR": "1"}
    if warm:
        r = subprocess.run([HSLAKE, "sql", url, "--format", "csv"], input=f"{q};\n" * runs,
                           capture_output=True, text=True, env=env)
        r.check_returncode()
        lines = r.stdout.strip().splitlines()
        outs = ["\n".join(lines[: len(lines) // runs])] * runs
        logs = [l for l in r.stderr.splitlines() if "query done" in l]
    else:
        outs, logs = [], []
        for _ in range(runs):
            r = subprocess.run([HSLAKE, "sql", url, q, "--format", "csv"], capture_output=True, text=True,
                               env=env)
            r.check_returncode()
            outs.append(r.stdout.strip())
            logs.append([l for l in r.stderr.splitlines() if "query done" in l][-1])
    res = []
    for line, out in zip(logs, outs):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        ms = int(re.search(r"elapsed_ms=(\d+)", line).group(1))
        read = int(re.search(r"bytes_read=(\d+)", line).group(1))
        res.append((ms, read, out))
    return res


def duck_runs(files, q, runs, warm):
    """(ms, result) of every run: a new connection per run, or all runs on one connection."""
    def connect():
        con = duckdb.connect()
        con.execute(f"CREATE VIEW samples AS SELECT * FROM read_parquet({files!r})")
        return con
    con = connect()
    res = []
    for _ in range(runs):
        if not warm:
            con = connect()
        t = time.perf_counter()
        out = con.execute(q).fetchall()
        res.append(((time.perf_counter() - t) * 1000, out))
    return res


def best_median(ms):
    ms = sorted(ms)
    return ms[0], ms[len(ms) // 2]


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
    print(f"| query | engine | mode | ms, best | ms, median of {a.runs} | bytes read | % of dataset | result |")
    print("|---|---|---|---|---|---|---|---|")
    for name, q in [("metadata", METADATA), ("metadata, WHERE", FILTERED), ("tensor", TENSOR)]:
        for warm in (False, True):
            mode = "warm" if warm else "cold"
            runs = hslake_runs(url, q, a.runs, warm)
            b, m = best_median([r[0] for r in runs])
            read, out = runs[-1][1], runs[-1][2].replace("\n", " ")
            print(f"| {name} | hslake | {mode} | {b:.0f} | {m:.0f} | {read:,} | {100 * read / total:.3f}% | {out} |",
                  flush=True)
            if q is TENSOR:
                # DuckDB cannot decode plane_zstd tensors, so only the metadata queries run there.
                continue
            runs = duck_runs(files, q, a.runs, warm)
            b, m = best_median([r[0] for r in runs])
            print(f"| {name} | duckdb | {mode} | {b:.1f} | {m:.1f} | n/a | n/a | {runs[-1][1]} |", flush=True)


if __name__ == "__main__":
    main()
