"""One heavy query kind at a time against `hslake serve-sql` (default limits), the server's
resident memory sampled every 100 ms: how the figures of README.md were found.
Usage: HSLAKE_BIN=target/debug/hslake .venv/bin/python PATH/phase.py KIND [N] [-- SERVE FLAGS]
KIND: concat, repeat, array_agg, cross_norm (the queries of sql_server_load.py) or SQL text;
N clients send it at once. Prints peak/end RSS, when the peak came, each outcome, and RSS
every 2 s."""
import sys, time, threading, subprocess, pathlib, signal, json, socket, os
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "cpu"))
import sql_server_load as L
kind = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
extra = [a for a in sys.argv[3:] if a != "--"]
d = pathlib.Path("/tmp/hslake-load-sql"); data = d / "ds"
HS = os.environ["HSLAKE_BIN"]
if not data.exists():
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run([HS, "synth", f"file://{data}", "--samples", "160", "--seq-len", "64:256",
                    "--hidden", "512", "--layers", "1,2", "--seed", "7"], check=True, capture_output=True)
(d / "token").write_text(L.TOKEN + "\n")
port = L.free_port()
log = open(d / "server.log", "w")
srv = subprocess.Popen([HS, "serve-sql", "--bind", f"127.0.0.1:{port}", "--dataset", f"ds=file://{data}",
                        "--token-file", str(d / "token"), *extra], stdout=log, stderr=subprocess.STDOUT)
uri = f"grpc://127.0.0.1:{port}"
while True:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close(); break
    except OSError:
        time.sleep(0.1)
samples = []; stop = threading.Event()
def sampler():
    t0 = time.time()
    while not stop.is_set():
        try:
            _, rss = L.peak_rss(srv.pid)
        except Exception:
            break
        samples.append((round(time.time() - t0, 1), rss)); time.sleep(0.1)
threading.Thread(target=sampler, daemon=True).start()
sql = {"concat": L.SCALAR[0][1], "repeat": L.SCALAR[1][1], "array_agg": L.ARRAY_AGG, "cross_norm": L.CROSS_NORM}.get(kind, kind)
out = []
def one():
    t = time.perf_counter()
    try:
        with L.connect(uri) as c:
            r = L.run(c, sql)
        out.append(("ok", round(time.perf_counter() - t, 1), str(r.to_pydict())[:200]))
    except Exception as e:
        out.append(("err", round(time.perf_counter() - t, 1), str(e).splitlines()[0][:300]))
ts = [threading.Thread(target=one) for _ in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
time.sleep(1)
stop.set()
hwm, rss = L.peak_rss(srv.pid)
srv.send_signal(signal.SIGINT); srv.wait(20)
peak = max(samples, key=lambda s: s[1])
print(json.dumps({"kind": kind, "n": n, "hwm_gb": hwm / 1e9, "end_gb": rss / 1e9, "peak_at": peak[0], "out": out}))
# coarse profile: every 2 s
print(" ".join(f"{t}:{r/1e9:.2f}" for t, r in samples[::20]))
