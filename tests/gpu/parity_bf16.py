"""bf16 on the GPU: hslake capture vs transformers (on one GPU) for one tiny random model per
architecture, at one or more TP sizes and reductions. Reports the min per-token cosine (must be
>= 0.9999) and the max abs difference over every captured point, per run and architecture.

Runs are given as TP[:REDUCE[:MODES]], e.g. `--runs 1 2:f32 2:bf16:batched`: REDUCE is the
capture's --tp-reduce (its default when left out), MODES is batched (one padded batch) and/or
single (one sample a batch), comma-separated, both by default. An architecture whose heads do not
split into TP ranks is reported as skipped.

Next to each verdict it reports the noise floor the 0.9999 bound sits on: transformers' own bf16
run in one padded batch against the same run one sample at a time, and every bf16 run (ours and
transformers') against an f32 forward of the same (bf16-rounded) weights — the truth both
approximate. A TP run whose distance from the truth equals transformers' own is as faithful as
bf16 allows, whatever its distance from transformers' particular rounding.

So each run also captures in f32 (one padded batch), which must match the f32 truth (min
per-token cosine >= 0.99999): that is the check of the arithmetic. The bf16 verdict is then "ok"
at >= 0.9999 against transformers, or "ok at bf16's floor" where transformers' own bf16 is
further than that from the truth (tiny random MoE models, whose routing near-ties flip with the
rounding) and the capture is no further from the truth than transformers (within 1e-4).

Needs CUDA GPUs (one per TP rank), torch, transformers, and tests/python on PYTHONPATH
(benchmarks/gpu/env.sh sets it)."""
import argparse, os, subprocess, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from capture_util import ARCHS, VOCAB, randomize, random_samples, read_dataset, write_jsonl

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("--work", required=True)
p.add_argument("--runs", nargs="+", default=["1"], help="TP[:REDUCE[:MODES]] per run")
p.add_argument("--tp", type=int, help="shorthand for --runs TP")
p.add_argument("capture_flags", nargs="*", help="extra flags for every capture, e.g. --norm exact")
a = p.parse_args()
if a.tp:
    a.runs = [str(a.tp)]
BUDGET = {"batched": "16384", "single": "1"}


def parse_run(spec):
    parts = spec.split(":")
    tp = int(parts[0])
    reduce = parts[1] if len(parts) > 1 and parts[1] else None
    modes = parts[2].split(",") if len(parts) > 2 else ["batched", "single"]
    label = f"TP {tp}" + (f" {reduce} reduction" if reduce else "")
    flags = ["--tp", str(tp)] + (["--tp-reduce", reduce] if reduce else [])
    return label, flags, modes


def forward(model, batch):
    """{column: [b, t, hidden]} of one right-padded batch of samples."""
    t = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, :len(s["input_ids"])] = 1
    captured = {}
    h = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        o = model(ids.cuda(), attention_mask=mask.cuda(), output_hidden_states=True)
    h.remove()
    ref = {f"layer_{l}": (captured["last"] if l == len(model.model.layers) - 1 else o.hidden_states[l + 1]) for l in (0, 1, 2)}
    ref["final_norm"] = o.hidden_states[-1]
    return {k: v.float().cpu().numpy() for k, v in ref.items()}


def reference(model, samples, batched=False):
    """{sample index: {column: [t, hidden] f32}} from transformers, one sample at a time or all
    in one padded batch."""
    if batched:
        states = forward(model, samples)
        return [{k: v[i, :len(s["input_ids"])] for k, v in states.items()} for i, s in enumerate(samples)]
    return [{k: v[0] for k, v in forward(model, [s]).items()} for s in samples]


def worst(got, want):
    cos, diff = 1.0, 0.0
    for sid, ref in enumerate(want):
        for col, w in ref.items():
            m = got[sid][col]
            c = (m * w).sum(-1) / (np.linalg.norm(m, axis=-1) * np.linalg.norm(w, axis=-1) + 1e-30)
            cos, diff = min(cos, float(c.min())), max(diff, float(np.abs(m - w).max()))
    return cos, diff


