#!/usr/bin/env python3
"""The build `scripts/setup.sh` installs against a release build, on every CPU benchmark of the
repository, side by side in one run: store write and read (`hslake bench store`), the loader
(`benchmarks/cpu/loader.py --readers hslake`), `hslake prepare`, and CPU capture of the embedded
SmolLM2 (the capture of examples/demo.sh).

  cargo build --workspace --lib --bins --config .cargo/install.toml      # what setup builds
  CARGO_TARGET_DIR=target-release cargo build --release --bins
  CARGO_TARGET_DIR=target-release cargo build --release -p hslake-python # the loader's module
  .venv/bin/python benchmarks/cpu/installed_vs_release.py \\
      --installed target/debug/hslake --installed-module target/debug/libhslake.so \\
      --release target-release/release/hslake --release-module target-release/release/libhslake.so \\
      --out /tmp/installed-vs-release

Each benchmark runs --rounds times per build, the builds taking turns (installed first in odd
rounds, release first in even ones) so that other load on a shared machine slows both alike.
The table gives each build's median and installed / release (1.00 = the same speed; the target
is >= 0.90 on every row). One unrecorded warm-up run per benchmark goes first. Each run's output is kept under --out (`<bench>-<build>-<round>.log`),
with every figure in runs.jsonl and the table in summary.md. The loader reads through the given
native module in a private copy of python/hslake/ (PYTHONPATH), so the module installed in .venv
is left alone; without both --*-module options the loader is skipped."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
CAPTURE_INPUT = ROOT / ".cache" / "default" / "samples.jsonl"
BENCHES = ("store", "loader", "prepare", "capture")


def children_cpu() -> float:
    """User + system seconds of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[str, float, float]:
    """Run `cmd` to the end, its stdout and stderr kept in `log`: (stdout, wall s, CPU s)."""
    t, c = time.perf_counter(), children_cpu()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall, cpu = time.perf_counter() - t, children_cpu() - c
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}--- stderr\n{p.stderr}")
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed with exit code {p.returncode}; its output is in {log}")
    return p.stdout, wall, cpu


def bench_store(b: dict, log: Path, a) -> dict:
    out, _, _ = run([b["bin"], "bench", "store", "--samples", str(a.store_samples), "--hidden", "4096",
                     "--seq-len", "256:768", "--json"], log)
    st = json.loads(out)["store"]
    return {"store write, MB/s per CPU s": st["write_mb_s"], "store write, MB/s wall": st["write_wall_mb_s"],
            "store read + decode, MB/s per CPU s": st["read_mb_s"],
            "store read + decode, MB/s wall": st["read_wall_mb_s"]}


