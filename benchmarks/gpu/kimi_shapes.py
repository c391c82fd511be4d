"""Writes a checkpoint with Kimi-K2's shapes and formats, cut to the layers a machine's disk holds: hidden 7168,
64 MLA heads (q_lora 1536, kv_lora 512), a dense first layer (18432), then MoE layers of 384 routed experts of 2048
(8 active) plus one shared expert, vocabulary 163840; routed experts in compressed-tensors pack-quantized INT4,
groups of 32 (as Kimi-K2.5 ships them), everything else bf16. Random values, made on the GPU and written layer by
layer, so the host never holds more than one layer; and a JSONL of random token ids to capture.

Usage: kimi_shapes.py OUT_DIR [--moe-layers N | --moe-layers auto] [--samples 128] [--seq 2048] [--device cuda]
(auto: as many MoE layers as leave 10 GB of the disk under OUT_DIR free, at most 5). --tiny makes the same layout at
toy sizes, for a CPU dry run."""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config

# Kimi-K2-Thinking's compressed-tensors `ignore` list: only the routed experts are INT4.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
GROUP = 32


def config(moe_layers, tiny):
    sizes = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
                 num_key_value_heads=64, n_routed_experts=384, kv_lora_rank=512, q_lora_rank=1536,
                 qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=163840)
    if tiny:
        sizes = dict(sizes, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=64, q_lora_rank=96, vocab_size=1000)
    cfg = DeepseekV3Config(**sizes, num_hidden_layers=1 + moe_layers, first_k_dense_replace=1,
                           num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
                           routed_scaling_factor=2.827, norm_topk_prob=True, max_position_embeddings=131072,
                           rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.quantization_config = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": GROUP, "dynamic": False,
                                                  "observer": "minmax"}}},
        "ignore": KIMI_IGNORE}
    return cfg


def layer_bytes(cfg):
    """Bytes of one MoE layer as stored (INT4 experts with bf16 group scales; bf16 attention and shared expert)."""
    h, e, m = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    experts = e * 3 * h * m * (0.5 + 2 / GROUP)
    heads, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attn = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h)
    return experts + 2 * (attn + 3 * h * m + e * h)


class Writer:
    """Random tensors under their checkpoint names, made on `device`, written one file per `flush`."""

    def __init__(self, out, device):
        self.out, self.device, self.tensors, self.index, self.files = out, device, {}, {}, 0
        self.g = torch.Generator(device=device).manual_seed(0)

    def normal(self, name, shape, std=0.02):
        t = torch.randn(shape, generator=self.g, device=self.device, dtype=torch.float32) * std
        self.tensors[name] = t.to(torch.bfloat16).cpu()

    def norm(self, name, n):
        t = 1.0 + 0.1 * torch.randn(n, generator=self.g, device=self.device, dtype=torch.float32)
        self.tensors[name] = t.to(torch.bfloat16).cpu()

    def int4(self, module, out_features, in_features, std=0.02):
        # Codes uniform over [-8, 7] have a standard deviation of about 4.6: scales of std / 4.6 give weights of
        # about `std`, as a trained expert's.
        words = torch.randint(-2**31, 2**31, (out_features, in_features // 8), generator=self.g,
                              device=self.device, dtype=torch.int64).to(torch.int32)
        scale = (std / 4.6) * (0.5 + torch.rand(out_features, in_features // GROUP, generator=self.g,
                                                device=self.device))
        self.tensors[f"{module}.weight_packed"] = words.cpu()
        self.tensors[f"{module}.weight_scale"] = scale.to(torch.bfloat16).cpu()
        self.tensors[f"{module}.weight_shape"] = torch.tensor([out_features, in_features], dtype=torch.int32)

    def flush(self):
        name = f"model-{self.files:05d}.safetensors"
        save_file(self.tensors, os.path.join(self.out, name), metadata={"format": "pt"})
        self.index.update({k: name for k in self.tensors})
        self.tensors, self.files = {}, self.files + 1

    def finish(self):
        with open(os.path.join(self.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": self.index}, f)


def attention(w, p, cfg):
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    w.normal(f"{p}.q_a_proj.weight", (cfg.q_lora_rank, h))
    w.norm(f"{p}.q_a_layernorm.weight", cfg.q_lora_rank)
    w.normal(f"{p}.q_b_proj.weight", (heads * qk, cfg.q_lora_rank))
    w.normal(f"{p}.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h))
    w.norm(f"{p}.kv_a_layernorm.weight", cfg.kv_lora_rank)
    w.normal(f"{p}.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    w.normal(f"{p}.o_proj.weight", (h, heads * cfg.v_head_dim))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--moe-layers", default="auto")
    a.add_argument("--samples", type=int, default=128)
    a.add_argument("--seq", type=int, default=2048)
    a.add_argument("--device", default="cuda")
    a.add_argument("--tiny", action="store_true")
    a = a.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.moe_layers == "auto":
        per_layer = layer_bytes(config(1, a.tiny))
        free = shutil.disk_usage(a.out).free - 10e9 - 6e9  # 10 GB left free; embeddings, LM head, dense layer
        moe = max(1, min(5, int(free // per_layer)))
    else:
        moe = int(a.moe_layers)
    cfg = config(moe, a.tiny)
    cfg.save_pretrained(a.out)
    h, v = cfg.hidden_size, cfg.vocab_size
    w = Writer(a.out, torch.device(a.device))
    w.normal("model.embed_tokens.weight", (v, h))
    w.norm("model.norm.weight", h)
    w.normal("lm_head.weight", (v, h))
    w.flush()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", h)
        w.norm(f"{p}.post_attention_layernorm.weight", h)
        attention(w, f"{p}.self_attn", cfg)
        if i < cfg.first_k_dense_replace:
            for proj, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                                ("down_proj", (h, cfg.intermediate_size))):
                w.normal(f"{p}.mlp.{proj}.weight", shape)
        else:
            m, e = cfg.moe_intermediate_size, cfg.n_routed_experts
            w.normal(f"{p}.mlp.gate.weight", (e, h))
            bias = 0.01 * torch.randn(e, generator=w.g, device=w.device)
            w.tensors[f"{p}.mlp.gate.e_score_correction_bias"] = bias.float().cpu()
            for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                w.normal(f"{p}.mlp.shared_experts.{proj}.weight", shape)
            for j in range(e):
                w.int4(f"{p}.mlp.experts.{j}.gate_proj", m, h)
                w.int4(f"{p}.mlp.experts.{j}.up_proj", m, h)
                w.int4(f"{p}.mlp.experts.{j}.down_proj", h, m)
        w.flush()
        print(f"layer {i} written", flush=True)
    w.finish()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (a.samples, a.seq), generator=g)
    with open(a.out.rstrip("/") + ".jsonl", "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    gb = sum(os.path.getsize(os.path.join(a.out, n)) for n in os.listdir(a.out)) / 1e9
    print(f"kimi shapes: 1 dense + {moe} MoE layers, {gb:.1f} GB in {a.out}; "
          f"{a.samples} x {a.seq} tokens in {a.out.rstrip('/')}.jsonl")


if __name__ == "__main__":
    main()
