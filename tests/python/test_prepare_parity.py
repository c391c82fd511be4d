"""`hslake prepare` equals transformers: identical input_ids (apply_chat_template(tokenize=True)) and
loss masks (return_assistant_tokens_mask=True where the template has {% generation %}, else the
turn-by-turn reference in prepare_util) on a few hundred conversations per template family —
multi-turn, system prompts, empty and unicode-heavy messages — and the same records refused."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from prepare_util import (FAMILIES, SMOLLM2, Refused, end_of_turn_strings, make_conversations, make_family_dir,
                          read_jsonl, reference_sample, run_prepare, write_jsonl)

N = 300


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    assert (SMOLLM2 / "tokenizer.json").exists(), f"{SMOLLM2} is missing: run scripts/setup.sh"
    root = tmp_path_factory.mktemp("families")
    dirs = {name: make_family_dir(name, root / name) for name in FAMILIES}
    dirs["smollm2"] = SMOLLM2
    return dirs


def edge_cases(start_id):
    """Conversations that stress templates: empty turns, only whitespace, specials-looking text."""
    convs = [
        [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": " "}, {"role": "assistant", "content": "\n"}],
        [{"role": "user", "content": "🙂" * 20}, {"role": "assistant", "content": "é" * 7 + "日本" * 5}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\ny"},
         {"role": "user", "content": "b"}, {"role": "assistant", "content": "z"}],
        [{"role": "user", "content": "two"}, {"role": "user", "content": "users"}, {"role": "assistant", "content": "ok"}],
    ]
    return [{"id": start_id + i, "messages": m} for i, m in enumerate(convs)]


CASES = [("smollm2", {}), ("chatml_generation", {}), ("llama3", {}), ("qwen3", {}),
         ("qwen3", {"enable_thinking": False}), ("deepseek_v3", {}), ("mistral", {})]


@pytest.mark.parametrize("family,kwargs", CASES, ids=[f"{f}{'-' + '-'.join(f'{k}={v}' for k, v in kw.items()) if kw else ''}" for f, kw in CASES])
def test_samples_equal_transformers(models, tmp_path, family, kwargs):
    model = models[family]
    convs = make_conversations(N, seed=len(family), think_rate=0.3 if family == "qwen3" else 0.0) + edge_cases(N)
    inp, out, rej = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    write_jsonl(inp, convs)
    extra = ["--rejects", str(rej)] + (["--chat-template-kwargs", json.dumps(kwargs)] if kwargs else [])
    run_prepare(model, inp, out, *extra)
    got = {r["id"]: r for r in read_jsonl(out)}
    refused = {r["location"]: r["reason"] for r in read_jsonl(rej)} if rej.exists() else {}

    tok = AutoTokenizer.from_pretrained(str(model))
    eot = end_of_turn_strings(tok, model)
    accepted = multi_turn = 0
    for line, conv in enumerate(convs, start=1):
        try:
            ids, mask = reference_sample(tok, conv["messages"], eot, kwargs)
        except Refused as e:
            assert f"line {line}" in refused, f"line {line}: transformers refuses ({e}) but hslake accepted it"
            assert conv["id"] not in got
            continue
        assert f"line {line}" not in refused, f"line {line}: hslake refused: {refused.get(f'line {line}')}"
        row = got[conv["id"]]
        assert row["input_ids"] == ids, f"line {line}: input_ids differ"
        assert row["loss_mask"] == mask, f"line {line}: loss_mask differs"
        accepted += 1
        multi_turn += sum(m["role"] == "assistant" for m in conv["messages"]) > 1
    assert len(got) == accepted, "the output must hold exactly the accepted rows"
    assert accepted >= (0.6 if family == "mistral" else 0.99) * len(convs), (accepted, refused)
    assert multi_turn > 50


def test_turn_by_turn_mask_equals_generation_markers(models, tmp_path):
    """SmolLM2's own template (no markers, turn-by-turn) and the same template with
    {% generation %} markers (transformers' mask) give byte-identical outputs."""
    convs = make_conversations(N, seed=7) + edge_cases(N)
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, convs)
    run_prepare(models["smollm2"], inp, tmp_path / "turns.jsonl")
    r = run_prepare(models["chatml_generation"], inp, tmp_path / "markers.jsonl")
    assert "{% generation %} markers" in r.stderr
    assert (tmp_path / "turns.jsonl").read_text() == (tmp_path / "markers.jsonl").read_text()


def test_parquet_input_gives_the_jsonl_result(models, tmp_path):
    convs = make_conversations(50, seed=3)
    write_jsonl(tmp_path / "in.jsonl", convs)
    pq.write_table(pa.Table.from_pylist(convs), tmp_path / "in.parquet")
    run_prepare(models["smollm2"], tmp_path / "in.jsonl", tmp_path / "a.jsonl")
    run_prepare(models["smollm2"], tmp_path / "in.parquet", tmp_path / "b.parquet")
    rows = pq.read_table(tmp_path / "b.parquet").to_pylist()
    assert [json.loads(l) for l in (tmp_path / "a.jsonl").read_text().splitlines()] == rows


def test_tokenizers_outside_the_direct_encode_path_still_equal_transformers(models, tmp_path):
    """SmolLM2 takes the direct byte-level BPE path; the same tokenizer with a normalizer (Qwen's
    NFC) takes tokenizers' full encode, named in the log, and still equals transformers."""
    convs = make_conversations(100, seed=11) + edge_cases(100)
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, convs)
    r = run_prepare(models["smollm2"], inp, tmp_path / "direct.jsonl")
    assert "encode=byte-level BPE, direct" in r.stderr, r.stderr
    nfc = tmp_path / "nfc"
    shutil.copytree(models["smollm2"], nfc, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = json.loads((nfc / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (nfc / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    r = run_prepare(nfc, inp, tmp_path / "full.jsonl")
    assert "encode=tokenizers' full encode (the tokenizer has a normalizer)" in r.stderr, r.stderr
    tok = AutoTokenizer.from_pretrained(str(nfc))
    eot = end_of_turn_strings(tok, nfc)
    got = {row["id"]: row for row in read_jsonl(tmp_path / "full.jsonl")}
    for conv in convs:
        ids, mask = reference_sample(tok, conv["messages"], eot)
        assert got[conv["id"]]["input_ids"] == ids, conv["id"]
        assert got[conv["id"]]["loss_mask"] == mask, conv["id"]
