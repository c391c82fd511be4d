"""Helpers for the `hslake prepare` tests: model directories for several chat-template families,
conversations that stress templates and masks, a reference of the turn-by-turn mask written
against transformers, and running the CLI."""
import json
import random
import re
import shutil
import subprocess
from pathlib import Path

from capture_util import ROOT, hslake_bin

SMOLLM2 = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"
FAMILIES = {k: v for k, v in json.loads((FIXTURES / "families.json").read_text()).items() if not k.startswith("_")}


def make_family_dir(family, out):
    """SmolLM2's tokenizer.json with the family's special tokens added, its template and configs."""
    from tokenizers import AddedToken, Tokenizer

    spec = FAMILIES[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.get("special", [])])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("added", [])])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
    for key in ("bos_token", "eos_token", "pad_token"):
        if key in spec:
            config[key] = spec[key]
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    shutil.copy(FIXTURES / spec["template"], out / "chat_template.jinja")
    if "eos_ids" in spec:
        ids = [tok.token_to_id(t) for t in spec["eos_ids"]]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return out


UNICODE = ["héllo wörld", "日本語のテキストです", "emoji 👩‍👩‍👧‍👦 and 🇫🇷 flags", "Ελληνικά κείμενα",
           "עברית וערבית العربية", "combining e\u0301 a\u0308", "zero\u200bwidth\u200djoiner", "тест кириллицы",
           "math ∑∫√∞ ≠ ≤", "tab\tand\r\nCRLF", "   leading and trailing spaces   ", "\n\nnewlines\n\n"]
WORDS = ["the", "model", "answer", "question", "data", "train", "draft", "token", "why", "how", "is", "a",
         "speculative", "decoding", "layer", "hidden", "state", "42", "3.14", "code:", "def f(x):", "return"]


def _text(rng, allow_empty=True):
    r = rng.random()
    if allow_empty and r < 0.06:
        return ""
    if r < 0.3:
        return rng.choice(UNICODE) + " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))


def make_conversations(n, seed=0, system_rate=0.3, think_rate=0.0):
    """`n` OpenAI-style conversations: one to four exchanges, some with a system prompt, empty and
    unicode-heavy messages; with think_rate, assistant answers that carry <think> blocks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        if rng.random() < system_rate:
            msgs.append({"role": "system", "content": _text(rng)})
        for _ in range(rng.choice([1, 1, 2, 3, 4])):
            msgs.append({"role": "user", "content": _text(rng)})
            answer = _text(rng)
            if rng.random() < think_rate:
                answer = "<think>\n" + _text(rng, allow_empty=False) + "\n</think>\n\n" + answer
            msgs.append({"role": "assistant", "content": answer})
        out.append({"id": i, "messages": msgs})
    return out


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def run_prepare(model, inputs, out, *extra, check=True, timeout=600):
    cmd = [hslake_bin(), "prepare", "--model", str(model), "--input", str(inputs), "--output", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    return r


def end_of_turn_strings(tok, model_dir):
    """The tokenizer's eos_token and every generation_config eos_token_id, as strings."""
    out = [tok.eos_token] if tok.eos_token else []
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
        for i in ([ids] if isinstance(ids, int) else ids or []):
            t = tok.convert_ids_to_tokens(i)
            if t not in out:
                out.append(t)
    return out


class Refused(Exception):
    """The reference refuses the conversation (its reason as text)."""


def reference_sample(tok, messages, eot, kwargs=None):
    """input_ids and loss mask the way hslake must produce them, computed with transformers alone:
    ids from apply_chat_template(tokenize=True); the mask from return_assistant_tokens_mask when the
    template has {% generation %}, else turn by turn: an assistant turn runs from the end of the
    rendering of the messages before it with the generation prompt (or of the part of that prompt
    the full rendering shares), through its first end-of-turn token; every token overlapping that
    text gets loss."""
    import jinja2

    kwargs = kwargs or {}
    try:
        if re.search(r"\{%-?\s*generation\s*-?%\}", tok.chat_template):
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True, **kwargs)
            return list(out["input_ids"]), list(out["assistant_masks"])
        ids = list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])
        full = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise Refused(f"template error: {e}")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompted = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kwargs)
        if full.startswith(prompted):
            start = len(prompted)
        else:
            # The prompt may differ from a followed turn (Qwen3's empty think block with
            # enable_thinking=False): start after the part of it the full rendering shares.
            history = tok.apply_chat_template(messages[:i], tokenize=False, **kwargs) if i else ""
            shared = 0
            if full.startswith(history) and prompted.startswith(history):
                for a, b in zip(prompted[len(history):], full[len(history):]):
                    if a != b:
                        break
                    shared += 1
            if shared == 0:
                raise Refused(f"not prefix-stable at message {i}")
            start = len(history) + shared
        ends = [full.find(t, start) + len(t) for t in eot if full.find(t, start) >= 0]
        if not ends:
            raise Refused(f"no end-of-turn token at message {i}")
        spans.append((start, min(ends)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids
    mask = [int(any(e > s0 and s < e0 for s0, e0 in spans)) for s, e in enc["offset_mapping"]]
    return ids, mask
