#!/usr/bin/env python3
"""One node against two workers: `hslake sql` alone and `hslake sql --workers` over two
`hslake serve-sql --worker` processes on 127.0.0.1, on a dataset larger than one query's
memory pool (--query-memory, on the node and on each worker).

Writes a synthetic dataset with `hslake synth` (unless it exists), starts the workers, then runs
each query --runs times each way, alternating, and checks both ways give the same rows (floats
to 9 significant digits). The queries read every tensor of the dataset (a norm aggregate per
layer) or group by sample, so their state grows with the dataset. Prints one JSON object with
the wall times (best and median, seconds), the dataset's size and the pool; the workers are
stopped at the end.
Usage: .venv/bin/python benchmarks/cpu/distributed_sql.py [--samples 6000] [--hidden 1024]
       [--query-memory 256MiB] [--runs 3] [--dir /tmp/hslake-distributed-sql]
"""
import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import time

# The binary: HSLAKE_BIN, else the release build of this checkout.
HSLAKE = os.environ.get("HSLAKE_BIN") or str(
    pathlib.Path(__file__).resolve().parents[2] / "target" / "release" / "hslake")

QUERIES = [
    ("norm per layer", "SELECT avg(tensor_norm(layer_2)) AS l2, avg(tensor_norm(layer_30)) AS l30 FROM samples"),
    # Ordered to the last column: groups tie on n, and LIMIT over a tie is any of them.
    ("group by sample", "SELECT sample_id % 4096 AS g, count(*) AS n, max(c) AS m FROM (SELECT sample_id, cosine_similarity(layer_2, layer_30) AS c FROM samples) GROUP BY sample_id % 4096 ORDER BY n DESC, g LIMIT 3"),
]


def start_worker(token_file, memory, root):
    p = subprocess.Popen(
        [HSLAKE, "serve-sql", "--worker", "--bind", "127.0.0.1:0", "--token-file", token_file,
         "--query-memory", memory, "--allowed-root", root],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "HSLAKE_LOG": "info", "NO_COLOR": "1"})
    for line in p.stderr:
        if "worker listening" in line:
            addr = line.split("addr=")[1].split()[0]
            return p, f"http://{addr}"
    raise SystemExit("worker did not start")


def rows(out):
    def cell(c):
        try:
            return f"{float(c):.9g}" if "." in c or "e" in c else c
        except ValueError:
            return c
    return [",".join(cell(c) for c in line.split(",")) for line in out.splitlines()]


def run(args):
    t = time.perf_counter()
    o = subprocess.run([HSLAKE, "sql", *args, "--format", "csv"], capture_output=True, text=True,
                       env={**os.environ, "HSLAKE_LOG": "warn"})
    if o.returncode != 0:
        raise SystemExit(f"hslake sql {args}: {o.stderr}")
    return time.perf_counter() - t, rows(o.stdout)


def main():
    ap = argparse.ArgumentParser(description="one node against two workers")
    ap.add_argument("--samples", type=int, default=6000, help="samples of the synthetic dataset")
    ap.add_argument("--hidden", type=int, default=1024, help="its hidden size")
    ap.add_argument("--query-memory", default="256MiB", help="each query's pool, node and workers")
    ap.add_argument("--runs", type=int, default=3, help="runs of each query each way")
    ap.add_argument("--dir", default="/tmp/hslake-distributed-sql", help="where the dataset goes")
    a = ap.parse_args()
    d = pathlib.Path(a.dir)
    ds = d / f"ds-{a.samples}-{a.hidden}"
    if not ds.exists():
        # Written aside and renamed when whole: a stopped synth leaves no dataset to reuse.
        partial = d / f"{ds.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([HSLAKE, "synth", f"file://{partial}", "--samples", str(a.samples),
                        "--seq-len", "128:512", "--hidden", str(a.hidden), "--layers", "2,30",
                        "--shard-mb", "64"],
                       check=True, env={**os.environ, "HSLAKE_LOG": "warn"})
        partial.rename(ds)
    size = sum(f.stat().st_size for f in (ds / "data").iterdir())
    token_file = d / "token"
    token_file.write_text("distributed-bench-token\n")
    workers = [start_worker(str(token_file), a.query_memory, str(d)) for _ in range(2)]
    try:
        urls = ",".join(u for _, u in workers)
        result = {"hslake": HSLAKE, "machine": platform.node(), "cores": os.cpu_count(),
                  "dataset_bytes": size, "samples": a.samples, "hidden": a.hidden,
                  "query_memory": a.query_memory, "runs": a.runs, "queries": {}}
        for name, sql in QUERIES:
            one, two = [], []
            base = [f"file://{ds}", sql, "--query-memory", a.query_memory]
            for _ in range(a.runs):
                t1, r1 = run(base)
                t2, r2 = run(base + ["--workers", urls, "--worker-token-file", str(token_file)])
                if sorted(r1) != sorted(r2):
                    raise SystemExit(f"{name}: results differ:\n{r1}\n{r2}")
                one.append(t1)
                two.append(t2)
            result["queries"][name] = {
                "sql": sql,
                "one_node_s": {"best": min(one), "median": statistics.median(one)},
                "two_workers_s": {"best": min(two), "median": statistics.median(two)},
            }
        print(json.dumps(result, indent=1))
    finally:
        for p, _ in workers:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
