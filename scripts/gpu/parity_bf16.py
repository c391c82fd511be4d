"""bf16 on the GPU: hslake capture vs transformers for one tiny random model per architecture.
Reports per-token cosine (must be >= 0.9999) and max abs difference per captured point."""
import argparse, json, os, subprocess, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "python"))
from capture_util import ARCHS, VOCAB, randomize, random_samples, read_dataset, write_jsonl  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("capture_flags", nargs="*", help="extra flags for the capture, e.g. --norm fused")
p.add_argument("--work", required=True)
a = p.parse_args()
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
    results = {}
    for mode, budget in (("batched", "16384"), ("single", "1")):
        ds = os.path.join(a.work, f"{arch}-{mode}")
        subprocess.run(["rm", "-rf", ds])
        r = subprocess.run([a.bin, "capture", "--model", path, "--input", inputs, "--output", f"file://{ds}",
                            "--layers", "0,1,2", "--final-norm", "--device", "cuda", "--dtype", "bf16",
                            "--max-tokens-per-batch", budget, "--no-progress", *a.capture_flags], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{arch}: capture failed\n{r.stderr}")
            sys.exit(1)
        results[mode], _ = read_dataset(ds)
    layers = [0, 1, 2]
    worst = {m: [1.0, 0.0] for m in results}
    for sid, s in enumerate(samples):
        captured = {}
        h = model.model.layers[-1].register_forward_hook(
            lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o))
        with torch.no_grad():
            out = model(torch.tensor([s["input_ids"]], device="cuda"), output_hidden_states=True)
        h.remove()
        ref = {f"layer_{l}": (captured["last"] if l == 2 else out.hidden_states[l + 1])[0] for l in layers}
        ref["final_norm"] = out.hidden_states[-1][0]
        for col, want in ref.items():
            want = want.float().cpu().numpy()
            for mode, got in results.items():
                mine = got[sid][col]
                cos = (mine * want).sum(-1) / (np.linalg.norm(mine, axis=-1) * np.linalg.norm(want, axis=-1) + 1e-30)
                worst[mode][0] = min(worst[mode][0], float(cos.min()))
                worst[mode][1] = max(worst[mode][1], float(np.abs(mine - want).max()))
    worst_cos = min(w[0] for w in worst.values())
    status = "ok" if worst_cos >= 0.9999 else "FAIL"
    ok &= worst_cos >= 0.9999
    detail = ", ".join(f"{m}: min per-token cosine {c:.6f}, max abs diff {d:.4g}" for m, (c, d) in worst.items())
    print(f"{arch}: bf16 GPU vs transformers: {detail} [{status}]")
print("parity:", "all ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
