"""Llama-3.1-8B shapes with random bf16 weights, saved with save_pretrained, plus random 2048-token samples.
Needs one CUDA GPU (the weights are made there), torch and transformers."""
import argparse, json, os, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--inputs", required=True)
p.add_argument("--samples", type=int, default=192)
p.add_argument("--seq", type=int, default=2048)
a = p.parse_args()
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}, rope_theta=500000.0)
t = time.time()
if not os.path.exists(os.path.join(a.out, "config.json")):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out)
    del model
    torch.cuda.empty_cache()
print(f"model ready in {time.time() - t:.0f}s")
g = torch.Generator().manual_seed(1)
with open(a.inputs, "w") as f:
    for i in range(a.samples):
        ids = torch.randint(0, cfg.vocab_size, (a.seq,), generator=g).tolist()
        f.write(json.dumps({"input_ids": ids}) + "\n")
print(f"{a.samples} samples of {a.seq} tokens in {a.inputs}")
