"""Conversations per second of `hslake prepare` against transformers (apply_chat_template with the
fast tokenizer, in one Python process) on the same conversations, in one run.

  cargo build --release -p hslake --bin hslake
  python scripts/bench_prepare.py --hslake target/release/hslake [--n 50000] [--repeat 3]

Each side runs --repeat times and the best time counts (other processes share the cores). The
transformers side tokenizes only (no loss mask); hslake also computes the assistant mask, turn by
turn for SmolLM2's template. Both sides read the same JSONL file; the transformers side's parsing
is outside its timing."""
import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from prepare_util import make_conversations  # noqa: E402


def best_of(repeat, fn):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), times


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

        results = {}
        for name, fn in [("hslake prepare", hslake), ("transformers, one call per conversation", transformers_one_by_one),
                         ("transformers, batches of 1000", transformers_batched)]:
            best, times = best_of(a.repeat, fn)
            results[name] = best
            print(f"{name:42s} best {best:7.2f} s  {a.n / best:9.0f} conversations/s  (runs: "
                  + ", ".join(f"{t:.2f}" for t in times) + ")", flush=True)
        tokens = sum(len(json.loads(l)["input_ids"]) for l in out.read_text().splitlines())
    h = results["hslake prepare"]
    print(f"\n{a.n} conversations, {tokens} tokens; {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    for name, t in results.items():
        if name != "hslake prepare":
            print(f"hslake is {t / h:.1f}x {name}")


if __name__ == "__main__":
    main()