os.makedirs(a.work, exist_ok=True)
lengths = [7, 64, 300, 1, 129, 33]
ok = True
for arch, make in sorted(ARCHS.items()):
    torch.manual_seed(0)
    path = os.path.join(a.work, arch)
    randomize(make().float().eval(), seed=0).to(torch.bfloat16).save_pretrained(path)
    # Reload the way users do: `.to(bfloat16)` on a built model would also round the RoPE
    # inv_freq buffer to bf16, which from_pretrained keeps in f32.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    samples = random_samples(lengths, VOCAB, seed=1)
    inputs = write_jsonl(os.path.join(a.work, arch + ".jsonl"), samples)
    want = reference(model, samples)
    truth_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       attn_implementation="sdpa").cuda().eval()
    truth = reference(truth_model, samples)
    del truth_model
    floor_batch = worst(reference(model, samples, batched=True), want)[0]
    floor_truth = worst(want, truth)[0]
    print(f"{arch}: noise floor: transformers bf16 padded batch vs one by one: min per-token cosine "
          f"{floor_batch:.6f}; transformers bf16 vs f32 truth: {floor_truth:.6f}", flush=True)
    for spec in a.runs:
        label, flags, modes = parse_run(spec)
        figures = []
        for mode in modes:
            ds = os.path.join(a.work, f"{arch}-{mode}")
            subprocess.run(["rm", "-rf", ds])
            r = subprocess.run([a.bin, "capture", "--model", path, "--input", inputs, "--output", f"file://{ds}",
                                "--layers", "0,1,2", "--final-norm", "--device", "cuda", "--dtype", "bf16",
                                "--max-tokens-per-batch", BUDGET[mode], "--no-progress", *flags, *a.capture_flags],
                               capture_output=True, text=True)
            if r.returncode != 0 and "is impossible for this model" in r.stderr:
                figures = None
                print(f"{arch}: {label}: skipped: {r.stderr.strip().splitlines()[-1]}")
                break
            if r.returncode != 0:
                print(f"{arch}: {label}: capture failed\n{r.stderr}")
                ok = False
                break
            got, _ = read_dataset(ds)
            figures.append((mode, *worst(got, want), worst(got, truth)[0]))
        if not figures:
            continue
        f32_cos = None
        ds = os.path.join(a.work, f"{arch}-f32")
        subprocess.run(["rm", "-rf", ds])
        r = subprocess.run([a.bin, "capture", "--model", path, "--input", inputs, "--output", f"file://{ds}",
                            "--layers", "0,1,2", "--final-norm", "--device", "cuda", "--dtype", "f32",
                            "--max-tokens-per-batch", BUDGET["batched"], "--no-progress", *flags, *a.capture_flags],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{arch}: {label}: f32 capture failed\n{r.stderr}")
        else:
            f32_cos = worst(read_dataset(ds)[0], truth)[0]
        f32_ok = f32_cos is not None and f32_cos >= 0.99999
        cos = min(c for _, c, _, _ in figures)
        at_floor = floor_truth < 0.9999 and min(t for *_, t in figures) >= floor_truth - 1e-4
        status = "ok" if cos >= 0.9999 else "ok at bf16's floor" if at_floor else "FAIL"
        if not f32_ok:
            status = "FAIL (f32)"
        ok &= status.startswith("ok")
        detail = ", ".join(f"{m}: min per-token cosine {c:.6f}, max abs diff {d:.4g}, vs f32 truth {t:.6f}"
                           for m, c, d, t in figures)
        f32 = "failed" if f32_cos is None else f"{f32_cos:.7f}"
        print(f"{arch}: bf16 GPU {label} vs transformers: {detail}; f32 GPU vs f32 truth: {f32} [{status}]",
              flush=True)
print("parity:", "all ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
