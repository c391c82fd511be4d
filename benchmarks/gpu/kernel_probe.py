#!/usr/bin/env python3
"""Where a decoder layer's time goes, part by part: our forward's kernels against vLLM's.

For one batch (default 8 x 2048 tokens) of each model's shapes, times every part of one decoder
layer with CUDA events, three ways where they exist:

- "ours": the libtorch operations that hslake's Rust forward issues for that part, in its order
  and with its strides (transcribed from capture/src/models/: the fast RMS norm, RoPE as
  `RopeTables::apply`, SDPA, the grouped-GEMM experts of `Experts::forward_grouped`, the router
  of `moe/router.rs`);
- "vllm": vLLM's own kernels for the same part (fused add+RMS norm, its RoPE, FlashAttention 3,
  fused top-k, fused grouped top-k, the Triton fused-MoE experts, SiLU-and-mul), as its layer
  calls them; needs vLLM importable (PYTHONPATH);
- alternatives we may adopt: every SDPA backend libtorch has (flash, cuDNN, memory-efficient).

Models (random weights, only shapes matter): Llama-3.1-8B, Qwen3-30B-A3B and DeepSeek-V3
(MLA attention + a 256-expert MoE layer). Prints a table per model and writes JSON.

    python3 benchmarks/gpu/kernel_probe.py --out probe.json [--models llama,qwen,ds] [--iters 10]
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch
import torch.nn.functional as F

DEV = "cuda"
BF16 = torch.bfloat16

MODELS = {
    "llama": dict(name="Llama-3.1-8B", hidden=4096, heads=32, kv_heads=8, head_dim=128,
                  inter=14336, moe=None, qk_norm=False),
    "qwen": dict(name="Qwen3-30B-A3B", hidden=2048, heads=32, kv_heads=4, head_dim=128,
                 inter=6144, qk_norm=True,
                 moe=dict(experts=128, top_k=8, inter=768, routing="softmax", shared=None)),
    "ds": dict(name="DeepSeek-V3", hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128,
               rope=64, v=128, inter=18432, mla=True,
               moe=dict(experts=256, top_k=8, inter=2048, routing="grouped_sigmoid",
                        n_group=8, topk_group=4, shared=2048, scale=2.5)),
}


class Timer:
    """Median milliseconds of `fn` over `iters` runs after `warmup`, by CUDA events."""

    def __init__(self, iters, warmup=3):
        self.iters, self.warmup = iters, warmup

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        if DEV == "cpu":  # a dry run of the probe itself: wall time
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[len(times) // 2]
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]


def rnd(*shape, dtype=BF16, scale=1.0):
    return torch.randn(*shape, device=DEV, dtype=dtype).mul_(scale)


# ---- ours: transcriptions of the Rust forward's libtorch calls ----

def our_norm(x, w, eps=1e-6):
    rstd = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, dtype=torch.float32)
    rstd = rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    out = torch.empty_like(x)
    torch.mul(x, rstd, out=out)
    return out.mul_(w)


def rope_tables(t, d, kind=BF16):
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(t, dtype=torch.float32)
    f = pos[:, None] * inv[None, :]
    emb = torch.cat([f, f], -1).to(DEV)
    cos, sin = emb.cos().to(kind).view(1, t, 1, d), emb.sin().to(kind).view(1, t, 1, d)
    h = d // 2
    return cos, -sin[..., :h], sin[..., h:]


def our_rope(x, tables):
    cos, sin_lo_neg, sin_hi = tables
    h = x.shape[3] // 2
    rot = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x[..., h:], sin_lo_neg, out=rot[..., :h])
    torch.mul(x[..., :h], sin_hi, out=rot[..., h:])
    return (x * cos).add_(rot)


def our_softmax_topk(logits, k):
    probs = logits.softmax(-1, dtype=torch.float32)
    top, ids = probs.topk(k, -1, True, True)
    top = top / top.sum(-1, keepdim=True)
    return top.to(logits.dtype), ids


def our_grouped_sigmoid_topk(logits, corr, p):
    n, e = logits.shape
    per = e // p["n_group"]
    scores = logits.sigmoid()
    choice = scores + corr
    gs = choice.view(n, p["n_group"], per).topk(2, -1, True, True)[0].sum(-1)
    gi = gs.topk(p["topk_group"], -1, True, False)[1]
    gm = torch.zeros_like(gs).scatter_(1, gi, 1.0)
    em = gm.unsqueeze(-1).expand(n, p["n_group"], per).reshape(n, e).bool()
    choice = choice.masked_fill(~em, float("-inf"))
    ids = choice.topk(p["top_k"], -1, True, False)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * p["scale"], ids


def our_experts_grouped(x, w, ids, gate_up, down, inter, parts, timer):
    """Experts::forward_grouped, each step timed on its own (returns the output)."""
    n, k = ids.shape
    local = gate_up.shape[0]
    st = {}

    def align():
        rel = ids.reshape(-1) - 0
        mine = (rel >= 0).logical_and(rel < local)
        key = rel.where(mine, torch.full_like(rel, local))
        _, perm = key.sort(stable=True)
        ends = key.bincount(minlength=local + 1)[:local].cumsum(0, dtype=torch.int32)
        st.update(mine=mine, perm=perm, ends=ends)

    parts["moe: align (sort, bincount, cumsum)"] = timer(align)
    align()
    perm, ends, mine = st["perm"], st["ends"], st["mine"]
    parts["moe: permute tokens (index_select)"] = timer(lambda: x.index_select(0, perm // k))
    xs = x.index_select(0, perm // k)
    gu_t = gate_up.transpose(-2, -1)
    dn_t = down.transpose(-2, -1)
    parts["moe: grouped GEMM gate_up"] = timer(lambda: torch._grouped_mm(xs, gu_t, offs=ends))
    gu = torch._grouped_mm(xs, gu_t, offs=ends)
    parts["moe: silu * up"] = timer(lambda: F.silu(gu[:, :inter]) * gu[:, inter:])
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    parts["moe: grouped GEMM down"] = timer(lambda: torch._grouped_mm(act, dn_t, offs=ends))
    y = torch._grouped_mm(act, dn_t, offs=ends)

    def unpermute():
        sw = w.reshape(-1).index_select(0, perm)
        yy = (y * sw.unsqueeze(1)).masked_fill(~mine.index_select(0, perm).unsqueeze(1), 0.0)
        inv = perm.argsort()
        return yy.index_select(0, inv).view(n, k, -1).sum(1).to(x.dtype)

    parts["moe: weight, un-permute, sum over top-k"] = timer(unpermute)
    return unpermute()


# ---- vLLM ----

def vllm_ops():
    try:
        import vllm._custom_ops as ops  # noqa: F401
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
        from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import fused_grouped_topk
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func
        return dict(ops=ops, fused_experts=fused_experts, fused_topk=fused_topk,
                    fused_grouped_topk=fused_grouped_topk, fa=flash_attn_varlen_func)
    except Exception as e:  # noqa: BLE001
        print(f"vllm not importable: {e!r}", file=sys.stderr)
        return None


def vllm_config_ctx():
    """vLLM's ops consult a current config in places; give them a default one."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        return set_current_vllm_config(VllmConfig())
    except Exception:  # noqa: BLE001
        import contextlib
        return contextlib.nullcontext()


