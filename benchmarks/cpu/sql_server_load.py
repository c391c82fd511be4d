#!/usr/bin/env python3
"""Load test of `hslake serve-sql` on loopback: can one client take the server down?

Writes a synthetic dataset with `hslake synth` (unless it exists), starts the server on
127.0.0.1 with its default limits (or those given after `--`), then, for --duration seconds:
- --clients ADBC clients (threads) loop over a mix of metadata and tensor queries and record
  each query's latency;
- one client sends `SELECT array_agg(a.layer_1) FROM samples a, samples b` (a query whose
  intermediate state grows with the square of the table) every 10 s;
- once, 8 client processes start `SELECT sum(tensor_norm(a.layer_1)) FROM samples a, samples b`
  and are killed 3 s later; then a fresh client's first answer is timed;
- then two clients at once send each of the scalar queries that grow a server without a cap
  on result size past its memory (a `concat` over a cross join, once cast to text for
  `length` and once kept as bytes, and `repeat('x', 2147483647)`), and their outcomes are
  recorded.
The server's peak resident memory is read from /proc. Everything is bounded in count and time
and talks only to 127.0.0.1; the server is stopped at the end.
Prints one JSON object with the figures.
Usage: .venv/bin/python benchmarks/cpu/sql_server_load.py [--duration 60] [--clients 32]
       [--dir /tmp/hslake-load-sql] [-- SERVE-SQL FLAGS...]
"""
import argparse
import json
import multiprocessing
import os
import pathlib
import platform
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HSLAKE = os.environ.get("HSLAKE_BIN", str(ROOT / "target" / "release" / "hslake"))
TOKEN = "load-test-token"

LIGHT = [
    ("metadata", "SELECT count(*) AS n, avg(seq_len) AS l FROM ds.samples"),
    ("metadata", "SELECT sample_id, seq_len FROM ds.samples WHERE layer_1_nan_count > 0 OR seq_len > 250"),
    ("metadata", "SELECT avg(layer_1_norm) AS a, max(layer_2_max_abs) AS m FROM ds.samples"),
    ("metadata", "SELECT version, samples, bytes FROM ds.versions"),
    ("tensor", "SELECT sample_id, tensor_norm(layer_1) AS n FROM ds.samples WHERE sample_id < 8"),
    ("tensor", "SELECT tensor_shape(layer_2) AS s, token_vector(layer_2, 0) AS t FROM ds.samples WHERE sample_id = 3"),
    ("tensor", "SELECT sample_id, cosine_similarity(layer_1, layer_2) AS c FROM ds.samples WHERE sample_id BETWEEN 10 AND 13"),
]
ARRAY_AGG = "SELECT array_agg(a.layer_1) FROM ds.samples a, ds.samples b"
CROSS_NORM = "SELECT sum(tensor_norm(a.layer_1)) FROM ds.samples a, ds.samples b"
SCALAR = [
    ("concat_cross_join", "SELECT max(length(concat(a.layer_1, b.layer_1))) FROM ds.samples a, ds.samples b"),
    ("concat_cross_join_bytes", "SELECT max(concat(a.layer_1, b.layer_1)) IS NULL FROM ds.samples a, ds.samples b"),
    ("repeat_2gib", "SELECT repeat('x', 2147483647)"),
]


def connect(uri):
    import adbc_driver_flightsql.dbapi as flight_sql
    from adbc_driver_flightsql import DatabaseOptions
    return flight_sql.connect(uri, db_kwargs={DatabaseOptions.AUTHORIZATION_HEADER.value: f"Bearer {TOKEN}"})


