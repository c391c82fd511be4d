"""How many CPU cores hslake's loader needs to keep one GPU's draft training fed, at the sizes
EAGLE-3 data has (issue 17, item 4): writes a synthetic dataset (hidden 4096, 512-4096 tokens,
aux layers 1, 2, 3 + final_norm, bf16: 32 KiB a token), reads one shuffled epoch with 1, 2, ...
decode threads, and prints tokens/s, decoded GB/s and GB/s per thread; with
--draft-tokens-per-s (a training step's rate, e.g. scripts/gpu/draft_step_bench.py on the GPU),
the cores that rate needs (CPU seconds of the whole reading process per token, times the rate).

  .venv/bin/python scripts/bench_loader_cores.py --dir /tmp/hs-cores [--samples 48] [--threads 1,2]
      [--draft-tokens-per-s 57877]"""
import argparse
import os
import time

import hslake


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq-len", default="512:4096")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--draft-tokens-per-s", type=float)
    a = p.parse_args()
    lo, hi = map(int, a.seq_len.split(":"))
    layers = [1, 2, 3]
    url = f"file://{os.path.abspath(a.dir)}"
    print("build:", hslake.build_info())
    if not os.path.exists(a.dir):
        t = time.perf_counter()
        hslake.write_synthetic(a.dir, a.samples, (lo, hi), a.hidden, layers, final_norm=True, seed=0)
        print(f"wrote {a.samples} samples in {time.perf_counter() - t:.1f} s")
    counts = hslake.Dataset(a.dir).counts()
    bytes_per_token = (len(layers) + 1) * a.hidden * 2
    print(f"dataset: {counts['num_samples']} samples, {counts['num_tokens']} tokens, "
          f"{counts['num_tokens'] * bytes_per_token / 1e9:.2f} GB of states decoded per epoch; load average "
          f"{os.getloadavg()[0]:.2f}")
    rates, cpu_per_token = {}, {}
    for threads in map(int, a.threads.split(",")):
        loader = hslake.Loader(url, batch_size=a.batch_size, decode_threads=threads, seed=0, aux_layers=layers,
                               target="final_norm")
        t0, tokens, cpu0 = time.perf_counter(), 0, os.times()
        for b in loader:
            tokens += int(b["attention_mask"].sum())
        secs, cpu1 = time.perf_counter() - t0, os.times()
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        rates[threads] = tokens / secs
        cpu_per_token[threads] = cpu / tokens
        gbs = tokens * bytes_per_token / secs / 1e9
        print(f"decode threads {threads}: {tokens / secs:,.0f} tokens/s, {gbs:.2f} GB/s decoded, "
              f"{gbs / threads:.2f} GB/s per thread, CPU {cpu:.1f} s in {secs:.1f} s")
    if a.draft_tokens_per_s:
        # Cores, not decode threads: the batch assembly and the hand-over to Python take CPU too.
        cpu = min(cpu_per_token.values())
        print(f"a draft step at {a.draft_tokens_per_s:,.0f} tokens/s needs {a.draft_tokens_per_s * cpu:.1f} cores "
              f"at the least CPU per token above ({cpu * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
