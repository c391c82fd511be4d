"""hslake feeding the two EAGLE-3 trainers, speculators 0.9 and SpecForge 0.2 (installed by
scripts/setup.d/25-trainers.sh): layer arithmetic pinned against transformers, the streaming
adapters against each trainer's own file reader on `hslake export` output, and the same
training losses step by step from either. A tiny 8-layer Llama is captured by the real CLI.

Neither trainer's Trainer class runs on CPU (speculators moves the model to `cuda:local_rank`;
SpecForge's loop is built for GPUs), so the loss tests drive each trainer's model, loss and
optimizer step directly — the same functions its Trainer calls (hslake_eagle3.drafts, examples/eagle3).
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hslake
from capture_util import hslake_bin, randomize, save_model, write_jsonl

pytest.importorskip("speculators")
pytest.importorskip("specforge")

from hslake_eagle3 import drafts  # noqa: E402
from hslake.integrations.specforge import SpecForgeLoader, train_batch  # noqa: E402
from hslake.integrations.speculators import SpeculatorsLoader  # noqa: E402

warnings.filterwarnings("ignore")
N_LAYERS = 8
HIDDEN = 64
VOCAB = 131
# hslake layers the presets need for 8 layers: aux 1, 3, 4; layer_7 (pre-norm) and final_norm.
CAPTURED = [1, 3, 4, 7]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = randomize(LlamaForCausalLM(cfg), seed=1, scale=0.15).eval()
    path = save_model(model, tmp_path_factory.mktemp("verifier") / "llama8")
    return model, str(path)


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(18):
        n = int(torch.randint(6, 40, (1,), generator=g))
        prompt = n // 3
        rows.append({"id": 100 + i, "input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return rows, write_jsonl(tmp_path_factory.mktemp("in") / "samples.jsonl", rows)


def capture(verifier, samples, tmp_path_factory, dtype, layers=CAPTURED, final_norm=True, name=None):
    out = tmp_path_factory.mktemp("ds") / (name or dtype)
    cmd = [hslake_bin(), "capture", "--model", verifier[1], "--input", str(samples[1]), "--output", f"file://{out}",
           "--dtype", dtype, "--device", "cpu", "--no-progress", "--layers", ",".join(map(str, layers))]
    r = subprocess.run(cmd + (["--final-norm"] if final_norm else []), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return f"file://{out}"


@pytest.fixture(scope="module")
def ds_f32(verifier, samples, tmp_path_factory):
    return capture(verifier, samples, tmp_path_factory, "f32")


@pytest.fixture(scope="module")
def ds_bf16(verifier, samples, tmp_path_factory):
    return capture(verifier, samples, tmp_path_factory, "bf16")


def export_cli(url, fmt, out):
    """`hslake export --format` (the CLI over the same Rust export as hslake.export_trainer_files)."""
    return subprocess.run([hslake_bin(), "export", url, "--format", fmt, "--dir", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(ds_bf16, ds_f32, tmp_path_factory):
    dirs = {}
    for name, url in (("bf16", ds_bf16), ("f32", ds_f32)):
        for fmt in ("speculators", "specforge"):
            d = tmp_path_factory.mktemp(f"{fmt}_{name}") / "out"
            version, samples, tokens = hslake.export_trainer_files(url, fmt, str(d))
            assert samples == 18
            dirs[(fmt, name)] = d
    return dirs


def hf_states(model, ids):
    """HF hidden_states (tuple of N_LAYERS + 1, the last after the final norm) and the last
    layer's own output before the norm."""
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: seen.__setitem__("pre", (o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    return [h[0] for h in out.hidden_states], seen["pre"][0]


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-4, atol=2e-4)


# ---- layer arithmetic: what reaches each trainer equals what its own generator writes ----

def test_speculators_receives_vllm_layer_ids_and_the_pre_norm_last_layer(verifier, samples, ds_f32):
    from speculators.models.utils import resolve_target_layer_ids

    model, path = verifier
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vllm_ids = resolve_target_layer_ids(None, path)  # speculators' own default
    assert vllm_ids == [2, N_LAYERS // 2, N_LAYERS - 3]
    rows = {r["id"]: r for r in samples[0]}
    loader = SpeculatorsLoader(ds_f32, total_seq_len=256, hidden_states_dtype=torch.float32, shuffle=False,
                               with_sample_ids=True)
    seen = 0
    for batch in loader:
        doc = batch["document_ids"][0]
        for j, sid in enumerate(batch["sample_ids"].tolist()):
            r = rows[sid]
            hs, pre_norm = hf_states(model, r["input_ids"])
            # vLLM id k is HF hidden_states[k]; id n (the verifier's last layer) is taken
            # before the final norm, where HF's hidden_states[n] is after it.
            aux = torch.cat([hs[k] for k in vllm_ids], dim=-1)
            at = doc == j
            close(batch["hidden_states"][0][at], aux[:-1])           # shift_batch: g_0..g_{T-2}
            close(batch["verifier_last_hidden_states"][0][at], pre_norm[1:])
            assert not torch.allclose(batch["verifier_last_hidden_states"][0][at], hs[N_LAYERS][1:], atol=1e-3)
            assert batch["input_ids"][0][at].tolist() == r["input_ids"][1:]
            assert batch["loss_mask"][0][at].tolist() == r["loss_mask"][1:]
            assert batch["position_ids"][0][at].tolist() == list(range(1, len(r["input_ids"])))
            seen += 1
        # Padding after the packed documents is marked -1, as CollateFn does.
        used = int((doc >= 0).sum())
        assert (doc[used:] == -1).all() and used == sum(len(rows[s]["input_ids"]) - 1
                                                        for s in batch["sample_ids"].tolist())
    assert seen == len(rows)


def test_specforge_receives_sglang_layer_ids_and_the_post_norm_state(verifier, samples, ds_f32):
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    model, _ = verifier
    cfg = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    sglang_ids = resolve_eagle_capture_layers(cfg, {}, model.config)  # SpecForge's own default
    assert sglang_ids == [1, N_LAYERS // 2 - 1, N_LAYERS - 4]
    rows = {r["id"]: r for r in samples[0]}
    seen = 0
    for batch in SpecForgeLoader(ds_f32, batch_size=4, max_len=64, shuffle=False, with_sample_ids=True):
        for b, sid in enumerate(batch["sample_ids"].tolist()):
            r = rows[sid]
            n = len(r["input_ids"])
            hs, pre_norm = hf_states(model, r["input_ids"])
            # SGLang id k is the output of layer k = HF hidden_states[k + 1]; the target is
            # after the final norm = HF hidden_states[n].
            aux = torch.cat([hs[k + 1] for k in sglang_ids], dim=-1)
            close(batch["hidden_state"][b, :n], aux)
            close(batch["target"][b, :n], hs[N_LAYERS])
            assert not torch.allclose(batch["target"][b, :n], pre_norm, atol=1e-3)
            assert batch["input_ids"][b, :n].tolist() == r["input_ids"]
            assert batch["loss_mask"][b, :n].tolist() == r["loss_mask"][:-1] + [0]
            assert batch["attention_mask"][b].sum() == n
            seen += 1
    assert seen == len(rows)


# ---- the streaming adapters equal each trainer's own reader of `hslake export` files ----

def speculators_file_batches(export_dir, groups, total_seq_len, dtype):
    """speculators' own path: ArrowDataset over the export + CollateFn(shift_batch), with the
    sample groups the adapter packed (index i of the export holds sample_id[i])."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    ds = ArrowDataset(max_len=total_seq_len, datapath=str(export_dir), on_missing="raise", hidden_states_dtype=dtype)
    index = {int(s): i for i, s in enumerate(ds.data.with_format(None)["sample_id"])}
    collate = CollateFn(total_seq_len, HIDDEN, dtype=dtype, preprocess=shift_batch)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=[[index[s] for s in g] for g in groups],
                                         collate_fn=collate)
    return list(loader)


def specforge_file_batches(export_dir, groups, max_len):
    """SpecForge's own path: its offline files → normalize_offline_sample → DataCollatorWithPadding."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.preprocessing import list_local_files
    from specforge.data.utils import DataCollatorWithPadding

    files = {int(Path(f).stem.split("_")[1]): f for f in list_local_files(str(export_dir))}
    collate = DataCollatorWithPadding()
    out = []
    for g in groups:
        feats = [normalize_offline_sample(torch.load(files[s]), max_len) for s in g]
        out.append(collate(feats))
    return out


def assert_same_batch(a, b):
    assert set(k for k in a if k != "sample_ids") == set(b), (sorted(a), sorted(b))
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            assert a[k].dtype == v.dtype, k
            assert torch.equal(a[k], v), k
        else:
            assert a[k] == v, k


@pytest.mark.parametrize("dtype_name,prefetch", [("bf16", 2), ("f32", 2), ("bf16", 0)])
def test_speculators_adapter_equals_its_arrow_dataset_on_exported_files(ds_bf16, ds_f32, exported, dtype_name,
                                                                        prefetch):
    url = ds_bf16 if dtype_name == "bf16" else ds_f32
    stream = list(SpeculatorsLoader(url, total_seq_len=128, seed=5, with_sample_ids=True, prefetch=prefetch))
    groups = [b["sample_ids"].tolist() for b in stream]
    files = speculators_file_batches(exported[("speculators", dtype_name)], groups, 128, torch.bfloat16)
    assert len(files) == len(stream) > 1
    for a, b in zip(stream, files):
        assert_same_batch(a, b)


def test_speculators_adapter_resumes_after_the_last_batch_handed_out_not_the_prefetched(ds_bf16):
    def ids(batches):
        return [b["sample_ids"].tolist() for b in batches]

    whole = ids(SpeculatorsLoader(ds_bf16, total_seq_len=64, seed=2, with_sample_ids=True))
    assert len(whole) > 4
    first = SpeculatorsLoader(ds_bf16, total_seq_len=64, seed=2, with_sample_ids=True, prefetch=3)
    head = ids(itertools.islice(first, 2))
    resumed = SpeculatorsLoader(ds_bf16, total_seq_len=64, seed=2, with_sample_ids=True)
    resumed.load_state_dict(first.state_dict())
    assert head + ids(resumed) == whole
    # Iterating the interrupted adapter again continues where the trainer stopped, too.
    assert head + ids(first) == whole


@pytest.mark.parametrize("dtype_name", ["bf16", "f32"])
def test_specforge_adapter_equals_its_offline_files(ds_bf16, ds_f32, exported, dtype_name):
    url = ds_bf16 if dtype_name == "bf16" else ds_f32
    stream = list(SpecForgeLoader(url, batch_size=3, max_len=24, seed=5, with_sample_ids=True))
    groups = [b["sample_ids"].tolist() for b in stream]
    files = specforge_file_batches(exported[("specforge", dtype_name)], groups, 24)
    assert len(files) == len(stream) > 1
    for a, b in zip(stream, files):
        assert_same_batch(a, b)


# ---- same data, same numbers: N training steps from files and from the stream ----

STEPS = 4


def speculators_losses(verifier_dir, batches):
    torch.manual_seed(0)
    model = drafts.speculators_draft(verifier_dir, [2, 4, 5])
    kwargs = drafts.speculators_call_kwargs("cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    losses = []
    for batch in batches:
        batch = {k: v for k, v in batch.items() if k != "sample_ids"}
        # speculators.train.trainer.Trainer.train_epoch's step, on CPU.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, metrics = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def specforge_losses(verifier_dir, batches):
    drafts.cpu_specforge_loss()
    torch.manual_seed(0)
    strategy = drafts.specforge_strategy(verifier_dir, ttt_length=3)
    model = strategy.trainable_module()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    losses = []
    for batch in batches:
        out = strategy.forward_loss(train_batch(batch))
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
    return losses


def test_speculators_trains_to_the_same_losses_from_export_and_stream(verifier, ds_bf16, exported):
    stream = list(SpeculatorsLoader(ds_bf16, total_seq_len=96, seed=11, with_sample_ids=True))[:STEPS]
    groups = [b["sample_ids"].tolist() for b in stream]
    files = speculators_file_batches(exported[("speculators", "bf16")], groups, 96, torch.bfloat16)
    a = speculators_losses(verifier[1], stream)
    b = speculators_losses(verifier[1], files)
    assert len(a) == STEPS
    # The same bits reach the same deterministic CPU code: the bound measured is 0.
    assert a == b, (a, b)
    assert len(set(a)) > 1, f"the optimizer steps should change the loss: {a}"


def test_specforge_trains_to_the_same_losses_from_export_and_stream(verifier, ds_bf16, exported):
    stream = list(SpecForgeLoader(ds_bf16, batch_size=3, max_len=32, seed=11, with_sample_ids=True))[:STEPS]
    groups = [b["sample_ids"].tolist() for b in stream]
    files = specforge_file_batches(exported[("specforge", "bf16")], groups, 32)
    a = specforge_losses(verifier[1], stream)
    b = specforge_losses(verifier[1], files)
    assert len(a) == STEPS
    assert a == b, (a, b)
    assert len(set(a)) > 1, f"the optimizer steps should change the loss: {a}"


# ---- export and presets: layouts, loading, errors ----

def test_specforge_export_is_read_by_torch_load_with_weights_only(ds_bf16, exported):
    d = exported[("specforge", "bf16")]
    files = sorted(d.glob("rows_*/data_*.ckpt"))
    assert len(files) == 18 and not list(d.rglob("*.tmp"))
    by_id = {b["sample_ids"][0].item(): b for b in hslake.Loader(ds_bf16, batch_size=1, preset="specforge",
                                                                 shuffle=False)}
    for f in files:
        obj = torch.load(f, weights_only=True)
        assert list(obj) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        b = by_id[int(f.stem.split("_")[1])]
        n = b["input_ids"].shape[1]
        assert obj["input_ids"].dtype == torch.int64 and obj["input_ids"].shape == (n,)
        assert torch.equal(obj["input_ids"], b["input_ids"][0])
        assert torch.equal(obj["loss_mask"], b["loss_mask"][0])
        assert obj["hidden_state"].dtype == torch.bfloat16 and obj["hidden_state"].shape == (1, n, HIDDEN)
        assert torch.equal(obj["hidden_state"], b["target_hidden_states"])
        assert torch.equal(obj["aux_hidden_state"], b["aux_hidden_states"])


def test_speculators_export_loads_with_datasets_and_safetensors(ds_bf16, exported):
    import datasets
    from safetensors.torch import load_file

    d = exported[("speculators", "bf16")]
    ds = datasets.load_from_disk(str(d))
    assert len(ds) == 18 and set(ds.column_names) == {"input_ids", "loss_mask", "seq_len", "sample_id"}
    by_id = {b["sample_ids"][0].item(): b for b in hslake.Loader(ds_bf16, batch_size=1, preset="speculators",
                                                                 shuffle=False)}
    for i, row in enumerate(ds):
        hs = load_file(str(d / "hidden_states" / f"hs_{i}.safetensors"))
        b = by_id[int(row["sample_id"])]
        n = int(row["seq_len"])
        assert torch.equal(hs["token_ids"], b["input_ids"][0]) and torch.equal(row["input_ids"], hs["token_ids"])
        assert hs["hidden_states"].shape == (n, 4, HIDDEN) and hs["hidden_states"].dtype == torch.bfloat16
        aux = b["aux_hidden_states"][0].reshape(n, 3, HIDDEN)
        assert torch.equal(hs["hidden_states"][:, :3], aux)
        assert torch.equal(hs["hidden_states"][:, 3], b["target_hidden_states"][0])


def test_cli_export_writes_the_same_files_as_the_python_export(ds_bf16, exported, tmp_path):
    out = tmp_path / "cli"
    r = export_cli(ds_bf16, "specforge", out)
    assert r.returncode == 0, r.stderr
    assert "exported specforge" in r.stderr
    ours = sorted(p.relative_to(out) for p in out.rglob("*.ckpt"))
    theirs = sorted(p.relative_to(exported[("specforge", "bf16")]) for p in exported[("specforge", "bf16")].rglob("*.ckpt"))
    assert ours == theirs and len(ours) == 18
    for p in ours:
        assert (out / p).read_bytes() == (exported[("specforge", "bf16")] / p).read_bytes()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    r = export_cli(ds_bf16, "speculators", tmp_path / "full")
    assert r.returncode != 0 and "is not empty" in r.stderr


def test_export_and_loader_name_the_missing_layer(verifier, samples, tmp_path_factory, tmp_path):
    url = capture(verifier, samples, tmp_path_factory, "bf16", layers=[1, 3, 4], final_norm=True, name="no_last")
    with pytest.raises(hslake.ConfigError, match="missing layer_7.*cannot stand in for layer_7"):
        hslake.export_trainer_files(url, "speculators", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(hslake.ConfigError, match="does not fit preset speculators: missing layer_7"):
        hslake.Loader(url, batch_size=2, preset="speculators")
    # SpecForge needs only final_norm as target: the same dataset serves it.
    assert hslake.Loader(url, batch_size=2, preset="specforge").target == "final_norm"


def test_preset_resolves_layers_and_refuses_explicit_layers_too(ds_bf16):
    loader = hslake.Loader(ds_bf16, batch_size=2, preset="speculators")
    assert loader.aux_layers == ["layer_1", "layer_3", "layer_4"] and loader.target == "layer_7"
    assert hslake.preset_points("specforge", 30) == (["layer_1", "layer_14", "layer_26"], "final_norm", True)
    with pytest.raises(hslake.ConfigError, match="not both"):
        hslake.Loader(ds_bf16, batch_size=2, preset="speculators", target=7)
    with pytest.raises(hslake.ConfigError, match="unknown preset"):
        hslake.Loader(ds_bf16, batch_size=2, preset="eagle")


def test_the_example_trains_a_specforge_draft_whose_accuracy_rises(verifier, ds_bf16, tmp_path):
    """hslake_eagle3.train_eval --trainer specforge (the end-to-end example's SpecForge half) on
    CPU: SpecForge's strategy and optimizer fed by the adapter for 60 steps over 18 samples (many
    epochs); the report has every step's metrics, and the draft learns (first-step accuracy at
    TTT step 0 rises, loss falls)."""
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "hslake_eagle3.train_eval", "--trainer", "specforge", "--dataset", ds_bf16,
                        "--model", verifier[1], "--out", str(out), "--device", "cpu", "--max-steps", "60",
                        "--batch-size", "6", "--max-len", "48", "--lr", "3e-3", "--decode-threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    steps = report["train_steps"]
    assert len(steps) == 60 and report["epochs"] > 1, report["epochs"]
    assert {"loss", "acc_0", "acceptance_rate_2", "tokens_per_s"} <= set(steps[0])
    head = sum(s["acc_0"] for s in steps[:10]) / 10
    tail = sum(s["acc_0"] for s in steps[-10:]) / 10
    assert tail > head + 0.05, (head, tail)
    assert sum(s["loss"] for s in steps[-10:]) < sum(s["loss"] for s in steps[:10])
    assert 0 < report["simulated_acc_len"] <= 3
    assert "| step | loss | acc_0 |" in (out / "report.md").read_text()
