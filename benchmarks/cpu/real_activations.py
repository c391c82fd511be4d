"""Hidden states of a real trained model, computed with Hugging Face transformers, as input to
the store benchmark on real activations.

Runs SmolLM2-135M-Instruct (made by scripts/setup.d/20-smollm2.sh) in bf16 over a few
hundred 256-token windows of real English text — the docstrings of the Python standard
library, which every machine here has — and saves, for layers spread over the depth,
`layer_<i>.npy` (uint16 bf16 bits, [N, T, H], HF output_hidden_states[i + 1]) and
`input_ids.npy` ([N, T]). `hslake bench store --from-npy DIR` then writes them in the store
format and reports ratio and throughput.
"""
import argparse
import importlib
import pkgutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
p.add_argument("--out", required=True)
p.add_argument("--sequences", type=int, default=300)
p.add_argument("--seq-len", type=int, default=256)
p.add_argument("--layers", default="2,10,20,28")
a = p.parse_args()

texts = []
for m in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
    if m.name.startswith("_") or m.name in {"antigravity", "this", "idlelib", "tkinter", "turtle"}:
        continue
    try:
        mod = importlib.import_module(m.name)
    except Exception:
        continue
    for obj in [mod, *vars(mod).values()]:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc) > 200:
            texts.append(doc)
    if sum(map(len, texts)) > a.sequences * a.seq_len * 8:
        break

tok = AutoTokenizer.from_pretrained(a.model)
ids = tok("\n\n".join(dict.fromkeys(texts)).strip(), return_tensors=None)["input_ids"]
n = min(a.sequences, len(ids) // a.seq_len)
windows = torch.tensor(ids[: n * a.seq_len]).view(n, a.seq_len)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
layers = [int(x) for x in a.layers.split(",")]
out = {i: [] for i in layers}
with torch.no_grad():
    for b in range(0, n, 16):
        hs = model.model(input_ids=windows[b : b + 16], output_hidden_states=True).hidden_states
        for i in layers:
            out[i].append(hs[i + 1].contiguous().view(torch.int16).numpy().view(np.uint16))
d = Path(a.out)
d.mkdir(parents=True, exist_ok=True)
np.save(d / "input_ids.npy", windows.numpy().astype(np.int32))
for i in layers:
    arr = np.concatenate(out[i])
    np.save(d / f"layer_{i}.npy", arr)
    f = (arr.astype(np.uint32) << 16).view(np.float32)
    print(f"layer {i}: {arr.shape}, max |x| {np.abs(f).max():.1f}, mean token norm {np.linalg.norm(f, axis=-1).mean():.1f}")
print(f"{n} sequences of {a.seq_len} tokens from {len(texts)} docstrings -> {d}")
