"""Build data/eagle3_prompts.jsonl: a few thousand chat prompts from text that ships offline —
the 36 hand-written prompts of data/prompts.jsonl plus questions about the Python standard
library built from its own docstrings (every Python install carries them). Deterministic for a
given Python version; the committed file is what the EAGLE-3 example uses.

  python -m hslake_eagle3.make_prompts --out data/eagle3_prompts.jsonl --count 4000
"""
import argparse
import importlib
import inspect
import json
import re

MODULES = sorted("""
abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections colorsys
concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib dis
email enum filecmp fnmatch fractions functools gc getopt glob graphlib gzip hashlib heapq hmac
html http.client imaplib inspect io ipaddress itertools json keyword linecache locale logging
lzma mailbox math mimetypes operator os os.path pathlib pickle pkgutil platform plistlib
poplib pprint queue quopri random re reprlib sched secrets select selectors shelve shlex shutil
signal smtplib socket sqlite3 ssl stat statistics string struct subprocess symtable sys
sysconfig tarfile tempfile textwrap threading time timeit token tokenize tomllib trace
traceback tracemalloc types typing unicodedata unittest urllib.parse urllib.request uuid
warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib
""".split())

TEMPLATES = [
    "What does `{qual}` do in Python? Answer in two or three sentences.",
    "Explain this Python documentation to a beginner: \"{doc}\"",
    "Write a short Python example that uses `{qual}` and explain it.",
    "Summarize in one sentence: {doc}",
    "When would I use `{qual}` instead of writing the code myself?",
    "What are common mistakes when using `{qual}`?",
]


def first_sentences(doc: str, limit: int = 240) -> str:
    text = " ".join(doc.strip().split())
    m = re.match(r"(.{20,%d}?[.!?])(\s|$)" % limit, text)
    return m.group(1) if m else text[:limit]


def api_items():
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 30:
                continue
            yield f"{name}.{attr}", first_sentences(doc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=4000)
    ap.add_argument("--chat", default="data/prompts.jsonl")
    a = ap.parse_args()
    prompts = [json.loads(l)["prompt"] for l in open(a.chat) if l.strip()]
    seen = set(prompts)
    # Two different questions per documented item.
    for i, (qual, doc) in enumerate(api_items()):
        for t in (i, i + len(TEMPLATES) // 2):
            p = TEMPLATES[t % len(TEMPLATES)].format(qual=qual, doc=doc)
            if p not in seen and len(prompts) < a.count:
                seen.add(p)
                prompts.append(p)
    with open(a.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {a.out}")


if __name__ == "__main__":
    main()
