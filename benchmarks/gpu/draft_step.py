"""Training-step throughput of an EAGLE-3 draft the size of Llama-3.1-8B's, on one GPU: the rate
at which a loader must deliver tokens so that it never makes the trainer wait.

A stand-in built from torch alone, shaped as speculators' and SpecForge's Llama drafts are: the
three captured aux layers [T, 3H] -> fc -> H; one decoder layer whose attention takes the token
embedding and that state concatenated [T, 2H] (32 query / 8 KV heads of 128, SwiGLU of 14336);
norm; a draft LM head over 32,000 tokens; the target's logits over the same tokens come from the
frozen verifier head applied to the captured last-layer state, as the trainers compute them;
forward KL loss; TTT_STEPS test-time-training steps, each feeding the draft's own state back;
AdamW on the trainable weights; bf16 weights and activations.

  python3 benchmarks/gpu/draft_step.py [--tokens 8192] [--steps 20] [--ttt 3]
Prints tokens/s of the full step (forward, backward, optimizer) over packed rows of --tokens."""
import argparse
import time

import torch
import torch.nn.functional as F

H, HEADS, KV, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 4096, 32, 8, 128, 14336, 128256, 32000


def rms(x, w, eps=1e-5):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Draft(torch.nn.Module):
    def __init__(self):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.fc = lin(3 * H, H)
        self.q, self.k, self.v = lin(2 * H, HEADS * HEAD_DIM), lin(2 * H, KV * HEAD_DIM), lin(2 * H, KV * HEAD_DIM)
        self.o = lin(HEADS * HEAD_DIM, H)
        self.gate, self.up, self.down = lin(H, INTER), lin(H, INTER), lin(INTER, H)
        self.n_in, self.n_hidden, self.n_post, self.n_out = (torch.nn.Parameter(torch.ones(H)) for _ in range(4))
        self.head = lin(H, DRAFT_VOCAB)

    def layer(self, emb, state):
        t = state.shape[0]
        x = torch.cat([rms(emb, self.n_in), rms(state, self.n_hidden)], -1)
        q = self.q(x).view(t, HEADS, HEAD_DIM).transpose(0, 1)
        # KV heads repeated for the query heads, so that SDPA takes its fused flash kernel (with
        # enable_gqa it fell back to the math path and a [heads, T, T] score matrix here).
        k = self.k(x).view(t, KV, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        v = self.v(x).view(t, KV, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True)[0]
        h = state + self.o(a.transpose(0, 1).reshape(t, HEADS * HEAD_DIM))
        y = rms(h, self.n_post)
        return h + self.down(F.silu(self.gate(y)) * self.up(y))

    def forward(self, emb, aux, ttt):
        state, logits = self.fc(aux), []
        for _ in range(ttt):
            state = self.layer(emb, state)
            logits.append(self.head(rms(state, self.n_out)))
        return logits


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ttt", type=int, default=3)
    a = p.parse_args()
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    draft = Draft().to(dev, bf)
    embed = torch.nn.Embedding(VOCAB, H).to(dev, bf).requires_grad_(False)
    verifier_head = torch.randn(DRAFT_VOCAB, H, device=dev, dtype=bf) * H ** -0.5
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    t = a.tokens
    ids = torch.randint(0, VOCAB, (t,), device=dev)
    aux = torch.randn(t, 3 * H, device=dev, dtype=bf)
    last = torch.randn(t, H, device=dev, dtype=bf)

    def step():
        with torch.no_grad():
            target = F.log_softmax((last @ verifier_head.t()).float(), -1)
        logits = draft(embed(ids), aux, a.ttt)
        loss = sum(F.kl_div(F.log_softmax(lg.float(), -1), target, log_target=True, reduction="batchmean")
                   for lg in logits)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    params = sum(p.numel() for p in draft.parameters())
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: draft {params / 1e6:.0f} M trainable "
          f"parameters, {a.ttt} TTT steps, rows of {t} tokens: {a.steps * t / secs:,.0f} tokens/s "
          f"({secs / a.steps * 1e3:.1f} ms a step), peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
