"""A capture killed mid-run and restarted with --resume writes every input sample exactly once."""
import signal
import subprocess
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture_util import (capture_cmd, hslake_bin, hf_states, manifests, random_samples, randomize, read_dataset,
                          run_capture, save_model, write_jsonl)

VOCAB = 101
N = 1500


def test_killed_capture_resumes_with_every_sample_exactly_once(tmp_path):
    torch.manual_seed(5)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    model = randomize(LlamaForCausalLM(cfg).float().eval(), seed=5)
    path = save_model(model, tmp_path / "m")
    rng = np.random.default_rng(6)
    samples = random_samples(rng.integers(4, 24, N).tolist(), VOCAB, seed=7)
    inputs = write_jsonl(tmp_path / "in.jsonl", samples)
    ds = tmp_path / "ds"
    args = capture_cmd() + ["--model", str(path), "--input", str(inputs), "--output", f"file://{ds}",
                            "--layers", "0,1", "--dtype", "f32", "--no-progress", "--max-tokens-per-batch", "48",
                            "--commit-every", "40", "--commit-interval", "0.5"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Kill it hard once a couple of versions beyond the empty version 0 are committed.
    deadline = time.time() + 300
    while len(manifests(ds)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "capture finished before it could be killed; the test needs a longer run"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial, _ = read_dataset(ds)
    assert 0 < len(partial) < N, f"expected a partial dataset, got {len(partial)} of {N} samples"

    # Without --resume, a non-empty dataset is refused rather than written twice.
    r = run_capture(path, inputs, ds, [0, 1], check=False)
    assert r.returncode != 0 and "pass --resume" in r.stderr, r.stderr

    r = run_capture(path, inputs, ds, [0, 1], "--resume", "--max-tokens-per-batch", 48)
    assert f"{len(partial)} already committed" in r.stdout, r.stdout
    full, manifest = read_dataset(ds)  # asserts that no sample id appears twice
    assert sorted(full) == list(range(N))
    assert manifest["provenance"]["layers"] == ["layer_0", "layer_1"]
    for sid in (0, N // 2, N - 1):
        assert full[sid]["input_ids"] == samples[sid]["input_ids"]
        ref = hf_states(model, samples[sid]["input_ids"], [0, 1], final_norm=False)
        assert float(np.abs(full[sid]["layer_1"] - ref["layer_1"]).max()) <= 1e-4
    v = subprocess.run([hslake_bin(), "verify", f"file://{ds}"], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
