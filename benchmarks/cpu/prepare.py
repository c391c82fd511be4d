"""Conversations per second of `hslake prepare` against transformers (apply_chat_template with the
fast tokenizer, in one Python process) on the same conversations, in one run.

  cargo build --release --no-default-features
  python benchmarks/cpu/prepare.py --hslake target/release/hslake [--n 50000] [--repeat 3]

Each side runs --repeat times, the sides taking turns so that other processes sharing the cores
slow all of them alike, and the best time counts. Beside wall time each run reports its CPU
seconds (all threads; for hslake its process's user + system time), which other load changes
much less. The transformers side tokenizes only (no loss mask); hslake also computes the
assistant mask, turn by turn for SmolLM2's template. Both sides read the same JSONL file; the
transformers side's parsing is outside its timing. The load average is printed before and after."""
import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from prepare_util import make_conversations  # noqa: E402


def timed(fn):
    """(wall seconds, CPU seconds of this process and its finished children)."""
    def cpu():
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    t, c = time.perf_counter(), cpu()
    fn()
    return time.perf_counter() - t, cpu() - c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--hslake", default=str(ROOT / "target" / "release" / "hslake"))
    p.add_argument("--n", type=int, default=50000)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()

    from transformers import AutoTokenizer

    convs = make_conversations(a.n, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "convs.jsonl"
        inp.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
        messages = [json.loads(l)["messages"] for l in inp.read_text().splitlines()]
        tok = AutoTokenizer.from_pretrained(a.model)

        def transformers_one_by_one():
            for m in messages:
                tok.apply_chat_template(m, tokenize=True)

        def transformers_batched():
            for i in range(0, len(messages), 1000):
                tok.apply_chat_template(messages[i:i + 1000], tokenize=True)

        out = Path(tmp) / "out.jsonl"

        def hslake():
            subprocess.run([a.hslake, "prepare", "--model", a.model, "--input", str(inp), "--output", str(out)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "HSLAKE_LOG": "warn"})

        sides = [("hslake prepare", hslake), ("transformers, one call per conversation", transformers_one_by_one),
                 ("transformers, batches of 1000", transformers_batched)]
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        runs = {name: [] for name, _ in sides}
        for _ in range(a.repeat):
            for name, fn in sides:
                runs[name].append(timed(fn))
        results = {}
        for name, rs in runs.items():
            best = min(w for w, _ in rs)
            results[name] = best
            print(f"{name:42s} best {best:7.2f} s  {a.n / best:9.0f} conversations/s  (runs, wall / CPU s: "
                  + ", ".join(f"{w:.2f} / {c:.2f}" for w, c in rs) + ")", flush=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        tokens = sum(len(json.loads(l)["input_ids"]) for l in out.read_text().splitlines())
    h = results["hslake prepare"]
    print(f"\n{a.n} conversations, {tokens} tokens; {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    hc = min(c for _, c in runs["hslake prepare"])
    for name, t in results.items():
        if name != "hslake prepare":
            c = min(c for _, c in runs[name])
            print(f"hslake is {t / h:.1f}x {name} (wall); {c / hc:.1f}x in CPU seconds")


if __name__ == "__main__":
    main()
