"""On CUDA, each operation capture now runs with a 0-dim CPU tensor operand (capture/src/scalar.rs)
against the same operation with a Python scalar, as capture ran it before: same bits, same dtype.
Also the fast RMS norm's Frobenius form against torch.norm(2, -1). Run on a GPU machine with
torch 2.11 (the version capture links): python3 scalar_forms_cuda.py [cuda|cpu]"""
import sys

import torch

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
f = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731  (scalar::float)
i = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731  (scalar::int)
checks = []


def bits(t):
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def same(name, a, b):
    ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    checks.append((name, ok))
    print(f"{'same' if ok else 'DIFFERENT'}: {name} ({a.dtype})")


for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(4096, 1000, device=dev).to(dt)
    for s in (1 / 3, 1e-6, 2.5, 0.5, 1e-2, 1.2):
        same(f"mul {s}", x * f(s), x * s)
        same(f"add {s}", x + f(s), x + s)
        same(f"div {s}", x / f(s), x / s)
        same(f"sub {s}", x - f(s), x - s)
        y, z = x.clone(), x.clone()
        same(f"add_ {s}", y.add_(f(s)), z.add_(s))
        y, z = x.clone(), x.clone()
        same(f"div_ {s}", y.div_(f(s)), z.div_(s))
    m = x > 0
    for v in (float("-inf"), 0.0):
        same(f"masked_fill {v}", x.masked_fill(m, f(v)), x.masked_fill(m, v))
    same("gt", x.gt(f(0.25)), x.gt(0.25))
    same("lt", x.lt(f(0.25)), x.lt(0.25))
    same("clamp", x.clamp(f(0.0), f(1.0)), x.clamp(0.0, 1.0))
    y, z = x.clone(), x.clone()
    same("fill_", y[:7].fill_(f(3.0e38)), z[:7].fill_(3.0e38))

ids = torch.randint(0, 300, (8192,), device=dev)
for s in (0, 7, 100, 299):
    same(f"int ge {s}", ids.ge(i(s)), ids.ge(s))
    same(f"int lt {s}", ids.lt(i(s)), ids.lt(s))
    same(f"int sub {s}", ids - i(s), ids - s)
same("int floor_divide", ids.floor_divide(i(8)), torch.floor_divide(ids, 8))
same("int clamp", (ids - i(50)).clamp(i(0), i(99)), (ids - 50).clamp(0, 99))
mine = ids.lt(150)
same("where other", ids.where(mine, i(150)), ids.where(mine, 150))
codes = torch.randint(0, 256, (512, 64), device=dev, dtype=torch.uint8)
out_a, out_b = torch.empty_like(codes), torch.empty_like(codes)
same("bitwise_and out", torch.bitwise_and(codes, i(15), out=out_a), torch.bitwise_and(codes, 15, out=out_b))
same("right_shift out", torch.bitwise_right_shift(codes, i(4), out=out_a), torch.bitwise_right_shift(codes, 4, out=out_b))
y, z = codes.clone(), codes.clone()
same("uint8 sub_", y.sub_(i(8)), z.sub_(8))
ones = torch.ones(64, 1000, dtype=torch.int64, device=dev)
for kind in (torch.int64, torch.float32):
    same(f"arange {kind}", (ones[0].cumsum(0) - ones[0]).to(kind), torch.arange(1000, device=dev, dtype=kind))
scores = torch.rand(4096, 8, device=dev)
idx = scores.topk(2, -1).indices
a, b = torch.zeros_like(scores), torch.zeros_like(scores)
same("scatter ones", a.scatter_(1, idx, torch.ones(idx.shape, dtype=a.dtype, device=dev)), b.scatter_(1, idx, 1.0))
for shape in ((4096, 7168), (2, 2048, 4096), (8, 3, 576)):
    x = torch.randn(*shape, device=dev).to(torch.bfloat16)
    if len(shape) == 3:
        x = x[..., : shape[-1] - 64]  # strided rows, as a slice of a fused projection
    fro = torch.linalg.norm(x.unsqueeze(-1), "fro", dim=(-2, -1), keepdim=True, dtype=torch.float32).squeeze(-1)
    same(f"fast norm {tuple(x.shape)}", fro, torch.norm(x, 2, dim=-1, keepdim=True, dtype=torch.float32))
bad = [n for n, ok in checks if not ok]
where = torch.cuda.get_device_name() if dev == "cuda" else dev
print(f"{len(checks) - len(bad)} of {len(checks)} the same; torch {torch.__version__}, {where}")
raise SystemExit(1 if bad else 0)
