"""Regenerate answers with the target model itself (batched greedy decoding) and tokenize the
chats for capture: the training samples EAGLE-3 needs are the target's own outputs.

  python -m hslake_eagle3.generate --model DIR --prompts data/eagle3_prompts.jsonl \
      --train train.jsonl --heldout heldout.jsonl [--heldout-count 64] [--limit N] \
      [--max-new-tokens 128] [--batch-size 256] [--device cuda]

Every --heldout-every-th prompt (the first --heldout-count of them) is held out: written as its
chat-templated prompt ids for the speculative-decoding evaluation, never trained on. The rest
become samples {id, input_ids, loss_mask} (loss on the answer only) for `hslake capture`.
"""
import argparse
import json
import os
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--heldout-count", type=int, default=64)
    ap.add_argument("--heldout-every", type=int, default=29)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    rows = [json.loads(l)["prompt"] for l in open(a.prompts) if l.strip()][: a.limit]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"] for p in rows]
    held = [i for i in range(len(ids)) if i % a.heldout_every == a.heldout_every - 1][: a.heldout_count]
    held_set = set(held)
    train = [i for i in range(len(ids)) if i not in held_set]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    # Similar lengths per batch keep left padding small; order restored by index below.
    order = sorted(train, key=lambda i: len(ids[i]))
    answers = {}
    t0 = time.time()
    for start in range(0, len(order), a.batch_size):
        chunk = order[start:start + a.batch_size]
        width = max(len(ids[i]) for i in chunk)
        x = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk], device=a.device)
        m = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], device=a.device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=m, max_new_tokens=a.max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for i, row in zip(chunk, out[:, width:].tolist()):
            # The answer up to and including the end-of-turn token; padding after it dropped.
            if tok.eos_token_id in row:
                row = row[:row.index(tok.eos_token_id) + 1]
            answers[i] = row
        print(f"  answered {min(start + a.batch_size, len(order))}/{len(order)} prompts "
              f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    for path in (a.train, a.heldout):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tokens = 0
    with open(a.train + ".tmp", "w") as f:
        for i in train:
            full = ids[i] + answers[i]
            tokens += len(full)
            f.write(json.dumps({"id": i, "input_ids": full, "loss_mask": [0] * len(ids[i]) + [1] * len(answers[i])})
                    + "\n")
    os.replace(a.train + ".tmp", a.train)
    with open(a.heldout + ".tmp", "w") as f:
        for i in held:
            f.write(json.dumps({"id": i, "input_ids": ids[i]}) + "\n")
    os.replace(a.heldout + ".tmp", a.heldout)
    print(f"wrote {len(train)} samples ({tokens} tokens) to {a.train}, {len(held)} held-out prompts to "
          f"{a.heldout} in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
