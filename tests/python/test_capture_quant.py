"""Quantized checkpoints as published: DeepSeek-V3's FP8 blocks (`weight_scale_inv`) and compressed-tensors'
INT4 `pack-quantized` (Kimi-K2-Thinking / K2.5), against transformers run on the same weights dequantized to
f32 by this file's own numpy (never by the code under test), at TP 1, 2 and 4 (and through the Kimi-K2.5
wrapper); and the named refusals: a
wrong-shaped scale, a group size that does not divide, an unknown quant_method, a TP split that cuts a block,
and a model that does not fit the GPU memory it is given."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, \
    Qwen3MoeForCausalLM

from capture_util import DEEPSEEK_V3, QWEN3_MOE, SMALL, VOCAB, hf_states, random_samples, randomize, read_dataset, \
    run_capture, write_jsonl

LENGTHS = [5, 17, 12, 1, 9]

MODELS = {
    # Low-rank queries of rank 20: q_a_proj's rows and q_b_proj's columns end in a partial FP8 block.
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3, q_lora_rank=20, n_group=2,
                                                                  topk_group=1)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=8, num_key_value_heads=2,
                                                  rope_theta=10000.0)),
}

# Every projection: what a published FP8 DeepSeek-V3 quantizes (embeddings, norms, the router and the LM head stay
# in their float dtype), and what compressed-tensors' `Linear` target names before `ignore` removes some.
LINEAR = re.compile(r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|k_proj|v_proj|gate_proj|"
                        r"up_proj|down_proj)\.weight$")
# Kimi-K2-Thinking's ignore list: only the routed experts are INT4.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def e4m3_to_f32(codes):
    """float8_e4m3fn bytes decoded from their bit fields: sign, 4 exponent bits of bias 7, 3 mantissa bits;
    exponent 0 is subnormal; S.1111.111 is NaN."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = man / 8.0 * 2.0 ** -6
    v = sign * np.where(exp == 0, sub, normal)
    return np.where((exp == 0xF) & (man == 7), np.nan, v).astype(np.float32)


