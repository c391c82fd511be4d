"""benchmarks/cpu/startup.py, the CLI start-up benchmark PERFORMANCE's table comes from: it runs
over the binaries setup builds and reports every command, and refuses a binary that is not there.
No time is asserted: the figures are the benchmark's, not the test's."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "cpu" / "startup.py"
BIN = Path(os.environ.get("HSLAKE_BIN", ROOT / "target" / "debug" / "hslake"))
COMMANDS = ["hslake --version", "hslake ls DS", "hslake sql DS 'SELECT 1'", "hslake capture --help",
            "hslake-gpu --version"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)


def test_reports_a_median_for_every_command_of_both_binaries():
    assert BIN.exists(), f"{BIN} is missing: scripts/setup.sh builds it (or set HSLAKE_BIN)"
    p = bench("--hslake", str(BIN), "--runs", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "hslake-gpu beside it: yes" in p.stdout, p.stdout
    rows = {}
    for line in p.stdout.splitlines():
        m = re.match(r"^(hslake.*?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.group(2, 3, 4)]
    assert sorted(rows) == sorted(COMMANDS), p.stdout
    for name, (median, fastest, slowest) in rows.items():
        assert 0 < fastest <= median <= slowest, f"{name}: {median} {fastest} {slowest}"
    runs = [line for line in p.stdout.splitlines() if line.startswith("  hslake")]
    assert len(runs) == len(COMMANDS) and all(len(r.split(": ")[1].split()) == 2 for r in runs), p.stdout


def test_refuses_a_binary_that_is_not_there(tmp_path):
    p = bench("--hslake", str(tmp_path / "hslake"), "--runs", "1")
    assert p.returncode != 0
    assert "no such file" in p.stderr and str(tmp_path / "hslake") in p.stderr, p.stderr
