"""Mixture-of-experts and MLA capture (Qwen3-MoE, DeepSeek-V3, Kimi-K2 and the Kimi-K2.5 wrapper) against
transformers at TP 1, 2 and 4, and router ties broken exactly as transformers breaks them.

test_capture_parity.py already runs every architecture of capture_util.ARCHS (these included) at TP 1, batched
and one sample at a time; this file adds what is particular to experts and latent attention."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from capture_util import ARCHS, DEEPSEEK_V3, QWEN3_MOE, VOCAB, hf_states, random_samples, randomize, read_dataset, run_capture, save_model, \
    write_jsonl

LENGTHS = [5, 17, 12, 1, 30, 9]
MOE_ARCHS = sorted(a for a in ARCHS if a.startswith(("qwen3_moe", "deepseek_v3")))


def make(arch, tmp_path, seed=0, edit=None):
    torch.manual_seed(seed)
    model = randomize(ARCHS[arch]().float().eval(), seed=seed)
    if edit:
        edit(model)
    model.config._attn_implementation = "sdpa"
    return model, save_model(model, tmp_path / arch)


def layers_of(model):
    return list(range(len(model.model.layers)))


def assert_matches_transformers(model, runs, samples, layers, bound=1e-4):
    """Every run's every sample and layer (and the final norm) within `bound` of transformers."""
    worst = 0.0
    for sid, s in enumerate(samples):
        ref = hf_states(model, s["input_ids"], layers, final_norm=True)
        for name, run in runs.items():
            for col, want in ref.items():
                diff = float(np.abs(run[sid][col] - want).max())
                worst = max(worst, diff)
                assert diff <= bound, f"{name} sample {sid} {col}: max abs diff {diff:.3g} vs transformers"
    return worst


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tp_1_2_and_4_each_match_transformers(arch, tmp_path):
    model, path = make(arch, tmp_path)
    samples = random_samples(LENGTHS, VOCAB, seed=5)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = layers_of(model)
    runs = {}
    for tp in (1, 2, 4):
        run_capture(path, inputs, tmp_path / f"tp{tp}", layers, "--tp", tp, final_norm=True)
        runs[f"TP={tp}"], manifest = read_dataset(tmp_path / f"tp{tp}")
        assert manifest["provenance"]["tp_size"] == tp
    # The default runs grouped-GEMM experts (hidden 64 and width 32 in f32 meet the kernel's
    # 16-byte rows, so the grouped path runs); the per-expert loop, whole and split across ranks.
    for tp in (1, 2):
        out = tmp_path / f"loop_tp{tp}"
        run_capture(path, inputs, out, layers, "--tp", tp, "--moe-kernel", "loop", final_norm=True)
        runs[f"loop TP={tp}"], _ = read_dataset(out)
    worst = assert_matches_transformers(model, runs, samples, layers)
    print(f"{arch}: TP 1/2/4 and loop TP 1/2 max abs diff vs transformers {worst:.3g}")


# 8 heads (and KV heads) and 8 experts: at TP 8 every rank holds one head and one whole expert.
TP8 = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**dict(QWEN3_MOE, num_key_value_heads=8),
                                                            norm_topk_prob=True)),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **dict(DEEPSEEK_V3, num_attention_heads=8, num_key_value_heads=8), q_lora_rank=24, n_group=4, topk_group=2)),
}


@pytest.mark.parametrize("arch", sorted(TP8))
def test_tp_8_with_one_expert_per_rank_matches_transformers(arch, tmp_path):
    torch.manual_seed(2)
    model = randomize(TP8[arch]().float().eval(), seed=2)
    model.config._attn_implementation = "sdpa"
    path = save_model(model, tmp_path / arch)
    samples = random_samples([9, 20, 4], VOCAB, seed=3)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = layers_of(model)
    run_capture(path, inputs, tmp_path / "tp8", layers, "--tp", 8, final_norm=True)
    got, manifest = read_dataset(tmp_path / "tp8")
    assert manifest["provenance"]["tp_size"] == 8
    assert_matches_transformers(model, {"TP=8": got}, samples, layers)


def rewrite_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(cfg)))


def test_kimi_k2_model_type_is_deepseek_v3(tmp_path):
    model, path = make("deepseek_v3_qlora_yarn", tmp_path)
    rewrite_config(path, lambda c: {**c, "model_type": "kimi_k2"})
    samples = random_samples([7, 13], VOCAB, seed=6)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    run_capture(path, inputs, tmp_path / "ds", [0, 2], final_norm=True)
    got, manifest = read_dataset(tmp_path / "ds")
    assert manifest["provenance"]["architecture"] == "DeepseekV3ForCausalLM"
    assert_matches_transformers(model, {"kimi_k2": got}, samples, [0, 2])