def run(conn, sql):
    with conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetch_arrow_table()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid):
    """Peak and current resident memory of a process, in bytes."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmHWM", 0), fields.get("VmRSS", 0)


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def light_client(uri, i, stop, out, errors):
    conn = connect(uri)
    k = i
    while not stop.is_set():
        kind, sql = LIGHT[k % len(LIGHT)]
        k += 1
        t = time.perf_counter()
        try:
            run(conn, sql)
            out.append((kind, time.perf_counter() - t))
        except Exception as e:  # a refused light query counts as an error of the test
            errors.append(f"{kind}: {e}")
    conn.close()


def heavy_client(uri, stop, out):
    conn = connect(uri)
    while not stop.is_set():
        t = time.perf_counter()
        try:
            run(conn, ARRAY_AGG)
            out.append(("completed", time.perf_counter() - t, ""))
        except Exception as e:
            out.append(("refused", time.perf_counter() - t, str(e).splitlines()[0][:300]))
        stop.wait(10)
    conn.close()


def scalar_pair(uri, name, sql):
    """Two clients send `sql` at once; each outcome with its time and first error line."""
    out = []

    def one():
        t = time.perf_counter()
        try:
            with connect(uri) as conn:
                run(conn, sql)
            out.append({"query": name, "outcome": "completed", "s": round(time.perf_counter() - t, 1)})
        except Exception as e:
            out.append({"query": name, "outcome": "refused", "s": round(time.perf_counter() - t, 1),
                        "error": str(e).splitlines()[0][:300]})

    pair = [threading.Thread(target=one) for _ in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=300)
    return out


def abandoned(uri):
    """A client process that starts the CPU-heavy cross join and is killed while it runs."""
    conn = connect(uri)
    run(conn, CROSS_NORM)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/hslake-load-sql")
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("serve_flags", nargs="*")
    a = ap.parse_args()
    data = pathlib.Path(a.dir) / "ds"
    if not data.exists():
        subprocess.run([HSLAKE, "synth", f"file://{data}", "--samples", str(a.samples), "--seq-len", "64:256",
                        "--hidden", "512", "--layers", "1,2", "--seed", "7"], check=True, capture_output=True)
    size = sum(f.stat().st_size for f in data.rglob("*.parquet"))
    token_file = pathlib.Path(a.dir) / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    log = open(pathlib.Path(a.dir) / "server.log", "w")
    server = subprocess.Popen([HSLAKE, "serve-sql", "--bind", f"127.0.0.1:{port}", "--dataset", f"ds=file://{data}",
                               "--token-file", str(token_file), *a.serve_flags], stdout=log, stderr=subprocess.STDOUT)
    uri = f"grpc://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit("server did not start; see server.log")
                time.sleep(0.1)

        stop = threading.Event()
        light, errors, heavy = [], [], []
        threads = [threading.Thread(target=light_client, args=(uri, i, stop, light, errors)) for i in range(a.clients)]
        threads.append(threading.Thread(target=heavy_client, args=(uri, stop, heavy)))
        start = time.time()
        for t in threads:
            t.start()

        # Eight clients start the CPU-heavy cross join and are killed 3 s later.
        time.sleep(min(5, a.duration / 4))
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=abandoned, args=(uri,)) for _ in range(8)]
        for p in procs:
            p.start()
        time.sleep(3)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        t = time.perf_counter()
        with connect(uri) as conn:
            run(conn, "SELECT count(*) FROM ds.samples WHERE seq_len > 100")
        after_kill = time.perf_counter() - t

        scalar = [r for name, sql in SCALAR for r in scalar_pair(uri, name, sql)]

        time.sleep(max(0, a.duration - (time.time() - start)))
        stop.set()
        for t in threads:
            t.join(timeout=120)
        alive = server.poll() is None
        hwm, rss = peak_rss(server.pid) if alive else (None, None)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    by_kind = {}
    for kind, dt in light:
        by_kind.setdefault(kind, []).append(dt)
    ms = lambda x: None if x is None else round(x * 1000, 1)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "dataset_bytes": size,
        "samples": a.samples,
        "duration_s": a.duration,
        "clients": a.clients,
        "serve_flags": a.serve_flags,
        "server_alive_at_end": alive,
        "server_peak_rss_bytes": hwm,
        "server_rss_at_end_bytes": rss,
        "light_queries": len(light),
        "light_errors": len(errors),
        "light_error_examples": errors[:3],
        "latency_ms": {k: {"n": len(v), "p50": ms(percentile(v, 50)), "p99": ms(percentile(v, 99))}
                       for k, v in sorted(by_kind.items())},
        "latency_ms_all": {"p50": ms(percentile([d for _, d in light], 50)),
                           "p99": ms(percentile([d for _, d in light], 99))},
        "array_agg_cross_join": [{"outcome": o, "s": round(d, 1), "error": e} for o, d, e in heavy],
        "answer_after_killing_8_cross_joins_s": round(after_kill, 2),
        "scalar_queries_two_at_once": scalar,
    }
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
