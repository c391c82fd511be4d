"""Layer-streamed capture through the CLI: the same states as the resident engine, bit for bit, for every
model family and weight format; passes of several batches; early stops; kill -9 and resume; budgets; two
streams on one device."""
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from capture_util import (ARCHS, SMALL, VOCAB, capture_cmd, hslake_bin, manifests, random_samples, randomize,
                          read_dataset, run_capture, save_model, write_jsonl)
from test_capture_quant import KIMI_IGNORE, MODELS, make, quantize_checkpoint

LENGTHS = [5, 17, 12, 1, 9, 30, 3, 22]

# One model per family the issue names, plain; and DeepSeek-V3 with FP8 blocks and with INT4 experts.
FAMILIES = {
    "llama": lambda: MODELS["llama"](),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=32)),
    "qwen3_moe": lambda: MODELS["qwen3_moe"](),
    "deepseek_v3": lambda: MODELS["deepseek_v3"](),
}


def model_dir(family, fmt, tmp_path):
    torch.manual_seed(3)
    path = tmp_path / f"{family}-{fmt}"
    if fmt == "bf16":
        save_model(randomize(FAMILIES[family]().float().eval(), seed=3).to(torch.bfloat16), path)
    elif fmt == "fp8":
        quantize_checkpoint(make(family, tmp_path), path, "fp8", block=(8, 8))
    else:
        quantize_checkpoint(make(family, tmp_path, seed=1), path, "int4", group=32, ignore=KIMI_IGNORE)
    return path


def assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    """For runs whose batches hold other samples (so other GEMM shapes): the same samples, tokens and layers, and
    values equal to rounding."""
    assert sorted(a) == sorted(b), f"{what}: different samples"
    for sid in a:
        assert a[sid]["input_ids"] == b[sid]["input_ids"], f"{what}: sample {sid} tokens"
        for c in (c for c in a[sid] if c.startswith("layer_")):
            np.testing.assert_allclose(b[sid][c], a[sid][c], rtol=rtol, atol=atol, err_msg=f"{what}: {sid} {c}")


def assert_same(a, b, what):
    assert sorted(a) == sorted(b), f"{what}: different samples"
    for sid in a:
        assert a[sid]["input_ids"] == b[sid]["input_ids"], f"{what}: sample {sid} tokens"
        cols = [c for c in a[sid] if c.startswith("layer_") or c == "final_norm"]
        assert cols and cols == [c for c in b[sid] if c.startswith("layer_") or c == "final_norm"]
        for c in cols:
            x, y = a[sid][c], b[sid][c]
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: sample {sid} {c}"
            # Bit for bit: compare the bytes, so that -0.0 against 0.0 or two NaN payloads would count.
            assert x.tobytes() == y.tobytes(), \
                f"{what}: sample {sid} {c} differs, max abs {float(np.abs(x.astype(np.float64) - y).max()):.3g}"


@pytest.mark.parametrize("family,fmt", [("llama", "bf16"), ("qwen3", "bf16"), ("qwen3_moe", "bf16"),
                                        ("deepseek_v3", "bf16"), ("deepseek_v3", "fp8"), ("deepseek_v3", "int4")])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_streamed_capture_equals_the_resident_one_bit_for_bit(family, fmt, dtype, tmp_path):
    path = model_dir(family, fmt, tmp_path)
    samples = random_samples(LENGTHS, VOCAB, seed=11)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    layers = [0, 1, 2]
    common = ("--max-tokens-per-batch", 32)
    run_capture(path, inputs, tmp_path / "resident", layers, "--placement", "resident", *common, final_norm=True,
                dtype=dtype)
    # Passes of up to 64 tokens: several batches each, and more than one pass.
    r = run_capture(path, inputs, tmp_path / "stream", layers, "--placement", "stream", "--pass-tokens", 64,
                    *common, final_norm=True, dtype=dtype)
    passes = re.findall(r"stream 0 pass: (\d+) batches, (\d+) tokens, (\d+) layers", r.stderr)
    assert len(passes) >= 2 and any(int(b) > 1 for b, _, _ in passes), r.stderr
    # Padded tokens: every sample's, and no pass over its size.
    assert sum(int(t) for _, t, _ in passes) >= sum(LENGTHS) and all(int(t) <= 64 for _, t, _ in passes), passes
    resident, _ = read_dataset(tmp_path / "resident")
    streamed, manifest = read_dataset(tmp_path / "stream")
    assert_same(resident, streamed, f"{family} {fmt} {dtype}")
    v = subprocess.run([hslake_bin(), "verify", f"file://{tmp_path / 'stream'}"], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_capture_of_early_layers_streams_only_the_layers_it_needs(tmp_path):
    torch.manual_seed(4)
    path = save_model(randomize(ARCHS["llama_gqa"]().float().eval(), seed=4), tmp_path / "m")
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples(LENGTHS, VOCAB, seed=2))
    run_capture(path, inputs, tmp_path / "resident", [0], "--placement", "resident")
    r = run_capture(path, inputs, tmp_path / "stream", [0], "--placement", "stream")
    # Layer 0's output is all it needs: one layer streamed of three, and no final norm.
    assert re.search(r"stream 0 pass: \d+ batches, \d+ tokens, 1 layers", r.stderr), r.stderr
    assert_same(read_dataset(tmp_path / "resident")[0], read_dataset(tmp_path / "stream")[0], "layer 0")


