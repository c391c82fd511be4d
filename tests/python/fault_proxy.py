"""Start the fault-injecting S3 proxy (crate tests/fault_proxy, binary hslake-fault-proxy) from
Python tests and drive it: rules in, counters out, as the JSON of its control endpoint.

    with FaultProxy(upstream) as proxy:                  # or the `fault_proxy` fixture (conftest.py)
        proxy.set_rules([{"method": "PUT", "key": r"_hslake/versions/.*\\.json",
                          "header": "If-None-Match", "from": 1, "to": 1,
                          "fault": {"kind": "reset_after"}}])
        ... point the client at proxy.endpoint ...
        assert proxy.counters()["faults"]["reset_after"] == 1

Fault kinds: status (code 503 SlowDown / 500 InternalError), reset_before, reset_after,
delay (ms, when: before|after), truncate (bytes), random (p, of: [faults]; every class when
`of` is left out). The crate's documentation describes every field.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROL = "/__fault_proxy/"


def proxy_bin() -> Path:
    """The binary `cargo build` makes (scripts/setup.sh builds it); HSLAKE_FAULT_PROXY_BIN overrides."""
    if os.environ.get("HSLAKE_FAULT_PROXY_BIN"):
        return Path(os.environ["HSLAKE_FAULT_PROXY_BIN"])
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "hslake-fault-proxy"


class FaultProxy:
    """A proxy process on a free port of 127.0.0.1 in front of `upstream`; `close()` stops it, and it
    also exits by itself when this Python process dies (its stdin closes)."""

    def __init__(self, upstream: str, rules: list[dict] | None = None, seed: int = 0, start_timeout: float = 10.0):
        exe = proxy_bin()
        if not exe.exists():
            raise FileNotFoundError(f"{exe} does not exist; build it with `cargo build -p hslake-fault-proxy`")
        self.proc = subprocess.Popen([str(exe), "--upstream", upstream, "--exit-on-stdin-eof"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"hslake-fault-proxy did not print its endpoint within {start_timeout}s "
                               f"(exit status {self.proc.returncode}; its stderr says why)")
        self.endpoint = line
        if rules is not None:
            self.set_rules(rules, seed)

    def _call(self, method: str, what: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + CONTROL + what, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:
            raise ValueError(json.load(e).get("error", str(e))) from None

    def set_rules(self, rules: list[dict], seed: int = 0) -> dict:
        """Replaces the rules (their counters restart); ValueError names what is wrong with them."""
        return self._call("PUT", "rules", {"seed": seed, "rules": rules})

    def rules(self) -> dict:
        return self._call("GET", "rules")

    def clear_rules(self) -> None:
        self._call("DELETE", "rules")

    def counters(self) -> dict:
        """{"requests": N, "faults": {class: n}, "rules": [{"name", "matched", "faults"}]}."""
        return self._call("GET", "counters")

    def reset_counters(self) -> None:
        self._call("DELETE", "counters")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