def module_dir(so: str, into: Path) -> Path:
    """A private copy of the Python package python/hslake/ around the native library `so`."""
    pkg = into / "hslake"
    shutil.copytree(ROOT / "python" / "hslake", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(so, pkg / "_hslake.abi3.so")
    return into


def bench_loader(b: dict, log: Path, a) -> dict:
    res = log.with_suffix(".json")
    # The dataset is written once, by the first build to run, and read by every run (--keep).
    run([sys.executable, str(ROOT / "benchmarks" / "cpu" / "loader.py"), "--readers", "hslake",
         "--samples", str(a.loader_samples), "--hidden", "64", "--keep", "--out", str(a.out / "loader-data"),
         "--json-out", str(res)], log, env={"PYTHONPATH": str(b["module_dir"])})
    (r,) = json.loads(res.read_text())["results"].values()
    return {"loader, tokens/s": r["tokens"] / r["seconds"], "loader, GB per CPU s": r["gb_per_cpu_s"]}


def bench_prepare(b: dict, log: Path, a) -> dict:
    out = a.scratch / "prepared.jsonl"
    _, wall, cpu = run([b["bin"], "prepare", "--model", str(MODEL), "--input", str(a.conversations),
                        "--output", str(out)], log, env={"HSLAKE_LOG": "warn"})
    return {"prepare, conversations/s": a.prepare_n / wall, "prepare, conversations per CPU s": a.prepare_n / cpu}


def bench_capture(b: dict, log: Path, a) -> dict:
    dest = a.scratch / "capture"
    shutil.rmtree(dest, ignore_errors=True)
    _, wall, cpu = run([b["bin"], "capture", "--model", str(MODEL), "--input", str(CAPTURE_INPUT),
                        "--output", f"file://{dest}", "--layers", "2,15,27,29", "--final-norm", "--device", "cpu",
                        "--dtype", "bf16", "--max-tokens-per-batch", "4096"], log, env={"HSLAKE_LOG": "info"})
    # The capture's own rate (model loading excluded), from its summary.
    m = re.search(r"samples written +\d+ \((\d+) tokens, (\d+) tokens/s", log.read_text())
    if not m:
        raise SystemExit(f"no 'samples written' summary in the capture's output ({log})")
    tokens, rate = m.groups()
    return {"CPU capture, tokens/s": float(rate), "CPU capture, tokens per CPU s (whole run)": int(tokens) / cpu,
            "CPU capture, whole run s (lower is better)": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--installed", required=True, help="the hslake binary setup builds (target/debug/hslake)")
    p.add_argument("--release", required=True, help="a release hslake binary")
    p.add_argument("--installed-module", help="libhslake.so of the setup build (for the loader)")
    p.add_argument("--release-module", help="libhslake.so of a release build (for the loader)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=",".join(BENCHES), help=f"subset of {','.join(BENCHES)}")
    p.add_argument("--store-samples", type=int, default=48)
    p.add_argument("--loader-samples", type=int, default=20000)
    p.add_argument("--prepare-n", type=int, default=50000)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args()
    benches = [x for x in a.only.split(",") if x]
    if set(benches) - set(BENCHES):
        raise SystemExit(f"--only {a.only!r}: expected a comma list of {','.join(BENCHES)}")
    if "loader" in benches and not (a.installed_module and a.release_module):
        print("no --installed-module/--release-module: the loader is skipped", file=sys.stderr)
        benches.remove("loader")
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory()
    a.scratch = Path(tmp.name)
    builds = {"installed": {"bin": a.installed, "so": a.installed_module},
              "release": {"bin": a.release, "so": a.release_module}}
    for name, b in builds.items():
        b["version"] = subprocess.run([b["bin"], "--version"], capture_output=True, text=True, check=True).stdout
        if b["so"]:
            b["module_dir"] = module_dir(b["so"], a.scratch / f"module-{name}")
    if "prepare" in benches:
        sys.path.insert(0, str(ROOT / "tests" / "python"))
        from prepare_util import make_conversations
        a.conversations = a.scratch / "conversations.jsonl"
        a.conversations.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n"
                                           for c in make_conversations(a.prepare_n, seed=1)))

    started = datetime.now(timezone.utc)
    load = [os.getloadavg()[0]]
    figures: dict[str, dict[str, list[float]]] = {}
    runs_file = (a.out / "runs.jsonl").open("w")
    # One unrecorded run per benchmark first: it writes the loader's dataset and brings the model,
    # the conversations and the binaries into the page cache, which the first timed run paid.
    for bench in benches:
        print(f"warm-up: {bench}", file=sys.stderr, flush=True)
        globals()[f"bench_{bench}"](builds["installed"], a.out / f"{bench}-warmup.log", a)
    for rnd in range(1, a.rounds + 1):
        order = ["installed", "release"] if rnd % 2 else ["release", "installed"]
        for bench in benches:
            for name in order:
                log = a.out / f"{bench}-{name}-{rnd}.log"
                print(f"round {rnd}: {bench}, {name}", file=sys.stderr, flush=True)
                got = globals()[f"bench_{bench}"](builds[name], log, a)
                load.append(os.getloadavg()[0])
                runs_file.write(json.dumps({"round": rnd, "bench": bench, "build": name, **got}) + "\n")
                runs_file.flush()
                for k, v in got.items():
                    figures.setdefault(k, {}).setdefault(name, []).append(v)

    lines = [f"Installed build vs release, {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores "
             f"({platform.processor() or platform.machine()}), load average {min(load):.1f}-{max(load):.1f}",
             "", f"installed: {a.installed}: {builds['installed']['version'].strip()}",
             f"release: {a.release}: {builds['release']['version'].strip()}", "",
             f"| measure (median of {a.rounds}) | installed | release | installed / release | runs (installed; release) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for k, by in figures.items():
        i, r = statistics.median(by["installed"]), statistics.median(by["release"])
        # Times: a ratio above 1 means the installed build is slower, so the ratio is inverted.
        ratio = r / i if "lower is better" in k else i / r
        runs = "; ".join(", ".join(f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in by[b])
                         for b in ("installed", "release"))
        fmt = (lambda v: f"{v:,.0f}") if max(i, r) >= 100 else (lambda v: f"{v:.2f}")
        lines.append(f"| {k} | {fmt(i)} | {fmt(r)} | {ratio:.2f} | {runs} |")
    text = "\n".join(lines) + "\n"
    (a.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
