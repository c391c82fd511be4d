"""The Python side of benchmarks/gpu/vllm_compare.sh, one step per process (so the GPU holds one model at a time):

  make    MODEL DIR   random bf16 weights made by transformers (seeded; moe_reference.py's recipe for the MoE
                      models; --num-layers cuts the model), saved with save_pretrained, SAMPLES samples of SEQ random
                      tokens in DIR.jsonl, then (unless --no-truth) the f32 truth: the same network upcast to f32
                      (model.float()), run on the first REF samples one at a time, its states at the compared layers
                      in DIR.truth.npz
  ids     DIR         the vLLM layer ids compared (id i: the residual stream entering decoder layer i, our layer_{i-1},
                      transformers' hidden_states[i]): all of a short model but the last, else 2, L/2, L-3, L-1
  cosine  DIR DATASET VLLM_SAVE LABEL   per-token cosines per layer: ours against the truth, vLLM's against the
                      truth, ours against vLLM's (VLLM_SAVE '-' when vLLM did not run)
  summary ROWS OUT    every step's rows (JSON lines) as one JSON object per model, with the ratios

MODEL is llama8b (Llama-3.1-8B shapes), qwen3_30b_a3b (--num-layers of its 48), or deepseek_v3 (moe_reference.py's cut:
3 dense + 2 MoE layers); --tiny gives toy sizes of the same architectures for a CPU dry run (--device cpu)."""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_reference as mr  # noqa: E402


def llama_config(tiny):
    from transformers import LlamaConfig
    sizes = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    if tiny:
        sizes = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
    return LlamaConfig(**sizes, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       tie_word_embeddings=False)


def build(model, tiny, num_layers, device):
    if model == "llama8b":
        from transformers import LlamaForCausalLM
        cfg = llama_config(tiny)
        if num_layers:
            cfg.num_hidden_layers = num_layers
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            m = LlamaForCausalLM(cfg)
        freqs = {n: b.clone() for n, b in m.named_buffers() if n.endswith("inv_freq")}
        m = m.to(torch.bfloat16).eval()
        for n, f in freqs.items():
            module, attr = n.rsplit(".", 1)
            setattr(m.get_submodule(module), attr, f)
        return m
    cfg = mr.config(model, tiny)
    if num_layers:
        cfg.num_hidden_layers = num_layers
        if hasattr(cfg, "first_k_dense_replace"):
            # A cut keeps at least one MoE layer.
            cfg.first_k_dense_replace = min(cfg.first_k_dense_replace, num_layers - 1)
    return mr.build(cfg, torch.device(device))


