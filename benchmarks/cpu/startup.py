#!/usr/bin/env python3
"""Start-up benchmark of the `hslake` command line: the wall time of short commands, each run
--runs times as a fresh process; prints the median, the fastest and the slowest per command.

The commands: `--version` (nothing but start-up), `ls` and `sql 'SELECT 1'` on a two-sample
dataset (made with `hslake synth` in a temporary folder), `capture --help` (through `hslake`,
so it includes running `hslake-gpu` where the binaries are split), and `hslake-gpu --version`
when that binary is beside the given one. Give an older, single binary with --hslake to
compare. Output goes to stdout, a table and then every run's time, one per line.
Usage: .venv/bin/python benchmarks/cpu/startup.py [--hslake target/debug/hslake] [--runs 21]
"""
import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def timed(cmd, env):
    """Wall seconds of one run of `cmd`; a failed run stops the benchmark with its stderr."""
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))}: exit {done.returncode}: {done.stderr.decode()}")
    return took


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hslake", default=os.environ.get("HSLAKE_BIN", str(ROOT / "target" / "debug" / "hslake")),
                    help="the hslake binary (default target/debug/hslake, or HSLAKE_BIN)")
    ap.add_argument("--runs", type=int, default=21, help="runs per command (default 21)")
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs}: expected at least 1")
    hslake = pathlib.Path(args.hslake).resolve()
    if not hslake.is_file():
        raise SystemExit(f"--hslake {hslake}: no such file; build it with `cargo build --bins`")
    gpu = hslake.with_name("hslake-gpu")
    # Logs off: the timing is of start-up, not of a terminal writing log lines.
    env = {**os.environ, "HSLAKE_LOG": "off"}

    with tempfile.TemporaryDirectory(prefix="hslake-startup-") as tmp:
        ds = f"file://{tmp}/ds"
        subprocess.run([hslake, "synth", ds, "--samples", "2", "--seq-len", "8:8", "--hidden", "8",
                        "--layers", "1"], check=True, env=env, stderr=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL)
        commands = [
            ("hslake --version", [hslake, "--version"]),
            ("hslake ls DS", [hslake, "ls", ds]),
            ("hslake sql DS 'SELECT 1'", [hslake, "sql", ds, "SELECT 1"]),
            ("hslake capture --help", [hslake, "capture", "--help"]),
        ]
        if gpu.is_file():
            commands.append(("hslake-gpu --version", [gpu, "--version"]))
        # One untimed run each first, so that every command starts from a warm page cache.
        for _, cmd in commands:
            timed(cmd, env)
        times = {name: [] for name, _ in commands}
        # Round-robin, so that a burst of load on the machine spreads over every command.
        for _ in range(args.runs):
            for name, cmd in commands:
                times[name].append(timed(cmd, env))

    version = subprocess.run([hslake, "--version"], capture_output=True, text=True, env=env).stdout.strip()
    print(f"binary: {hslake} ({version}); hslake-gpu beside it: {'yes' if gpu.is_file() else 'no'}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.runs} runs per command")
    width = max(len(n) for n in times)
    print(f"{'command':<{width}}  median ms  fastest ms  slowest ms")
    for name, ts in times.items():
        print(f"{name:<{width}}  {statistics.median(ts) * 1e3:9.1f}  {min(ts) * 1e3:10.1f}  "
              f"{max(ts) * 1e3:10.1f}")
    print("runs (ms):")
    for name, ts in times.items():
        print(f"  {name}: {' '.join(f'{t * 1e3:.1f}' for t in ts)}")


if __name__ == "__main__":
    main()