def test_auto_streams_a_model_over_the_budget_and_says_why(tmp_path):
    # Eight layers of ~9 MB in f32: 70 MB resident, two ~9 MB slots streamed. Both plans keep a 1 GiB reserve, so a
    # budget of 1 GiB + 40 MiB holds the streamed plan and not the resident one.
    torch.manual_seed(8)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    path = save_model(randomize(LlamaForCausalLM(cfg).float().eval(), seed=8, scale=0.02), tmp_path / "m")
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples(LENGTHS, VOCAB, seed=12))
    flags = ("--max-tokens-per-batch", 16)
    run_capture(path, inputs, tmp_path / "resident", [1, 7], "--placement", "resident", *flags)
    # No --placement: auto.
    r = run_capture(path, inputs, tmp_path / "auto", [1, 7], "--gpu-memory", "1064MiB", *flags)
    assert "placement auto: stream, the model does not fit resident" in r.stderr, r.stderr
    assert re.search(r"stream 0 pass: \d+ batches, \d+ tokens, 8 layers", r.stderr), r.stderr
    assert_same(read_dataset(tmp_path / "resident")[0], read_dataset(tmp_path / "auto")[0], "auto")
    # With room for it, auto stays resident.
    r = run_capture(path, inputs, tmp_path / "roomy", [1, 7], "--gpu-memory", "4GiB", *flags)
    assert "placement auto: resident, the model fits" in r.stderr and "stream 0 pass" not in r.stderr, r.stderr


def test_a_budget_too_small_for_one_layer_is_refused_by_name(tmp_path):
    path = model_dir("qwen3_moe", "bf16", tmp_path)
    inputs = write_jsonl(tmp_path / "in.jsonl", random_samples(LENGTHS, VOCAB, seed=13))
    r = run_capture(path, inputs, tmp_path / "ds", [0], "--placement", "stream", "--gpu-memory", "2MiB",
                    check=False)
    assert r.returncode != 0
    assert "of GPU memory is too small to stream this model" in r.stderr and "raise --gpu-memory" in r.stderr, \
        r.stderr
    assert not (tmp_path / "ds").exists(), "a refused capture left a dataset behind"
    r = run_capture(path, inputs, tmp_path / "ds", [0], "--gpu-memory", "0.5furlongs", check=False)
    assert r.returncode == 2 and "--gpu-memory" in r.stderr, r.stderr


def test_two_streams_on_one_device_partition_the_samples_exactly(tmp_path):
    path = model_dir("qwen3_moe", "bf16", tmp_path)
    rng = np.random.default_rng(9)
    samples = random_samples(rng.integers(1, 30, 60).tolist(), VOCAB, seed=14)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    run_capture(path, inputs, tmp_path / "resident", [1], "--placement", "resident", "--max-tokens-per-batch", 40)
    r = run_capture(path, inputs, tmp_path / "two", [1], "--placement", "stream", "--devices", "0,0",
                    "--max-tokens-per-batch", 40, "--pass-tokens", 120)
    for s in (0, 1):
        assert re.search(rf"stream {s} pass: ", r.stderr), r.stderr
    two, _ = read_dataset(tmp_path / "two")  # asserts that no sample id appears twice
    assert sorted(two) == list(range(len(samples)))
    # Each stream composes its own batches, so the GEMMs have other shapes than the resident run's.
    assert_close(read_dataset(tmp_path / "resident")[0], two, "two streams")


def test_a_streamed_capture_killed_mid_pass_resumes_with_every_sample_exactly_once(tmp_path):
    path = model_dir("llama", "bf16", tmp_path)
    rng = np.random.default_rng(6)
    n = 1200
    samples = random_samples(rng.integers(4, 24, n).tolist(), VOCAB, seed=7)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    ds = tmp_path / "ds"
    flags = ["--layers", "0,2", "--dtype", "f32", "--no-progress", "--placement", "stream",
             "--max-tokens-per-batch", "48", "--pass-tokens", "192", "--commit-every", "40",
             "--commit-interval", "0.5"]
    args = capture_cmd() + ["--model", str(path), "--input", str(inputs), "--output", f"file://{ds}"] + flags
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while len(manifests(ds)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "capture finished before it could be killed; the test needs a longer run"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial, _ = read_dataset(ds)
    assert 0 < len(partial) < n, f"expected a partial dataset, got {len(partial)} of {n} samples"
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    full, _ = read_dataset(ds)  # asserts that no sample id appears twice
    assert sorted(full) == list(range(n))
    run_capture(path, inputs, tmp_path / "resident", [0, 2], "--placement", "resident",
                "--max-tokens-per-batch", 48)
    assert_close(read_dataset(tmp_path / "resident")[0], full, "resumed")
    v = subprocess.run([hslake_bin(), "verify", f"file://{ds}"], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