def layer_ids(n):
    return list(range(1, n)) if n <= 5 else [2, n // 2, n - 3, n - 1]


def make(a):
    model_name, out = a.args
    t = time.time()
    model = build(model_name, a.tiny, a.num_layers, a.device)
    cfg = model.config
    ids = mr.inputs(cfg, out + ".jsonl", a.samples, a.seq)
    model.save_pretrained(out)
    if model_name == "deepseek_v3":
        # vLLM reads quantization_config as FP8; a bf16 checkpoint carries none.
        path = os.path.join(out, "config.json")
        c = json.load(open(path))
        c.pop("quantization_config", None)
        json.dump(c, open(path, "w"), indent=1)
    print(f"{model_name}: {cfg.num_hidden_layers} layers saved in {time.time() - t:.0f}s")
    if a.no_truth:
        return
    # The truth: this very network (its bf16 weights) computed in f32, one sample at a time.
    model = model.float()
    keep = layer_ids(cfg.num_hidden_layers)
    truth = {}
    with torch.no_grad():
        for i, row in enumerate(ids[:a.ref_samples]):
            hs = model.model(input_ids=row[None].to(a.device), output_hidden_states=True).hidden_states
            for l in keep:
                truth[f"{i}/id_{l}"] = hs[l][0].float().cpu().numpy()
    np.savez(out + ".truth.npz", **truth)
    print(f"{model_name}: f32 truth of {min(a.ref_samples, len(ids))} samples at ids {keep} in {time.time() - t:.0f}s")


def vllm_states(save_dir, i):
    """vllm_extract.py's saved sample i: [tokens, layers, hidden] f32 states and their layer ids (bf16 on disk,
    which numpy cannot read: through torch)."""
    from safetensors.torch import load_file
    d = load_file(os.path.join(save_dir, f"vllm_sample{i}.safetensors"))
    return d["hidden_states"].float().numpy(), [int(x) for x in d["layer_ids"]]


def cosine(a):
    model_dir, dataset, vllm_save, label = a.args
    from capture_util import read_dataset  # tests/python, on PYTHONPATH from env.sh
    truth = np.load(model_dir + ".truth.npz")
    samples = sorted({int(k.split("/")[0]) for k in truth.files})
    ours, _ = read_dataset(dataset, only=set(samples))
    rows = []
    per = {}
    for i in samples:
        theirs = vllm_states(vllm_save, i) if vllm_save != "-" else None
        for key in (k for k in truth.files if k.startswith(f"{i}/")):
            lid = int(key.split("_")[1])
            t = truth[key]
            o = ours[i][f"layer_{lid - 1}"]
            d = per.setdefault(lid, {"ours vs f32 truth": [], "vllm vs f32 truth": [], "ours vs vllm": []})
            d["ours vs f32 truth"].append(mr.token_cosines(o, t))
            if theirs is not None:
                v = theirs[0][:, theirs[1].index(lid), :]
                d["vllm vs f32 truth"].append(mr.token_cosines(v, t))
                d["ours vs vllm"].append(mr.token_cosines(o, v))
    for lid in sorted(per):
        for what, parts in per[lid].items():
            if parts:
                stats = mr.summarise(np.concatenate(parts))
                rows.append(dict(model=label, what=f"cosine {what} id_{lid} (our layer_{lid - 1})", **stats))
                print(f"{label}: id {lid} {what}: {stats}")
    with open(a.rows, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def summary(a):
    rows_path, out = a.args
    rows = [json.loads(l) for l in open(rows_path)]
    models = {}
    for r in rows:
        m = models.setdefault(r.pop("model"), {})
        what = r.pop("what")
        m[what] = r if len(r) != 1 else next(iter(r.values()))
    for m in models.values():
        v, o = m.get("vllm tokens/s"), m.get("ours capture + write tokens/s")
        if isinstance(v, (int, float)) and isinstance(o, (int, float)) and v:
            m["hslake / vllm"] = round(o / v, 3)
        mins = {}
        for what, r in m.items():
            if what.startswith("cosine ") and isinstance(r, dict):
                side = what.split(" id_")[0][len("cosine "):]
                mins[side] = min(mins.get(side, 1.0), r["min"])
        m["min cosine"] = mins
        if "ours vs f32 truth" in mins and "vllm vs f32 truth" in mins:
            m["ours no farther from the truth than vllm"] = mins["ours vs f32 truth"] >= mins["vllm vs f32 truth"] - 1e-4
    json.dump(models, open(out, "w"), indent=1)
    print(json.dumps(models, indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["make", "ids", "cosine", "summary"])
    p.add_argument("args", nargs="*")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-layers", type=int, default=0)
    p.add_argument("--samples", type=int, default=320)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ref-samples", type=int, default=2)
    p.add_argument("--no-truth", action="store_true", help="make: the checkpoint and samples only")
    p.add_argument("--rows", default="vllm_rows.jsonl")
    a = p.parse_args()
    if a.step == "make":
        make(a)
    elif a.step == "ids":
        n = json.load(open(os.path.join(a.args[0], "config.json")))["num_hidden_layers"]
        print(",".join(map(str, layer_ids(n))))
    elif a.step == "cosine":
        cosine(a)
    else:
        summary(a)


if __name__ == "__main__":
    main()
