"""Helpers for the capture tests: tiny random HF models, running the CLI, and reading a
dataset back with nothing but pyarrow and numpy (tests/python/plane_zstd.py decodes the tensors)."""
import glob
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import plane_zstd
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

ROOT = Path(__file__).resolve().parents[2]

# One tiny model per architecture feature the capture engine implements.
VOCAB = 131
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=VOCAB,
             max_position_embeddings=256, rms_norm_eps=1e-5)

# Mixture-of-experts shapes: 8 experts of width 32, top-2; 8 query heads over 4 KV heads (Qwen3-MoE)
# or 4 MLA heads (DeepSeek-V3), so that TP 2 and 4 split heads and experts evenly.
QWEN3_MOE = dict(SMALL, num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK_V3 = dict(SMALL, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                   qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, routed_scaling_factor=2.5)
# YaRN (factor 4 = 256 / 64) with a short original context, so the ramp between kept and interpolated
# frequencies falls inside the 8 rotary dimensions, and mscale != mscale_all_dim, so both the cos/sin factor
# and the softmax scale differ from 1.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}

ARCHS = {
    # GQA: 8 query heads share 2 KV heads.
    "llama_gqa": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=8, num_key_value_heads=2,
                                                      rope_theta=10000.0)),
    # Llama 3.1 RoPE scaling with a short original context, so all three frequency bands occur;
    # tied embeddings (no lm_head tensor in the checkpoint).
    "llama3_rope_tied": lambda: LlamaForCausalLM(LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    # Sliding window shorter than the longer samples.
    "mistral_window": lambda: MistralForCausalLM(MistralConfig(**SMALL, num_attention_heads=4,
                                                               num_key_value_heads=2, sliding_window=8)),
    # Bias on q/k/v only.
    "qwen2_bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2)),
    # q/k RMS norm, head_dim 32 != 64 / 4.
    "qwen3_qk_norm": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                          head_dim=32)),
    # Every layer sparse, renormalised top-2.
    "qwen3_moe_norm_topk": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True)),
    # 4 layers, decoder_sparse_step 2 makes 1 and 3 sparse, mlp_only_layers makes 3 dense again: only
    # layer 1 has experts. Raw softmax weights; tied embeddings.
    "qwen3_moe_dense_mix_tied": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **dict(QWEN3_MOE, num_hidden_layers=4), norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
        tie_word_embeddings=True)),
    # Low-rank queries, YaRN, 2 groups choosing 1, a dense first layer.
    "deepseek_v3_qlora_yarn": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **DEEPSEEK_V3, q_lora_rank=24, n_group=2, topk_group=1, rope_parameters=dict(YARN))),
    # Full-rank queries, plain RoPE, 4 groups choosing 2, tied embeddings, no renormalisation.
    "deepseek_v3_plain_groups_tied": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **DEEPSEEK_V3, q_lora_rank=None, n_group=4, topk_group=2, norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # RoPE in rotate-half layout (rope_interleave false), one group, attention biases.
    "deepseek_v3_halves_bias": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **DEEPSEEK_V3, q_lora_rank=24, n_group=1, topk_group=1, rope_interleave=False, attention_bias=True)),
}


def hslake_bin():
    """The CLI binary scripts/setup.sh builds (HSLAKE_BIN overrides, e.g. another target dir)."""
    return os.environ.get("HSLAKE_BIN", str(ROOT / "target" / "debug" / "hslake"))


def hslake_gpu_bin():
    """The binary of the GPU commands, which `hslake` runs for them: beside the real file of hslake_bin()."""
    return str(Path(hslake_bin()).resolve().with_name("hslake-gpu"))


def capture_cmd():
    return [hslake_bin(), "capture"]


def run_capture(model, inputs, out, layers, *extra, final_norm=False, check=True, timeout=600, dtype="f32"):
    cmd = capture_cmd() + ["--model", str(model), "--input", str(inputs), "--output", f"file://{out}",
                           "--dtype", dtype, "--device", "cpu", "--no-progress"]
    if layers:
        cmd += ["--layers", ",".join(str(l) for l in layers)]
    if final_norm:
        cmd.append("--final-norm")
    cmd += [str(x) for x in extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"capture failed ({r.returncode}):\n{r.stderr}")
    return r


def randomize(model, seed=0, scale=0.1):
    """HF initialises norms to 1, biases and DeepSeek's router correction bias to 0; make every
    parameter matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(scale * noise)
        for name, b in model.named_buffers():
            # Of the size of the sigmoid scores' spread, so it changes which experts win.
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g, dtype=torch.float32))
    return model


def save_model(model, path):
    model.save_pretrained(path)
    return path


def write_jsonl(path, samples):
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    return path


def random_samples(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, vocab, n).tolist()} for n in lengths]


def decode_tensor(buf, meta, seq_len):
    """Rebuild [seq_len, hidden] float32 values from a stored column value and its metadata."""
    t = plane_zstd.decode(buf, meta, seq_len)
    if meta["dtype"] == "bf16":
        return (t.astype(np.uint32) << 16).view(np.float32)
    if meta["dtype"] in ("f16", "f32"):
        return t.astype(np.float32)
    raise ValueError(f"unexpected dtype {meta['dtype']}")


def manifests(ds):
    return sorted(glob.glob(os.path.join(ds, "_hslake", "versions", "*.json")))


def read_dataset(ds, only=None):
    """{sample_id: {"input_ids", "loss_mask", column: [seq_len, hidden] float32, "stats": {name: value}}} of the
    latest version (of the sample ids in `only`, when given: decoding every row of a large dataset takes
    minutes); "stats" holds the stored statistics columns (layer_2_norm, layer_2_max_abs, ...)."""
    files = manifests(ds)
    assert files, f"no manifest under {ds}"
    manifest = json.load(open(files[-1]))
    out = {}
    for shard in manifest["shards"]:
        table = pq.read_table(os.path.join(ds, shard["path"]))
        if only is not None:
            table = table.filter(pc.is_in(table["sample_id"], value_set=pa.array(sorted(only), table["sample_id"].type)))
        tensor_cols = {}
        for field in table.schema:
            if field.metadata and b"hslake.tensor" in field.metadata:
                tensor_cols[field.name] = json.loads(field.metadata[b"hslake.tensor"])
        rows = table.to_pylist()
        for row in rows:
            sid = row["sample_id"]
            assert sid not in out, f"sample {sid} appears twice"
            rec = {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}
            for col, meta in tensor_cols.items():
                rec[col] = decode_tensor(row[col], meta, row["seq_len"])
            rec["stats"] = {k: v for k, v in row.items()
                            if k.endswith(("_norm", "_max_abs", "_nan_count", "_inf_count"))}
            out[sid] = rec
    return out, manifest


def hf_states(model, input_ids, layers, final_norm):
    """Reference states of one unpadded sample: {column: [seq_len, hidden]} from HF.

    layer i < L-1 comes from output_hidden_states[i + 1]; HF's last entry is after the final
    norm, so the last layer's own output is taken with a forward hook on that layer."""
    captured = {}
    last = len(model.model.layers) - 1
    hook = model.model.layers[last].register_forward_hook(
        lambda m, i, o: captured.__setitem__("last", (o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    hook.remove()
    hs = out.hidden_states
    ref = {}
    for l in layers:
        ref[f"layer_{l}"] = (captured["last"] if l == last else hs[l + 1])[0].float().numpy()
    if final_norm:
        ref["final_norm"] = hs[-1][0].float().numpy()
    return ref
