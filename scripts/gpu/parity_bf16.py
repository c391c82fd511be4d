"""bf16 on the GPU: hslake capture vs transformers for one tiny random model per architecture.
Reports per-token cosine (must be >= 0.9999) and max abs difference per captured point."""
import argparse, json, os, subprocess, sys
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "python"))
from capture_util import ARCHS, VOCAB, randomize, random_samples, read_dataset, write_jsonl  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--bin", required=True)
p.add_argument("--work", required=True)
a = p.parse_args()
os.makedirs(a.work, exist_ok=True)
lengths = [7, 64, 300, 1, 129, 33]
ok = True
for arch, make in sorted(ARCHS.items()):
    torch.manual_seed(0)
    model = randomize(make().float().eval(), seed=0).to(torch.bfloat16)
    path = os.path.join(a.work, arch)
    model.save_pretrained(path)
    model = model.cuda().eval()
    model.config._attn_implementation = "sdpa"
    samples = random_samples(lengths, VOCAB, seed=1)
    inputs = write_jsonl(os.path.join(a.work, arch + ".jsonl"), samples)
    ds = os.path.join(a.work, arch + "-ds")
    subprocess.run(["rm", "-rf", ds])
    layers = [0, 1, 2]
    r = subprocess.run([a.bin, "capture", "--model", path, "--input", inputs, "--output", f"file://{ds}",
                        "--layers", "0,1,2", "--final-norm", "--device", "cuda", "--dtype", "bf16", "--no-progress"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{arch}: capture failed\n{r.stderr}")
        ok = False
        continue
    got, _ = read_dataset(ds)
    worst_cos, worst_abs = 1.0, 0.0
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
            mine = got[sid][col]
            cos = (mine * want).sum(-1) / (np.linalg.norm(mine, axis=-1) * np.linalg.norm(want, axis=-1) + 1e-30)
            worst_cos = min(worst_cos, float(cos.min()))
            worst_abs = max(worst_abs, float(np.abs(mine - want).max()))
    status = "ok" if worst_cos >= 0.9999 else "FAIL"
    ok &= worst_cos >= 0.9999
    print(f"{arch}: bf16 GPU vs transformers: min per-token cosine {worst_cos:.6f}, max abs diff {worst_abs:.4g} [{status}]")
print("parity:", "all ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