def attempt(parts, name, fn):
    try:
        parts[name] = fn()
    except Exception as e:  # noqa: BLE001
        parts[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def sdpa_backends(parts, prefix, q, k, v, timer, gqa, scale=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        def run(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                      scale=scale)
        attempt(parts, f"{prefix} [sdpa {name}]", lambda run=run: timer(run))


def attention_flops(b, t, heads, d_qk, d_v):
    # causal: half of the t x t scores, QK^T and PV
    return 2.0 * b * heads * t * t * (d_qk + d_v) / 2


def probe_gqa(m, b, t, timer, vl, parts):
    H, hq, hkv, d = m["hidden"], m["heads"], m["kv_heads"], m["head_dim"]
    n = b * t
    x = rnd(b, t, H)
    nw = rnd(H, scale=0.1) + 1
    wqkv = rnd((hq + 2 * hkv) * d, H, scale=H ** -0.5)
    wo = rnd(H, hq * d, scale=(hq * d) ** -0.5)
    tables = rope_tables(t, d)
    parts["norm (fast) [ours]"] = timer(lambda: our_norm(x, nw))
    buf = torch.empty_like(x)
    parts["residual add [ours]"] = timer(lambda: torch.add(x, x, out=buf))
    parts["QKV projection"] = timer(lambda: F.linear(x, wqkv))
    qkv = F.linear(x, wqkv)
    qk = qkv[..., : (hq + hkv) * d].view(b, t, hq + hkv, d)
    if m.get("qk_norm"):
        qn = rnd(d, scale=0.1) + 1
        parts["q/k head norms [ours]"] = timer(lambda: our_norm(qk, qn))
        qk = our_norm(qk, qn)
    parts["RoPE [ours]"] = timer(lambda: our_rope(qk, tables))
    qk = our_rope(qk, tables)
    q = qk[:, :, :hq].transpose(1, 2)
    k = qk[:, :, hq:].transpose(1, 2)
    v = qkv[..., (hq + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)
    flops = attention_flops(b, t, hq, d, d)
    parts["attention [ours: sdpa default]"] = timer(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    sdpa_backends(parts, "attention", q, k, v, timer, True)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    parts["attention out transpose+reshape [ours]"] = timer(
        lambda: y.transpose(1, 2).reshape(b, t, hq * d))
    yy = y.transpose(1, 2).reshape(b, t, hq * d)
    parts["O projection"] = timer(lambda: F.linear(yy, wo))
    parts["_attention_tflops"] = flops / 1e12
    if vl:
        ops = vl["ops"]
        xf, res = x.view(n, H).clone(), x.view(n, H).clone()
        parts["norm + residual [vllm fused_add_rms_norm]"] = timer(
            lambda: ops.fused_add_rms_norm(xf, res, nw, 1e-6))
        pos = torch.arange(t, device=DEV).repeat(b)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d))
        ang = torch.arange(t, device=DEV, dtype=torch.float32)[:, None] * inv[None]
        cache = torch.cat([ang.cos(), ang.sin()], -1).to(BF16)
        qf = qkv.view(n, -1)[:, : hq * d].contiguous()
        kf = qkv.view(n, -1)[:, hq * d:(hq + hkv) * d].contiguous()
        attempt(parts, "RoPE [vllm rotary_embedding]", lambda: timer(
            lambda: ops.rotary_embedding(pos, qf, kf, d, cache, True)))
        qv = q.transpose(1, 2).reshape(n, hq, d)
        kv_ = k.transpose(1, 2).reshape(n, hkv, d)
        vv = v.transpose(1, 2).reshape(n, hkv, d)
        cu = torch.arange(0, (b + 1) * t, t, device=DEV, dtype=torch.int32)
        attempt(parts, "attention [vllm FA3 varlen]", lambda: timer(
            lambda: vl["fa"](qv, kv_, vv, t, cu, t, cu, causal=True, fa_version=3)))
        attempt(parts, "attention [vllm FA2 varlen]", lambda: timer(
            lambda: vl["fa"](qv, kv_, vv, t, cu, t, cu, causal=True, fa_version=2)))
    return x


def probe_mla(m, b, t, timer, vl, parts):
    H, hq, ql, kl, nope, r, vd = (m["hidden"], m["heads"], m["q_lora"], m["kv_lora"], m["nope"],
                                   m["rope"], m["v"])
    x = rnd(b, t, H)
    nw = rnd(H, scale=0.1) + 1
    wqa = rnd(ql, H, scale=H ** -0.5)
    wqb = rnd(hq * (nope + r), ql, scale=ql ** -0.5)
    wkva = rnd(kl + r, H, scale=H ** -0.5)
    wkvb = rnd(hq * (nope + vd), kl, scale=kl ** -0.5)
    wo = rnd(H, hq * vd, scale=(hq * vd) ** -0.5)
    qln, kln = rnd(ql, scale=0.1) + 1, rnd(kl, scale=0.1) + 1
    tables = rope_tables(t, r)
    parts["norm (fast) [ours]"] = timer(lambda: our_norm(x, nw))
    buf = torch.empty_like(x)
    parts["residual add [ours]"] = timer(lambda: torch.add(x, x, out=buf))

    def q_proj():
        return F.linear(our_norm(F.linear(x, wqa), qln), wqb).view(b, t, hq, nope + r)

    parts["MLA q projections (a, norm, b)"] = timer(q_proj)
    q = q_proj()
    parts["MLA kv_a projection + norm"] = timer(lambda: our_norm(F.linear(x, wkva)[..., :kl], kln))
    comp = F.linear(x, wkva)
    latent = our_norm(comp[..., :kl], kln)

    def rope_cat():
        k_rot = our_rope(comp[..., kl:].unsqueeze(2), tables)
        q_rot = our_rope(q[..., nope:], tables)
        return torch.cat([q[..., :nope], q_rot], 3), k_rot

    parts["RoPE + cat [ours]"] = timer(rope_cat)
    qq, k_rot = rope_cat()
    parts["MLA kv_b projection"] = timer(lambda: F.linear(latent, wkvb))
    kv = F.linear(latent, wkvb).view(b, t, hq, nope + vd)

    def make_k():
        return torch.cat([kv[..., :nope], k_rot.expand(b, t, hq, r)], 3)

    parts["MLA key cat [ours]"] = timer(make_k)
    k = make_k()
    vals = kv[..., nope:]
    scale = (nope + r) ** -0.5
    qt, kt, vt = qq.transpose(1, 2), k.transpose(1, 2), vals.transpose(1, 2)
    parts["attention [ours: sdpa default]"] = timer(
        lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale))
    sdpa_backends(parts, "attention", qt, kt, vt, timer, False, scale)
    y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    yy = y.transpose(1, 2).reshape(b, t, hq * vd)
    parts["O projection"] = timer(lambda: F.linear(yy, wo))
    parts["_attention_tflops"] = attention_flops(b, t, hq, nope + r, vd) / 1e12
    if vl:
        n = b * t
        qv = qq.reshape(n, hq, nope + r)
        kv_ = k.reshape(n, hq, nope + r)
        vv = vals.reshape(n, hq, vd)
        cu = torch.arange(0, (b + 1) * t, t, device=DEV, dtype=torch.int32)
        attempt(parts, "attention [vllm FA3 varlen, v 128]", lambda: timer(
            lambda: vl["fa"](qv, kv_, vv, t, cu, t, cu, softmax_scale=scale, causal=True,
                             fa_version=3)))
        vpad = F.pad(vv, (0, nope + r - vd))
        attempt(parts, "attention [vllm FA3 varlen, v padded]", lambda: timer(
            lambda: vl["fa"](qv, kv_, vpad, t, cu, t, cu, softmax_scale=scale, causal=True,
                             fa_version=3)))
        xf, res = x.view(n, H).clone(), x.view(n, H).clone()
        parts["norm + residual [vllm fused_add_rms_norm]"] = timer(
            lambda: vl["ops"].fused_add_rms_norm(xf, res, nw, 1e-6))
    return x


def probe_moe(m, b, t, timer, vl, parts):
    H, mo = m["hidden"], m["moe"]
    E, k, I = mo["experts"], mo["top_k"], mo["inter"]
    n = b * t
    x = rnd(n, H)
    gate_up = rnd(E, 2 * I, H, scale=H ** -0.5)
    down = rnd(E, H, I, scale=I ** -0.5)
    if mo["routing"] == "softmax":
        wr = rnd(E, H, scale=H ** -0.5)
        parts["router logits [ours]"] = timer(lambda: F.linear(x, wr))
        logits = F.linear(x, wr)
        parts["router softmax top-k [ours]"] = timer(lambda: our_softmax_topk(logits, k))
        w, ids = our_softmax_topk(logits, k)
    else:
        wr = rnd(E, H, dtype=torch.float32, scale=H ** -0.5)
        corr = rnd(E, dtype=torch.float32, scale=0.01)
        parts["router logits f32 [ours]"] = timer(lambda: F.linear(x.float(), wr))
        logits = F.linear(x.float(), wr)
        p = dict(n_group=mo["n_group"], topk_group=mo["topk_group"], top_k=k, scale=mo["scale"])
        parts["router grouped sigmoid top-k [ours]"] = timer(
            lambda: our_grouped_sigmoid_topk(logits, corr, p))
        w, ids = our_grouped_sigmoid_topk(logits, corr, p)
    t0 = time.time()
    ours = our_experts_grouped(x, w, ids, gate_up, down, I, parts, timer)
    print(f"  experts (ours) probed in {time.time() - t0:.1f} s", file=sys.stderr)
    parts["_moe_tflops"] = 2.0 * n * k * 3 * H * I / 1e12
    if mo.get("shared"):
        S = mo["shared"]
        wsgu, wsd = rnd(2 * S, H, scale=H ** -0.5), rnd(H, S, scale=S ** -0.5)

        def shared():
            g = F.linear(x, wsgu)
            return F.linear(F.silu(g[:, :S]) * g[:, S:], wsd)

        parts["shared expert [ours]"] = timer(shared)
    if vl:
        with vllm_config_ctx():
            if mo["routing"] == "softmax":
                attempt(parts, "router top-k [vllm fused_topk]", lambda: timer(
                    lambda: vl["fused_topk"](x, logits, k, True)))
                vw, vids, *_ = vl["fused_topk"](x, logits, k, True)
            else:
                attempt(parts, "router grouped top-k [vllm fused_grouped_topk]", lambda: timer(
                    lambda: vl["fused_grouped_topk"](x, logits, k, True, corr, mo["n_group"],
                                                     mo["topk_group"], "sigmoid", mo["scale"])))
                vw, vids = w.float(), ids.to(torch.int32)
            attempt(parts, "experts [vllm fused_experts, Triton]", lambda: timer(
                lambda: vl["fused_experts"](x, gate_up, down, vw, vids)))
            try:
                ref = vl["fused_experts"](x, gate_up, down, w.float(), ids.to(torch.int32))
                cos = F.cosine_similarity(ref.float(), ours.float(), dim=-1)
                parts["_experts_min_cosine_ours_vs_vllm"] = cos.min().item()
            except Exception as e:  # noqa: BLE001
                parts["_experts_min_cosine_ours_vs_vllm"] = f"error: {e!r}"[:200]
    return x


def probe_dense_mlp(m, b, t, timer, vl, parts):
    H, I = m["hidden"], m["inter"]
    n = b * t
    x = rnd(n, H)
    gu = rnd(2 * I, H, scale=H ** -0.5)
    dn = rnd(H, I, scale=I ** -0.5)
    parts["MLP gate_up GEMM"] = timer(lambda: F.linear(x, gu))
    g = F.linear(x, gu)
    parts["MLP silu * up [ours]"] = timer(lambda: F.silu(g[:, :I]) * g[:, I:])
    a = F.silu(g[:, :I]) * g[:, I:]
    parts["MLP down GEMM"] = timer(lambda: F.linear(a, dn))
    parts["_mlp_tflops"] = 2.0 * n * 3 * H * I / 1e12
    if vl:
        out = torch.empty(n, I, device=DEV, dtype=BF16)
        attempt(parts, "MLP silu_and_mul [vllm]", lambda: timer(
            lambda: torch.ops._C.silu_and_mul(out, g)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,qwen,ds")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", default="kernel_probe.json")
    ap.add_argument("--cpu-tiny", action="store_true",
                    help="dry run of the probe on the CPU at tiny widths (checks the script only)")
    a = ap.parse_args()
    if a.cpu_tiny:
        global DEV, BF16
        DEV, BF16 = "cpu", torch.float32
        for m in MODELS.values():
            for key in ("hidden", "inter", "q_lora", "kv_lora"):
                if key in m:
                    m[key] = max(16, m[key] // 64)
            if m.get("moe"):
                m["moe"]["inter"] = max(16, m["moe"]["inter"] // 64)
                m["moe"]["experts"] = max(16, m["moe"]["experts"] // 8)
                m["moe"]["n_group"] = min(m["moe"].get("n_group", 1), 4)
                m["moe"]["topk_group"] = min(m["moe"].get("topk_group", 1), 2)
                if m["moe"].get("shared"):
                    m["moe"]["shared"] = 32
    torch.manual_seed(0)
    timer = Timer(a.iters)
    vl = None if a.no_vllm else vllm_ops()
    result = dict(gpu=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", torch=torch.__version__,
                  cudnn=torch.backends.cudnn.version(), batch=a.batch, seq=a.seq,
                  vllm=None, models={})
    if vl:
        import vllm
        result["vllm"] = vllm.__version__
    print(json.dumps({k: v for k, v in result.items() if k != "models"}))
    for key in a.models.split(","):
        m = MODELS[key]
        parts = {}
        t0 = time.time()
        for probe in ([probe_mla] if m.get("mla") else [probe_gqa]) + (
                [probe_moe] if m.get("moe") else [probe_dense_mlp]):
            try:
                probe(m, a.batch, a.seq, timer, vl, parts)
            except Exception:  # noqa: BLE001
                parts[f"_{probe.__name__} failed"] = traceback.format_exc()[-600:]
            torch.cuda.empty_cache()
        result["models"][m["name"]] = parts
        print(f"\n== {m['name']} ({a.batch} x {a.seq} tokens), {time.time() - t0:.0f} s")
        for name, v in parts.items():
            print(f"  {name:55s} {v:9.3f}" if isinstance(v, float) else f"  {name:55s} {v}")
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
