"""`hslake capture` (f32, CPU) against Hugging Face transformers' own forward, on tiny random
models of every supported architecture and on the real SmolLM2-135M-Instruct."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture_util import (ARCHS, ROOT, SMALL, VOCAB, hf_states, random_samples, randomize, read_dataset,
                          run_capture, save_model, write_jsonl)

LENGTHS = [5, 17, 12, 1, 30, 9]


def make(arch, tmp_path, seed=0):
    torch.manual_seed(seed)
    model = randomize(ARCHS[arch]().float().eval(), seed=seed)
    model.config._attn_implementation = "sdpa"
    return model, save_model(model, tmp_path / arch)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_captured_layer_matches_transformers_and_batches_match_single_runs(arch, tmp_path):
    model, path = make(arch, tmp_path)
    samples = random_samples(LENGTHS, VOCAB, seed=1)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = [0, 1, 2]
    # One padded mixed-length batch, and every sample alone.
    run_capture(path, inputs, tmp_path / "batched", layers, "--max-tokens-per-batch", 4096, final_norm=True)
    run_capture(path, inputs, tmp_path / "single", layers, "--max-tokens-per-batch", 1, final_norm=True)
    batched, manifest = read_dataset(tmp_path / "batched")
    single, _ = read_dataset(tmp_path / "single")
    assert sorted(batched) == list(range(len(samples)))
    assert manifest["provenance"]["architecture"] == type(model).__name__
    worst = 0.0
    for sid, s in enumerate(samples):
        ref = hf_states(model, s["input_ids"], layers, final_norm=True)
        assert batched[sid]["input_ids"] == s["input_ids"]
        for col, want in ref.items():
            got = batched[sid][col]
            assert got.shape == want.shape, (col, got.shape, want.shape)
            diff = float(np.abs(got - want).max())
            worst = max(worst, diff)
            assert diff <= 1e-4, f"{arch} sample {sid} {col}: max abs diff {diff:.3g} vs transformers"
            alone = float(np.abs(got - single[sid][col]).max())
            assert alone <= 1e-5, f"{arch} sample {sid} {col}: batched vs single differ by {alone:.3g}"
    print(f"{arch}: max abs diff vs transformers {worst:.3g}")


def test_tensor_parallel_2_and_4_equal_tp_1(tmp_path):
    # 8 query / 4 KV heads and MLP 96 split 4 ways; vocab 131 splits unevenly; biases everywhere
    # exercise column-sharded and row-parallel (added after the all-reduce) biases.
    torch.manual_seed(3)
    cfg = LlamaConfig(**SMALL, num_attention_heads=8, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    model = randomize(LlamaForCausalLM(cfg).float().eval(), seed=3)
    path = save_model(model, tmp_path / "llama_tp")
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples(LENGTHS, VOCAB, seed=4))
    runs = {}
    for tp in (1, 2, 4):
        run_capture(path, inputs, tmp_path / f"tp{tp}", [0, 2], "--tp", tp, final_norm=True)
        runs[tp], manifest = read_dataset(tmp_path / f"tp{tp}")
        assert manifest["provenance"]["tp_size"] == tp
    ref = hf_states(model, random_samples(LENGTHS, VOCAB, seed=4)[0]["input_ids"], [0, 2], True)
    assert float(np.abs(runs[1][0]["layer_2"] - ref["layer_2"]).max()) <= 1e-4
    for tp in (2, 4):
        for sid, rec in runs[1].items():
            for col in ("layer_0", "layer_2", "final_norm"):
                diff = float(np.abs(runs[tp][sid][col] - rec[col]).max())
                assert diff <= 1e-5, f"TP={tp} sample {sid} {col}: {diff:.3g} from TP=1"


def test_impossible_tp_size_names_the_head_counts(tmp_path):
    _, path = make("qwen2_bias", tmp_path)
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples([4], VOCAB))
    r = run_capture(path, inputs, tmp_path / "ds", [0], "--tp", 3, check=False)
    assert r.returncode != 0
    assert "tensor-parallel size 3 is impossible" in r.stderr and "num_attention_heads = 4" in r.stderr, r.stderr
    assert not (tmp_path / "ds").exists()


SMOLLM2 = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
DEFAULT_SAMPLES = ROOT / ".cache" / "default" / "samples.jsonl"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists() or not DEFAULT_SAMPLES.exists(),
                    reason="SmolLM2 not prepared: run scripts/setup.sh (scripts/setup.d/20-smollm2.sh)")
def test_real_smollm2_matches_transformers_relative_to_its_outliers(tmp_path):
    samples = [json.loads(l) for l in open(DEFAULT_SAMPLES)][:4]
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = [2, 15, 29]
    run_capture(SMOLLM2, inputs, tmp_path / "ds", layers, final_norm=True)
    got, manifest = read_dataset(tmp_path / "ds")
    assert manifest["provenance"]["model"] == "SmolLM2-135M-Instruct"
    model = LlamaForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    for sid, s in enumerate(samples):
        ref = hf_states(model, s["input_ids"], layers, final_norm=True)
        assert got[sid]["loss_mask"] == s["loss_mask"]
        for col, want in ref.items():
            mine = got[sid][col]
            bound = 1e-5 * float(np.abs(want).max())
            diff = float(np.abs(mine - want).max())
            assert diff <= bound, f"sample {sid} {col}: max abs diff {diff:.3g} > {bound:.3g}"
            cos = (mine * want).sum(-1) / (np.linalg.norm(mine, axis=-1) * np.linalg.norm(want, axis=-1))
            assert float(cos.min()) >= 0.99999, f"sample {sid} {col}: min per-token cosine {cos.min():.7f}"
