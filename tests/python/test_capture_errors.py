"""Bad inputs and bad checkpoints each fail with their named error before anything is written;
an allocation libtorch refuses mid-run fails with the out-of-memory error and its knobs."""
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from capture_util import capture_cmd, hslake_bin, hslake_gpu_bin, read_dataset, run_capture, save_model, write_jsonl

VOCAB = 131


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    return save_model(LlamaForCausalLM(cfg).float(), tmp_path_factory.mktemp("m") / "llama")


def fails(model, lines, tmp_path, expected, *extra, layers=(0,)):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(l + "\n" for l in lines))
    out = tmp_path / "ds"
    r = run_capture(model, inputs, out, list(layers), *extra, check=False)
    assert r.returncode != 0, r.stdout
    assert expected in r.stderr, r.stderr
    assert not out.exists(), "a failed capture must not create or commit anything"
    return r.stderr


GOOD = '{"input_ids": [1, 2, 3]}'


@pytest.mark.parametrize("lines,expected", [
    ([GOOD, '{"ids": [1]}'], 'line 2: missing field "input_ids"'),
    ([GOOD, GOOD, '{"input_ids": []}'], "line 3: empty input_ids"),
    (['{"input_ids": [1, 131]}'], "line 1: token id 131 at position 1 is outside the model's vocabulary (0..131)"),
    (['{"input_ids": [1, 2], "loss_mask": [1]}'], "line 1: loss_mask has length 1, expected 2"),
    ([GOOD, "not json"], "line 2: not valid JSON"),
])
def test_bad_input_records_are_named_by_line(model_dir, tmp_path, lines, expected):
    fails(model_dir, lines, tmp_path, expected)


def test_bad_parquet_rows_are_named_by_row(model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, 500]]}), tmp_path / "in.parquet")
    r = run_capture(model_dir, tmp_path / "in.parquet", tmp_path / "ds", [0], check=False)
    assert r.returncode != 0 and "row 1: token id 500 at position 1" in r.stderr, r.stderr
    assert not (tmp_path / "ds").exists()


def test_parquet_input_with_integer_ids_is_captured(model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [10, 3], "input_ids": [[1, 2], [3, 4, 5]], "loss_mask": [[0, 1], [1, 1, 0]]}),
                   tmp_path / "in.parquet")
    run_capture(model_dir, tmp_path / "in.parquet", tmp_path / "ds", [0])
    got, _ = read_dataset(tmp_path / "ds")
    assert sorted(got) == [3, 10] and got[3]["loss_mask"] == [1, 1, 0]


def test_overlong_samples_are_truncated_or_skipped_and_counted(model_dir, tmp_path):
    lines = ['{"input_ids": [1, 2, 3, 4, 5, 6]}', '{"input_ids": [7, 8]}']
    inputs = write_jsonl(tmp_path / "in.jsonl", [json.loads(l) for l in lines])
    r = run_capture(model_dir, inputs, tmp_path / "t", [0], "--max-seq-len", 4)
    assert "1 truncated" in r.stdout, r.stdout
    got, _ = read_dataset(tmp_path / "t")
    assert got[0]["input_ids"] == [1, 2, 3, 4] and got[0]["layer_0"].shape == (4, 64)
    r = run_capture(model_dir, inputs, tmp_path / "s", [0], "--max-seq-len", 4, "--overlong", "skip")
    assert "1 longer than --max-seq-len" in r.stdout, r.stdout
    got, _ = read_dataset(tmp_path / "s")
    assert sorted(got) == [1]


def edit_config(model_dir, tmp_path, **changes):
    import shutil
    d = tmp_path / "edited"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unknown_architecture_is_named(model_dir, tmp_path):
    d = edit_config(model_dir, tmp_path, architectures=["GPT2LMHeadModel"])
    fails(d, [GOOD], tmp_path, 'unknown architecture "GPT2LMHeadModel"')


def test_wrong_shape_is_named_with_both_shapes(model_dir, tmp_path):
    d = edit_config(model_dir, tmp_path, intermediate_size=100)
    fails(d, [GOOD], tmp_path, 'tensor "model.layers.0.mlp.gate_proj.weight" has shape [96, 64], expected [100, 64]')


def test_missing_tensor_is_named(model_dir, tmp_path):
    d = edit_config(model_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    fails(d, [GOOD], tmp_path, 'missing tensor "model.layers.1.self_attn.k_proj.weight"')


def test_layer_beyond_the_model_is_named(model_dir, tmp_path):
    fails(model_dir, [GOOD], tmp_path, "layer 3 is out of range: the model has 3 decoder layers", layers=(0, 3))


def test_an_allocation_libtorch_refuses_is_named_out_of_memory_with_its_knobs_never_a_panic(model_dir, tmp_path):
    # Only a test build reads HSLAKE_TEST_FAIL_ALL_REDUCE; a normal one never looks at it.
    version = subprocess.run([hslake_gpu_bin(), "--version"], capture_output=True, text=True, check=True).stdout
    if "with test fault injection" not in version:
        pytest.skip("this hslake-gpu is built without test fault injection; "
                    "`cargo test` (scripts/test.sh runs it) builds one that has it")
    # Rank 1 of the in-process TP group meets an allocation libtorch refuses (8 PiB) at its
    # second all-reduce, inside the first batch's forward.
    env = dict(os.environ, HSLAKE_TEST_FAIL_ALL_REDUCE="1:2:oom")
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 2, 3, 4]}] * 3)
    common = ["--model", str(model_dir), "--dtype", "f32", "--device", "cpu", "--tp", "2"]
    runs = {
        "capture": capture_cmd() + common + ["--input", str(inputs), "--output", f"file://{tmp_path / 'ds'}",
                                            "--layers", "0", "--no-progress"],
        "debug prefill": [hslake_bin(), "debug", "prefill"] + common + ["--batch", "1", "--seq", "4", "--iters", "1",
                                                                        "--layers", "0"],
    }
    for what, cmd in runs.items():
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 1, f"{what}: {r.returncode}\n{r.stderr}"
        assert "panicked" not in r.stderr, f"{what}: {r.stderr}"
        # libtorch's CPU allocator says "not enough memory" or (this torch) "can't allocate memory";
        # either way the bytes asked for and the knobs to lower are named.
        assert "out of memory: " in r.stderr and "you tried to allocate" in r.stderr, f"{what}: {r.stderr}"
        for knob in ["--max-tokens-per-batch", "--batch", "--pass-tokens", "--placement stream"]:
            assert knob in r.stderr, f"{what}: {knob} missing from {r.stderr}"