def test_the_e4m3_decoder_agrees_with_torch_on_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    got = e4m3_to_f32(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def fp8_blocks(w, block):
    """w [out, in] f32 -> (e4m3 codes [out, in] uint8, scale_inv [ceil(out/bo), ceil(in/bi)] f32) as DeepSeek
    stores them: each tile scaled so its largest magnitude is 448."""
    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = np.zeros((rows, cols), np.float32)
    scaled = np.zeros_like(w)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = max(np.abs(tile).max(), 1e-12) / 448.0
            scaled[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = tile / scale[r, c]
    codes = torch.from_numpy(scaled).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return codes, scale


def fp8_dequantize(codes, scale, block):
    bo, bi = block
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:codes.shape[0], :codes.shape[1]]
    return e4m3_to_f32(codes) * full


def int4_pack(w, group):
    """w [out, in] f32 -> (weight_packed [out, in/8] int32, weight_scale [out, in/group] bf16-valued f32):
    symmetric codes in [-8, 7], stored plus 8, eight per int32, column 8j+k in bits 4k..4k+4 of word j."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    scale = np.maximum(np.abs(g).max(-1), 1e-12) / 7.0
    # bf16 scales, as published checkpoints store them.
    scale = torch.from_numpy(scale.astype(np.float32)).bfloat16().float().numpy()
    q = np.clip(np.rint(g / scale[..., None]), -8, 7).astype(np.int64).reshape(out, inp)
    u = (q + 8).astype(np.uint32).reshape(out, inp // 8, 8)
    words = np.zeros((out, inp // 8), np.uint32)
    for k in range(8):
        words |= u[:, :, k] << np.uint32(4 * k)
    return words.view(np.int32), scale


def int4_dequantize(packed, scale, group):
    words = packed.view(np.uint32)
    codes = np.stack([(words >> np.uint32(4 * k)) & 0xF for k in range(8)], -1).reshape(packed.shape[0], -1)
    values = codes.astype(np.float32) - 8.0
    return values * np.repeat(scale, group, 1)


def ignored(module, ignore):
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in ignore)


def quantize_checkpoint(model, path, scheme, block=(8, 8), group=32, ignore=()):
    """Saves `model` quantized per `scheme` to `path`, loads the numpy-dequantized weights back into `model`
    (the reference), and returns the module names that were quantized."""
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    out, dequantized, quantized = {}, {}, []
    for name, w in tensors.items():
        module = name[:-len(".weight")]
        if scheme == "fp8" and LINEAR.search(name):
            codes, scale = fp8_blocks(w, block)
            out[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            out[f"{module}.weight_scale_inv"] = torch.from_numpy(scale)
            dequantized[name] = fp8_dequantize(codes, scale, block)
            quantized.append(module)
        elif scheme == "int4" and LINEAR.search(name) and not ignored(module, ignore):
            packed, scale = int4_pack(w, group)
            out[f"{module}.weight_packed"] = torch.from_numpy(packed)
            out[f"{module}.weight_scale"] = torch.from_numpy(scale).bfloat16()
            out[f"{module}.weight_shape"] = torch.tensor(w.shape, dtype=torch.int32)
            dequantized[name] = int4_dequantize(packed, scale, group)
            quantized.append(module)
        else:
            out[name] = torch.from_numpy(w.copy())
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    if scheme == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group, "dynamic": False,
                                                      "observer": "minmax"}}},
            "ignore": list(ignore)}
    (path / "config.json").write_text(json.dumps(cfg))
    # transformers' state dict fuses experts; the reference gets the dequantized weights through the same
    # per-expert names save_pretrained wrote, by reloading a plain f32 copy of them.
    plain = {k: torch.from_numpy(dequantized.get(k, v).copy()) for k, v in tensors.items()}
    ref_dir = path.parent / f"{path.name}-dequantized"
    model.save_pretrained(ref_dir)
    save_file(plain, ref_dir / "model.safetensors", metadata={"format": "pt"})
    reference = type(model).from_pretrained(ref_dir, dtype=torch.float32).eval()
    reference.config._attn_implementation = "sdpa"
    return reference, quantized


def make(arch, tmp_path, seed=0):
    torch.manual_seed(seed)
    return randomize(MODELS[arch]().float().eval(), seed=seed)


def capture_all(path, tmp_path, samples, layers, tps, *extra):
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    runs = {}
    for tp in tps:
        run_capture(path, inputs, tmp_path / f"tp{tp}", layers, "--tp", tp, *extra, final_norm=True)
        runs[tp], manifest = read_dataset(tmp_path / f"tp{tp}")
    return runs, manifest


def add_loop(path, tmp_path, layers, tps, runs):
    """Captures again with --moe-kernel loop (each quantized expert dequantized alone; the default
    dequantizes a layer's experts as one stack)."""
    for tp in tps:
        out = tmp_path / f"loop_tp{tp}"
        run_capture(path, tmp_path / "in.jsonl", out, layers, "--tp", tp, "--moe-kernel", "loop", final_norm=True)
        runs[f"loop {tp}"], _ = read_dataset(out)


def assert_matches(reference, runs, samples, layers, bound=1e-4):
    worst = 0.0
    for sid, s in enumerate(samples):
        for col, want in hf_states(reference, s["input_ids"], layers, final_norm=True).items():
            for tp, run in runs.items():
                diff = float(np.abs(run[sid][col] - want).max())
                worst = max(worst, diff)
                assert diff <= bound, f"TP={tp} sample {sid} {col}: max abs diff {diff:.3g} vs transformers"
    return worst


def assert_dequantization_matters(model, reference, samples, layers):
    """The reference is not the unquantized model: a capture that ignored the scales, or read the float
    originals, would be seen."""
    far = max(float(np.abs(a - b).max())
              for s in samples[:2]
              for a, b in zip(hf_states(model, s["input_ids"], layers, True).values(),
                              hf_states(reference, s["input_ids"], layers, True).values()))
    assert far > 1e-3, f"quantization moves the states by only {far:.3g}; the test would prove nothing"


@pytest.mark.parametrize("arch,block,tps", [("deepseek_v3", (8, 8), (1, 2)), ("deepseek_v3", (4, 4), (4,)),
                                            ("qwen3_moe", (8, 16), (1, 2))])
def test_fp8_block_checkpoint_matches_transformers_on_numpy_dequantized_weights(arch, block, tps, tmp_path):
    model = make(arch, tmp_path)
    path = tmp_path / arch
    reference, quantized = quantize_checkpoint(model, path, "fp8", block=block)
    assert any(".experts." in m for m in quantized) and any("self_attn" in m for m in quantized)
    samples = random_samples(LENGTHS, VOCAB, seed=5)
    layers = list(range(len(model.model.layers)))
    runs, manifest = capture_all(path, tmp_path, samples, layers, tps)
    add_loop(path, tmp_path, layers, tps[:2], runs)
    assert manifest["provenance"]["extra"]["quantization"] == \
        f"fp8 e4m3 block-quantized, weight_block_size [{block[0]}, {block[1]}], weight_scale_inv"
    worst = assert_matches(reference, runs, samples, layers)
    assert_dequantization_matters(model, reference, samples, layers)
    print(f"{arch} FP8 {block} TP {tps}: max abs diff vs transformers {worst:.3g}")


@pytest.mark.parametrize("arch,group,ignore,tps", [
    # Kimi-K2-Thinking's layout: routed experts in INT4 groups of 32, everything else bf16.
    ("deepseek_v3", 32, KIMI_IGNORE, (1, 2, 4)),
    # Every linear of a dense model; groups of 16 so that down_proj's 96 inputs split 2 ways into whole groups.
    ("llama", 16, ["lm_head"], (1, 2)),
])
def test_int4_pack_quantized_checkpoint_matches_transformers_on_numpy_dequantized_weights(arch, group, ignore, tps,
                                                                                          tmp_path):
    model = make(arch, tmp_path, seed=1)
    path = tmp_path / arch
    reference, quantized = quantize_checkpoint(model, path, "int4", group=group, ignore=ignore)
    if arch == "deepseek_v3":
        assert quantized and all(".mlp.experts." in m for m in quantized), quantized
    samples = random_samples(LENGTHS, VOCAB, seed=6)
    layers = list(range(len(model.model.layers)))
    runs, manifest = capture_all(path, tmp_path, samples, layers, tps)
    if arch == "deepseek_v3":
        add_loop(path, tmp_path, layers, tps[:2], runs)
    assert manifest["provenance"]["extra"]["quantization"] == \
        f"compressed-tensors pack-quantized int4 symmetric, group_size {group}"
    worst = assert_matches(reference, runs, samples, layers)
    assert_dequantization_matters(model, reference, samples, layers)
    print(f"{arch} INT4 g{group} TP {tps}: max abs diff vs transformers {worst:.3g}")


def refusal(path, tmp_path, *extra):
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples([4], VOCAB))
    r = run_capture(path, inputs, tmp_path / "ds", [0], *extra, check=False)
    assert r.returncode != 0, "the capture should have been refused"
    assert not (tmp_path / "ds").exists(), "a refused capture left a dataset behind"
    return r.stderr


def edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_wrong_shaped_scale_is_named_with_its_expected_shape(tmp_path):
    path = tmp_path / "m"
    quantize_checkpoint(make("deepseek_v3", tmp_path), path, "fp8", block=(8, 8))
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    out = load_torch(path / "model.safetensors")
    out[name] = out[name][:, :1].contiguous()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    e = refusal(path, tmp_path)
    assert f'tensor "{name}" has shape [8, 1], expected [8, 4] from config.json' in e, e


def test_a_group_size_that_does_not_divide_the_inputs_is_named(tmp_path):
    path = tmp_path / "m"
    quantize_checkpoint(make("deepseek_v3", tmp_path), path, "int4", group=32, ignore=KIMI_IGNORE)
    edit_config(path, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=24))
    e = refusal(path, tmp_path)
    assert 'quantized weight "model.layers.1.mlp.experts.0.gate_proj": 64 input features do not divide into INT4 ' \
           'groups of group_size 24' in e, e


