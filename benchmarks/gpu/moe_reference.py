"""The transformers side of benchmarks/gpu/moe.sh, one step per run (each step is its own process, so that the
GPU holds one copy of a model at a time):

  make    MODEL DIR   random weights (seeded) on the device, transformers' prefill-only tokens/s at batch x seq,
                      reference bf16 states of the first samples for the cosine, save_pretrained, the inputs JSONL
  fp8     MODEL DIR   the same weights again, every projection quantized on the device to FP8 blocks of 128 x 128
                      (DeepSeek-V3's layout: float8_e4m3fn + weight_scale_inv); the reference states come from
                      transformers run on the dequantized weights
  int4    MODEL DIR   the same weights again, the routed experts quantized on the device to compressed-tensors
                      pack-quantized INT4 (Kimi-K2-Thinking / K2.5's layout: symmetric, groups of 32, eight codes per
                      int32, bf16 scales; attention, shared experts, dense MLPs and the LM head stay bf16); reference
                      as for fp8
  cosine  DIR DATASET LABEL  per-token cosine of our captured states against the reference states

make, fp8 and int4 also measure the bf16 noise floor the cosine is judged against: transformers against itself,
the reference samples run again with eager attention instead of sdpa (the same network, rounded differently from
the first layer on), per layer, and how many tokens the two runs route to a different set of experts in each MoE
layer (the routers' top-k, recorded by forward hooks).
  mfu     STEP TOKENS_PER_SEC   MFU on active parameters of the model of moe.sh's step (ds, ds8, qw)
  layers  DIR         the layers captured and compared (all of a short model; EAGLE-3's aux layers and the last)
  summary OUT         the table of every step's numbers (JSON lines in OUT/moe_rows.jsonl)

MODEL is deepseek_v3 (hidden 7168, 128 heads, kv_lora 512, q_lora 1536, 256 experts of 2048, 8 active, n_group 8 /
topk_group 4; 3 dense + 2 MoE layers) or qwen3_30b_a3b (48 layers, 128 experts of 768, 8 active). --tiny gives the
same architectures at toy sizes for a CPU dry run (DEVICE=cpu)."""
import argparse, json, os, re, sys, time

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

# H200 dense bf16 peak (NVIDIA's datasheet figure without sparsity), for MFU.
PEAK_FLOPS = 989e12


def config(model, tiny):
    if model == "deepseek_v3":
        sizes = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                     num_key_value_heads=128, n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280)
        if tiny:
            sizes = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=128, q_lora_rank=128,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=1000)
        return DeepseekV3Config(**sizes, num_hidden_layers=5, first_k_dense_replace=3, num_experts_per_tok=8,
                                n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                tie_word_embeddings=False)
    sizes = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_hidden_layers=48, vocab_size=151936)
    if tiny:
        sizes = dict(sizes, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_experts=16, num_hidden_layers=4, vocab_size=1000)
    return Qwen3MoeConfig(**sizes, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def active_params(cfg):
    """Parameters one token multiplies by (embedding lookups and the LM head excluded), for MFU."""
    h = cfg.hidden_size
    if isinstance(cfg, DeepseekV3Config):
        heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h)
        dense = 3 * h * cfg.intermediate_size
        moe = 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) \
            + h * cfg.n_routed_experts
        n_dense = cfg.first_k_dense_replace
        return cfg.num_hidden_layers * attn + n_dense * dense + (cfg.num_hidden_layers - n_dense) * moe
    d = cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    moe = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
    return cfg.num_hidden_layers * (attn + moe)


