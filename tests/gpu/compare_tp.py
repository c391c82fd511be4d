"""Compares captured datasets with a reference capture of the same samples (e.g. TP=2 with TP=1):
per dataset, the min per-token cosine and max abs difference over every sample and column.
Usage: compare_tp.py REFERENCE_DIR LABEL=DIR [LABEL=DIR ...] [--min-cosine 0.9999] [--samples N]
(--samples N: only sample ids below N, for datasets too large to hold whole in memory).
Needs numpy, pyarrow and tests/python on PYTHONPATH (benchmarks/gpu/env.sh sets it)."""
import argparse, sys
import numpy as np

from capture_util import read_dataset

p = argparse.ArgumentParser()
p.add_argument("reference")
p.add_argument("others", nargs="+", help="LABEL=DIR")
p.add_argument("--min-cosine", type=float, default=0.9999)
p.add_argument("--samples", type=int, default=None)
a = p.parse_args()
only = None if a.samples is None else set(range(a.samples))
ref, _ = read_dataset(a.reference, only=only)
ok = True
for spec in a.others:
    label, path = spec.split("=", 1)
    got, _ = read_dataset(path, only=only)
    assert sorted(got) == sorted(ref), f"{label}: sample ids differ from the reference"
    cos, diff, tokens = 1.0, 0.0, 0
    for sid, want in ref.items():
        for col, w in want.items():
            if not isinstance(w, np.ndarray):
                continue
            m = got[sid][col]
            c = (m * w).sum(-1) / (np.linalg.norm(m, axis=-1) * np.linalg.norm(w, axis=-1) + 1e-30)
            cos, diff, tokens = min(cos, float(c.min())), max(diff, float(np.abs(m - w).max())), tokens + len(c)
    status = ("ok, bit-identical" if diff == 0 else "ok") if cos >= a.min_cosine else "FAIL"
    ok &= cos >= a.min_cosine
    print(f"{label} vs reference over {len(ref)} samples ({tokens} token vectors): "
          f"min per-token cosine {cos:.6f}, max abs diff {diff:.4g} [{status}]", flush=True)
sys.exit(0 if ok else 1)
