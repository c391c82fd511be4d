"""A hostile client for the connection-limit tests: it holds COUNT half-open connections to a
server from SOURCE (a loopback address of its own, e.g. 127.0.0.2), each having sent PREFIX and
nothing more, and opens a new one whenever the server closes one, until it is killed. Every
second it prints a JSON line: connections open, opened and closed by the server so far.

    python flood.py HOST PORT COUNT SOURCE [PREFIX]

It runs as its own processes (`Flooders`, 10,000 connections each) so that its descriptors count
against their own open-file limits, not the test's."""
import json
import pathlib
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time


class Flooders:
    """flood.py processes holding `count` half-open connections to 127.0.0.1:`port` from `source`."""

    PER_PROCESS = 10_000

    def __init__(self, port, count, source, prefix=None):
        self.stats = {}
        self.procs = []
        for i, start in enumerate(range(0, count, self.PER_PROCESS)):
            cmd = [sys.executable, str(pathlib.Path(__file__)), "127.0.0.1", str(port),
                   str(min(self.PER_PROCESS, count - start)), source] + ([prefix] if prefix else [])
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i, proc):
        for line in proc.stdout:
            self.stats[i] = json.loads(line)

    def total(self, key):
        """A counter summed over the processes: open, opened, closed (by the server), failed."""
        return sum(s[key] for s in list(self.stats.values()))

    def wait_opened(self, count, timeout=120):
        deadline = time.time() + timeout
        while not self.stats or self.total("opened") < count:
            assert time.time() < deadline, f"the flood never reached {count}: {self.stats}"
            time.sleep(0.1)

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


def main():
    host, port, count, source = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    prefix = (sys.argv[5] if len(sys.argv) > 5 else "GET / HTTP/1.1\r\nHost: flood\r\n").encode()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    opened = closed = failed = 0
    last_report = 0.0
    while True:
        # Top up to COUNT, a batch at a time so that closings are noticed in between.
        for _ in range(min(500, count - len(sel.get_map()))):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.bind((source, 0))
                s.connect((host, port))
                s.sendall(prefix)
            except OSError:
                s.close()
                failed += 1
                break
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            opened += 1
        for key, _ in sel.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                closed += 1
        now = time.time()
        if now - last_report >= 1.0:
            last_report = now
            print(json.dumps({"open": len(sel.get_map()), "opened": opened, "closed": closed,
                              "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