def test_an_unknown_quant_method_is_named_with_what_is_supported(tmp_path):
    path = tmp_path / "m"
    quantize_checkpoint(make("llama", tmp_path), path, "int4", group=16, ignore=["lm_head"])
    edit_config(path, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    e = refusal(path, tmp_path)
    assert 'quantization_config.quant_method = "awq" is not supported; supported: quant_method "fp8"' in e, e


def test_a_tp_split_that_cuts_an_fp8_block_is_named(tmp_path):
    path = tmp_path / "m"
    quantize_checkpoint(make("deepseek_v3", tmp_path), path, "fp8", block=(8, 8))
    e = refusal(path, tmp_path, "--tp", 4)
    assert "is not a whole number of FP8 block tiles of 8" in e, e


def test_a_model_that_does_not_fit_the_given_gpu_memory_is_refused_before_loading(tmp_path):
    path = tmp_path / "m"
    quantize_checkpoint(make("deepseek_v3", tmp_path), path, "fp8", block=(8, 8))
    # Resident, as asked.
    e = refusal(path, tmp_path, "--placement", "resident", "--gpu-memory", "0.5GiB", "--max-tokens-per-batch", 4096)
    assert "not enough GPU memory: each GPU needs about" in e and "but only 0.50 GiB is free" in e, e
    # FP8 already: the advice is about the batch and the TP size, not about quantizing.
    assert "--tp" in e and "quantized checkpoint" not in e, e
    # Auto (no flag) tries streaming too, and names both needs (a bare size is GiB).
    e = refusal(path, tmp_path, "--gpu-memory", 0.5, "--max-tokens-per-batch", 4096)
    assert "but only 0.50 GiB is free" in e and "streamed one layer at a time instead" in e, e
    assert "too small to stream this model" in e, e


def test_kimi_k25_int4_wrapper_reads_the_top_level_quantization_config_under_its_prefix(tmp_path):
    # Kimi-K2.5 as published: the DeepSeek-V3 language model under text_config and language_model., the
    # compressed-tensors quantization_config at the top level.
    model = make("deepseek_v3", tmp_path, seed=2)
    path = tmp_path / "kimi"
    reference, _ = quantize_checkpoint(model, path, "int4", group=32, ignore=KIMI_IGNORE)
    weights = {f"language_model.{k}": v for k, v in load_torch(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {**cfg, "model_type": "kimi_k2"}, "quantization_config": quant}))
    samples = random_samples([6, 11], VOCAB, seed=7)
    layers = list(range(len(model.model.layers)))
    runs, manifest = capture_all(path, tmp_path, samples, layers, (1, 2))
    assert manifest["provenance"]["architecture"] == "KimiK25ForConditionalGeneration"
    assert manifest["provenance"]["extra"]["quantization"].startswith("compressed-tensors pack-quantized int4")
    assert_matches(reference, runs, samples, layers)