def test_kimi_k25_wrapper_captures_the_nested_language_model_and_ignores_vision_tensors(tmp_path):
    model, path = make("deepseek_v3_plain_groups_tied", tmp_path)
    # Kimi-K2.5's layout: the DeepSeek-V3 config under text_config, its tensors under language_model.,
    # and a vision tower and projector beside them that capture must not read.
    weights = {f"language_model.{k}": v for k, v in load_file(path / "model.safetensors").items()}
    g = torch.Generator().manual_seed(9)
    weights["vision_tower.encoder.blocks.0.attn.qkv.weight"] = torch.randn(96, 32, generator=g)
    weights["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14, generator=g)
    weights["mm_projector.proj.0.weight"] = torch.randn(64, 128, generator=g)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    rewrite_config(path, lambda c: {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                    "text_config": {**c, "model_type": "kimi_k2"},
                                    "vision_config": {"hidden_size": 32, "patch_size": 14}})
    samples = random_samples([6, 11, 3], VOCAB, seed=7)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = layers_of(model)
    runs = {}
    for tp in (1, 2):
        run_capture(path, inputs, tmp_path / f"tp{tp}", layers, "--tp", tp, final_norm=True)
        runs[f"TP={tp}"], manifest = read_dataset(tmp_path / f"tp{tp}")
    assert manifest["provenance"]["architecture"] == "KimiK25ForConditionalGeneration"
    assert_matches_transformers(model, runs, samples, layers)


def test_expert_counts_that_tp_cannot_divide_are_named(tmp_path):
    # 6 experts and 4 heads: TP 2 divides both, TP 4 only the heads.
    _, path = make("deepseek_v3_plain_groups_tied", tmp_path)
    rewrite_config(path, lambda c: {**c, "n_routed_experts": 6, "n_group": 1, "topk_group": 1})
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples([4], VOCAB))
    r = run_capture(path, inputs, tmp_path / "ds", [0], "--tp", 4, check=False)
    assert r.returncode != 0
    assert "tensor-parallel size 4 is impossible" in r.stderr and "n_routed_experts = 6" in r.stderr, r.stderr
    assert not (tmp_path / "ds").exists()


def tie_experts(model, a, b):
    """Router rows (and correction biases) of experts a and b made identical in every sparse layer, so every
    token's scores for them tie exactly; their expert weights stay different."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            gate.weight[b] = gate.weight[a]
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias[b] = gate.e_score_correction_bias[a]


def swap_experts(model, a, b):
    """Experts a and b exchanged (weights only): the model transformers would be had it broken the ties the
    other way."""
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for w in (experts.gate_up_proj, experts.down_proj):
                w[[a, b]] = w[[b, a]]


def router_choices(model, input_ids):
    """The expert ids transformers' routers choose, per sparse layer, by forward hooks."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2].clone()))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor([input_ids]))
    for h in hooks:
        h.remove()
    return chosen


@pytest.mark.parametrize("arch", ["qwen3_moe_norm_topk", "deepseek_v3_qlora_yarn"])
def test_exact_router_ties_choose_the_experts_transformers_chooses(arch, tmp_path):
    a, b = 2, 3
    model, path = make(arch, tmp_path, seed=4, edit=lambda m: tie_experts(m, a, b))
    samples = random_samples([23, 9, 16], VOCAB, seed=8)
    # The ties matter: for some tokens transformers picks exactly one of the pair.
    split = sum(int(((ids == a).any(-1) ^ (ids == b).any(-1)).sum())
                for s in samples for ids in router_choices(model, s["input_ids"]))
    assert split > 0, "no token had to break the tie; the test would prove nothing"
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = layers_of(model)
    runs = {}
    for tp in (1, 2):
        run_capture(path, inputs, tmp_path / f"tp{tp}", layers, "--tp", tp, "--max-tokens-per-batch", 4096,
                    final_norm=True)
        runs[f"TP={tp}"], _ = read_dataset(tmp_path / f"tp{tp}")
    assert_matches_transformers(model, runs, samples, layers)
    # And breaking them the other way would have been seen: the swapped model is far from ours.
    swap_experts(model, a, b)
    far = max(float(np.abs(runs["TP=1"][sid][col] - want).max())
              for sid, s in enumerate(samples)
              for col, want in hf_states(model, s["input_ids"], layers, final_norm=True).items())
    assert far > 1e-2, f"swapping the tied experts changes the output by only {far:.3g}"