def default_layers(n):
    """Every layer of a short model; else EAGLE-3's aux layers (1, n/2 - 1, n - 4) and the last, so that the
    captured dataset of a 48-layer model fits the GPU machine's disk beside its checkpoint."""
    return list(range(n)) if n <= 8 else [1, n // 2 - 1, n - 4, n - 1]


def build(cfg, device):
    torch.manual_seed(0)
    cls = DeepseekV3ForCausalLM if isinstance(cfg, DeepseekV3Config) else Qwen3MoeForCausalLM
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(cfg)
    # What from_pretrained(dtype=bfloat16) gives a user: bf16 weights, but RoPE's inverse frequencies (computed
    # in f32 at init and never cast) and the modules the class keeps in f32 (DeepSeek's router and correction
    # bias) stay f32. A bare .to(bfloat16) also rounds inv_freq, and that reference's angles drift from the
    # true ones with position: 0.998 cosine at token 2047 of a DeepSeek-V3-wide layer, in f32 as much as in bf16.
    freqs = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if any(k in n for k in keep):
                t.data = t.data.float()
    for n, f in freqs.items():
        module, attr = n.rsplit(".", 1)
        setattr(model.get_submodule(module), attr, f)
    with torch.no_grad():
        # Random init leaves norms at 1 and DeepSeek's correction bias at 0; small noise makes routing realistic.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn_like(b))
    return model


def inputs(cfg, path, samples, seq):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (samples, seq), generator=g)
    with open(path, "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return ids


def prefill_tokens_per_sec(model, ids, iters):
    with torch.no_grad():
        for _ in range(2):
            model.model(input_ids=ids)
        sync(ids.device)
        t = time.perf_counter()
        for _ in range(iters):
            model.model(input_ids=ids)
        sync(ids.device)
    return iters * ids.numel() / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_states(model, ids, layers):
    """{"i/layer_l": f32 states} of each captured layer for each sample, one sample at a time (unpadded), and
    {"i/route_l": sorted top-k expert ids per token} of each MoE layer, from the routers' forward hooks."""
    out, routes, hooks, current = {}, {}, [], [None]
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            layer = int(name.split(".")[2])
            # Every router returns (logits, weights, indices).
            hooks.append(module.register_forward_hook(
                lambda _m, _i, o, layer=layer: routes.__setitem__(f"{current[0]}/route_{layer}",
                                                                   o[2].sort(-1).values.cpu().numpy())))
    try:
        with torch.no_grad():
            for i, row in enumerate(ids):
                current[0] = i
                hs = model.model(input_ids=row[None], output_hidden_states=True).hidden_states
                for l in layers:
                    out[f"{i}/layer_{l}"] = hs[l + 1][0].float().cpu().numpy()
    finally:
        for h in hooks:
            h.remove()
    return out, routes


def token_cosines(a, b):
    """Per-token cosine of two [tokens, hidden] arrays."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return cos


def summarise(cos):
    return dict(min=round(float(cos.min()), 6), p001=round(float(np.quantile(cos, 0.001)), 6),
                mean=round(float(cos.mean()), 6), below_0_999=int((cos < 0.999).sum()), tokens=int(cos.size))


def reference_states(model, ids, layers, path, label, row):
    """The reference (sdpa) states and routes, saved for the cosine step, and transformers' own noise floor: the
    same samples with eager attention, compared per layer and per router."""
    ref, ref_routes = run_states(model, ids, layers)
    np.savez(path, **ref)
    try:
        model.set_attn_implementation("eager")
    except Exception as e:  # noqa: BLE001 - an older transformers: report, do not fail the run
        print(f"{label}: no noise-floor run ({e})")
        return
    other, other_routes = run_states(model, ids, layers)
    model.set_attn_implementation("sdpa")
    for l in layers:
        cos = np.concatenate([token_cosines(ref[f"{i}/layer_{l}"], other[f"{i}/layer_{l}"]) for i in range(len(ids))])
        stats = summarise(cos)
        row(model=label, what=f"noise floor (transformers sdpa vs eager) layer_{l}", **stats)
        print(f"{label}: noise floor layer_{l} cosine {stats}")
    for key in sorted({k.split("/")[1] for k in ref_routes}, key=lambda k: int(k.split("_")[1])):
        a = np.concatenate([ref_routes[f"{i}/{key}"] for i in range(len(ids))])
        b = np.concatenate([other_routes[f"{i}/{key}"] for i in range(len(ids))])
        flips = int((a != b).any(-1).sum())
        row(model=label, what=f"noise floor routing flips {key.replace('route_', 'layer_')}", flips=flips,
            tokens=int(a.shape[0]))
        print(f"{label}: noise floor {key}: {flips} of {a.shape[0]} tokens routed to another expert set")


FP8_LINEAR = re.compile(r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|k_proj|v_proj|"
                        r"gate_proj|up_proj|down_proj)\.weight$")


def quantize_fp8(w, block=128):
    """[out, in] -> (float8_e4m3fn, f32 scale_inv [ceil(out/128), ceil(in/128)], the dequantized bf16 matrix)."""
    out, inp = w.shape
    po, pi = -out % block, -inp % block
    padded = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = padded.view((out + po) // block, block, (inp + pi) // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(out + po, inp + pi)[:out, :inp]
    return q.view(out + po, inp + pi)[:out, :inp].contiguous(), scale, deq.to(torch.bfloat16)


# Kimi-K2-Thinking's compressed-tensors `ignore` list: only the routed experts are INT4.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def quantize_int4(w, group=32):
    """[out, in] -> (weight_packed int32 [out, in/8], bf16 weight_scale [out, in/group], the dequantized bf16
    matrix): symmetric codes in [-8, 7] stored plus 8, column 8j+k in bits 4k..4k+4 of word j (compressed-tensors'
    pack-quantized), round half to even as numpy's rint in tests/python/test_capture_quant.py."""
    out, inp = w.shape
    g = w.float().view(out, inp // group, group)
    scale = (g.abs().amax(-1).clamp(min=1e-12) / 7.0).to(torch.bfloat16).float()
    q = torch.clamp(torch.round(g / scale[..., None]), -8, 7).to(torch.int64).view(out, inp)
    shifts = torch.arange(8, device=w.device, dtype=torch.int64) * 4
    words = ((q + 8).view(out, inp // 8, 8) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    deq = (q.float() * scale.repeat_interleave(group, 1)).to(torch.bfloat16)
    return words, scale.to(torch.bfloat16), deq


def quantized(name, w, scheme):
    """The checkpoint tensors of one projection in `scheme` and its dequantized weight, or None to keep it bf16."""
    if scheme == "fp8" and FP8_LINEAR.search(name):
        q, scale, deq = quantize_fp8(w)
        return {name: q, name[:-len("weight")] + "weight_scale_inv": scale}, deq
    if scheme == "int4" and ROUTED_EXPERT.search(name):
        packed, scale, deq = quantize_int4(w)
        module = name[:-len(".weight")]
        return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale,
                f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}, deq
    return None


def write_quantized(model, path, scheme):
    """Saves the model with its projections quantized per `scheme` (every other tensor in bf16) and puts the
    dequantized weights into the model, which then is the reference. The checkpoint goes out in shards of
    experts-sized pieces so that the host never holds more than one shard."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    if scheme == "fp8":
        model.config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}
    else:
        model.config.quantization_config = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 32, "dynamic": False,
                                                      "observer": "minmax"}}},
            "ignore": KIMI_IGNORE}
    model.config.save_pretrained(path)
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    with torch.no_grad():
        for name, w, fused in named_linears(model):
            if name.startswith("lm_head."):
                continue
            q = quantized(name, w, scheme)
            if q is not None:
                tensors, deq = q
                added = {k: v.cpu() for k, v in tensors.items()}
                if fused is None:
                    w.copy_(deq)
                else:
                    # An expert's slice of transformers' fused [E, rows, cols] parameter.
                    param, j, start = fused
                    rows = param[j] if start is None else param[j, start:start + deq.shape[0]]
                    rows.copy_(deq)
            else:
                added = {name: w.detach().contiguous().cpu()}
            shard.update(added)
            shard_bytes += sum(t.numel() * t.element_size() for t in added.values())
            if shard_bytes > 4e9:
                flush()
        # Persistent buffers (DeepSeek's e_score_correction_bias) are checkpoint tensors too.
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():
            if name in persistent:
                shard[name] = b.detach().contiguous().cpu()
        flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def named_linears(model):
    """(checkpoint name, [out, in] weight) of every projection, experts unfused into their published names."""
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[:-len("gate_up_proj")]
            inter = p.shape[1] // 2
            for j in range(p.shape[0]):
                yield f"{prefix}{j}.gate_proj.weight", p[j, :inter], (p, j, 0)
                yield f"{prefix}{j}.up_proj.weight", p[j, inter:], (p, j, inter)
        elif name.endswith("experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for j in range(p.shape[0]):
                yield f"{prefix}{j}.down_proj.weight", p[j], (p, j, None)
        else:
            yield name, p, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["make", "fp8", "int4", "cosine", "mfu", "layers", "summary"])
    p.add_argument("args", nargs="*")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--ref-samples", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--layers", default="")
    p.add_argument("--rows", default="moe_rows.jsonl")
    a = p.parse_args()
    row = lambda **kv: open(a.rows, "a").write(json.dumps(kv) + "\n")
    if a.step in ("make", "fp8", "int4"):
        name, out = a.args
        cfg = config(name, a.tiny)
        device = torch.device(a.device)
        t = time.time()
        model = build(cfg, device)
        layers = [int(x) for x in a.layers.split(",")] if a.layers else default_layers(cfg.num_hidden_layers)
        ids = inputs(cfg, os.path.join(out + ".jsonl"), a.samples, a.seq)
        label = name if a.step == "make" else f"{name} {a.step}"
        if a.step == "make":
            tps = prefill_tokens_per_sec(model, ids[:a.batch].to(device), a.iters)
            mfu = tps * 2 * active_params(cfg) / PEAK_FLOPS
            row(model=label, what="transformers prefill", tokens_per_sec=round(tps), mfu=round(mfu, 4),
                active_params=active_params(cfg))
            model.save_pretrained(out)
        else:
            write_quantized(model, out, a.step)
        reference_states(model, ids[:a.ref_samples].to(device), layers, out + ".ref.npz", label, row)
        print(f"{label}: ready in {time.time() - t:.0f}s ({sum(p.numel() for p in model.parameters()) / 1e9:.1f} B "
              f"parameters, active {active_params(cfg) / 1e9:.2f} B)")
    elif a.step == "layers":
        n = json.load(open(os.path.join(a.args[0], "config.json")))["num_hidden_layers"]
        print(",".join(map(str, default_layers(n))))
    elif a.step == "mfu":
        step, tps = a.args
        cfg = config("qwen3_30b_a3b" if step == "qw" else "deepseek_v3", a.tiny)
        print(round(float(tps) * 2 * active_params(cfg) / PEAK_FLOPS, 4))
    elif a.step == "cosine":
        model_dir, dataset, label = a.args
        from capture_util import read_dataset  # tests/python, on PYTHONPATH from env.sh
        ref = np.load(model_dir + ".ref.npz")
        got, _ = read_dataset(dataset, only={int(k.split("/")[0]) for k in ref.files})
        # The reference holds every default layer; a capture of fewer (LAYERS_<step>) is compared on the layers it
        # holds. A referenced sample without one of them still fails (KeyError), and so does a capture sharing none.
        captured = {col for rec in got.values() for col in rec if col.startswith("layer_")}
        per_layer = {}
        for key in ref.files:
            sid, col = key.split("/")
            if col in captured:
                per_layer.setdefault(col, []).append(token_cosines(got[int(sid)][col], ref[key]))
        if not per_layer:
            sys.exit(f"{label}: the capture in {dataset} holds none of the reference's layers "
                     f"({sorted({k.split('/')[1] for k in ref.files})}); captured: {sorted(captured)}")
        worst = 1.0
        # Per layer, so that a drop that starts at the first MoE layer (a token routed to other
        # experts after a near tie in bf16) tells itself apart from one that grows with depth.
        for col in sorted(per_layer, key=lambda c: int(c.split("_")[1])):
            cos = np.concatenate(per_layer[col])
            worst = min(worst, float(cos.min()))
            stats = summarise(cos)
            row(model=label, what=f"cosine {col}", **stats)
            print(f"{label}: {col} cosine {stats}")
        row(model=label, what="min per-token cosine vs transformers (bf16)", cosine=round(worst, 6))
        print(f"{label}: min per-token cosine {worst:.6f}")
        # The stored statistics against the same quantities of the decoded values (they are computed where
        # the states are split into planes: on the GPU, by default, on CUDA runs).
        stat_err = 0.0
        for rec in got.values():
            for col in (k for k in rec if k.startswith("layer_")):
                x = rec[col].astype(np.float64)
                norm = float(np.sqrt((x * x).sum(-1)).mean())
                st = rec["stats"]
                stat_err = max(stat_err, abs(st[f"{col}_norm"] - norm) / max(norm, 1e-30),
                               abs(st[f"{col}_max_abs"] - float(np.abs(x).max())) / max(float(np.abs(x).max()), 1e-30))
                assert st[f"{col}_nan_count"] == 0 and st[f"{col}_inf_count"] == 0, (col, st)
        row(model=label, what="stored statistics vs decoded values, max relative difference", value=float(f"{stat_err:.3g}"))
        print(f"{label}: stored statistics vs decoded values: max relative difference {stat_err:.2e}")
        assert stat_err < 1e-5, stat_err
    else:
        rows = [json.loads(l) for l in open(a.rows)]
        print(f"{'model':<22} {'measurement':<44} {'value':>14} {'MFU':>7}")
        for r in rows:
            value = r.get("tokens_per_sec", r.get("cosine", r.get("seconds", r.get("min", r.get("value")))))
            if "flips" in r:
                value = f"{r['flips']}/{r['tokens']}"
            unit = " tok/s" if "tokens_per_sec" in r else (" s" if "seconds" in r else "")
            mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
            print(f"{r['model']:<22} {r['what']:<44} {str(value) + unit:>14} {mfu:>7}")


if __name__ == "__main__":
    main()
