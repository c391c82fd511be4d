"""`hslake serve-sql` under a flood of half-open connections: one client's thousands of connections
that never send their HTTP/2 preface get its --max-connections-per-client share for
--header-timeout at a time, while other clients' queries are answered within a second and the
server's descriptors stay under --max-connections."""
import json
import os
import pathlib
import socket
import statistics
import subprocess
import time

import pytest

from flood import Flooders

ROOT = pathlib.Path(__file__).resolve().parents[2]
HSLAKE = pathlib.Path(os.environ.get("HSLAKE_BIN", ROOT / "target" / "debug" / "hslake"))
TOKEN = "fl00d-test-token"
FLOOD_CONNECTIONS = int(os.environ.get("HSLAKE_FLOOD_CONNECTIONS", "2000"))
FLOOD_SECONDS = float(os.environ.get("HSLAKE_FLOOD_SECONDS", "6"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def server(tmp_path):
    url = f"file://{tmp_path / 'ds'}"
    subprocess.run([str(HSLAKE), "synth", url, "--samples", "8", "--seq-len", "2:6", "--hidden", "16",
                    "--layers", "1"], check=True, capture_output=True)
    (tmp_path / "token").write_text(TOKEN + "\n")
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([str(HSLAKE), "serve-sql", "--bind", f"127.0.0.1:{port}", "--dataset", f"main={url}",
                             "--token-file", str(tmp_path / "token"), "--max-connections", "256",
                             "--max-connections-per-client", "64", "--header-timeout", "2s"],
                            stdout=log, stderr=log)
    deadline = time.time() + 30
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert time.time() < deadline, "serve-sql never listened"
            time.sleep(0.1)
    yield proc, port, tmp_path / "server.log"
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def timed_query(port):
    import adbc_driver_flightsql.dbapi as flight_sql
    from adbc_driver_flightsql import DatabaseOptions
    t = time.perf_counter()
    with flight_sql.connect(f"grpc://127.0.0.1:{port}",
                            db_kwargs={DatabaseOptions.AUTHORIZATION_HEADER.value: f"Bearer {TOKEN}"}) as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM main.samples")
            assert cur.fetch_arrow_table().to_pylist() == [{"n": 8}]
    return time.perf_counter() - t


def test_a_flood_of_half_open_connections_leaves_queries_answered_within_a_second(server):
    proc, port, log = server
    timed_query(port)
    idle_fds = open_fds(proc.pid)
    # Half an HTTP/2 preface, then nothing.
    flood = Flooders(port, FLOOD_CONNECTIONS, "127.0.0.2", "PRI * HTTP/2.0\r\n")
    try:
        flood.wait_opened(FLOOD_CONNECTIONS)
        latencies, peak_fds = [], 0
        end = time.time() + FLOOD_SECONDS
        while time.time() < end:
            latencies.append(timed_query(port))
            peak_fds = max(peak_fds, open_fds(proc.pid))
            time.sleep(0.05)
        summary = {"connections": FLOOD_CONNECTIONS, "queries": len(latencies),
                   "p50_ms": 1000 * statistics.median(latencies), "max_ms": 1000 * max(latencies),
                   "idle_fds": idle_fds, "peak_fds": peak_fds, "closed_by_server": flood.total("closed")}
        print("serve-sql flood:", json.dumps(summary))
        assert max(latencies) < 1.0, summary
        assert peak_fds - idle_fds <= 256, summary
        assert flood.total("closed") >= FLOOD_CONNECTIONS - 64, summary
        assert proc.poll() is None
    finally:
        flood.stop()
    assert "refusing connections: 127.0.0.2 holds --max-connections-per-client 64" in log.read_text()
