"""Greedy decoding of a transformers target, plain and with an EAGLE-3 draft (speculators'
Eagle3DraftModel) proposing tokens that the target verifies: the speculative output must equal
the plain greedy output token for token; what changes is the number of target forwards.

One verify round: the draft proposes k tokens from the target's auxiliary hidden states of the
verified prefix; the target runs on [last accepted token, d_1..d_k] with its KV cache; the
longest prefix of drafts equal to the target's own argmax is accepted, plus the target's next
token. Acceptance length = tokens produced per target forward (a + 1).

The draft runs as in its training forward (speculators ``models/eagle3/core.py``): position i
of the verified prefix gets cat(embed(x_{i+1}), fc(aux_i)) at position id i + 1; each further
draft token d_s gets cat(embed(d_s), h) where h is the draft layer's output at the previous
position (TTT step s, causal over everything before it). It is recomputed over the whole
sequence each round (no draft KV cache): simple, and cheap for a one-layer draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class Decoded:
    tokens: list
    seconds: float
    target_forwards: int = 0
    accepted: list = field(default_factory=list)  # tokens produced per verify round


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(target, prompt_ids: list, max_new: int, eos: int | None) -> Decoded:
    """Plain greedy decoding with a KV cache, one token per target forward."""
    device = next(target.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache()
    out = target(torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True)
    nxt = int(out.logits[0, -1].argmax())
    tokens, forwards = [nxt], 1
    while len(tokens) < max_new and nxt != eos:
        out = target(torch.tensor([[nxt]], device=device), past_key_values=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        forwards += 1
    _sync(device)
    return Decoded(tokens, time.perf_counter() - t0, forwards)


class DraftRunner:
    """speculators' Eagle3DraftModel run for inference (see the module doc)."""

    def __init__(self, draft, aux_hf_indices):
        self.d = draft.eval()
        self.aux = list(aux_hf_indices)
        # Training used flex-attention block masks; inference here is plain causal attention.
        self.d.config.transformer_layer_config._attn_implementation = "sdpa"
        d2t = getattr(self.d, "d2t", None)
        self.d2t = d2t if isinstance(d2t, torch.Tensor) else None

    def project(self, hidden_states):
        """fc(aux) for target hidden_states (a tuple as transformers returns it): [1, L, H]."""
        x = torch.cat([hidden_states[k] for k in self.aux], dim=-1)
        if self.d.input_norm is not None:
            x = self.d.input_norm(x)
        if self.d.fc_norm is not None:
            chunks = x.chunk(len(self.d.fc_norm), dim=-1)
            x = torch.cat([n(c) for n, c in zip(self.d.fc_norm, chunks)], dim=-1)
        return self.d.fc(x)

    def _to_target(self, draft_token):
        return draft_token + int(self.d2t[draft_token]) if self.d2t is not None else draft_token

    @torch.no_grad()
    def propose(self, tokens_next: torch.Tensor, projected: torch.Tensor, k: int) -> list:
        """k draft tokens. tokens_next[i] = x_{i+1} for the verified positions i = 0..m (the last
        is the target's newest token); projected[i] = fc(aux_i)."""
        d = self.d
        dtype = projected.dtype
        embeds = d.embed_tokens(tokens_next.unsqueeze(0)).to(dtype)        # [1, m+1, H]
        hidden = projected.unsqueeze(0) if projected.dim() == 2 else projected
        seq = torch.cat([embeds, hidden], dim=-1)                            # [1, m+1, 2H]
        out = []
        for _ in range(k):
            n = seq.shape[1]
            pos = torch.arange(1, n + 1, device=seq.device).unsqueeze(0)
            h = seq
            pe = d.rotary_emb(h, pos)
            for layer in d.layers:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            last = h[:, -1:]                                                 # pre-norm, as in TTT
            logits = d.lm_head(d.norm(last)) if not d.config.norm_output else d.lm_head(last)
            tok = self._to_target(int(logits[0, -1].argmax()))
            out.append(tok)
            emb = d.embed_tokens(torch.tensor([[tok]], device=seq.device)).to(dtype)
            seq = torch.cat([seq, torch.cat([emb, last], dim=-1)], dim=1)
        return out


@torch.no_grad()
def speculative(target, runner: DraftRunner, prompt_ids: list, max_new: int, eos: int | None,
                k: int = 4) -> Decoded:
    """Greedy draft-and-verify decoding; same output as ``greedy``."""
    device = next(target.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    out = target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    projected = runner.project(out.hidden_states)[0]                         # [m+1, H]
    verified = list(prompt_ids)
    nxt = int(out.logits[0, -1].argmax())
    tokens, forwards, accepted = [nxt], 1, []
    while len(tokens) < max_new and nxt != eos:
        follow = torch.tensor(verified[1:] + [nxt], device=device)
        drafts = runner.propose(follow, projected, k)
        block = torch.tensor([[nxt] + drafts], device=device)
        out = target(block, past_key_values=cache, use_cache=True, output_hidden_states=True)
        forwards += 1
        preds = out.logits[0].argmax(-1).tolist()                            # after nxt, d_1..d_k
        a = 0
        while a < k and drafts[a] == preds[a]:
            a += 1
        # Keep nxt and the accepted drafts in the cache; the rest of the block goes.
        if k - a > 0:
            cache.crop(-(k - a))  # negative: remove that many (older and newer transformers)
        new_proj = runner.project(out.hidden_states)[0][: a + 1]
        projected = torch.cat([projected, new_proj], dim=0)
        verified += [nxt] + drafts[:a]
        before = len(tokens)
        for t in drafts[:a] + [preds[a]]:
            tokens.append(t)
            if t == eos or len(tokens) >= max_new:
                break
        accepted.append(len(tokens) - before)
        nxt = tokens[-1]
    _sync(device)
    return Decoded(tokens, time.perf_counter() - t0, forwards, accepted)
