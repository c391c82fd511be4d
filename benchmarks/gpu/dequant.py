"""Times the building blocks of FP8-block and INT4 dequantization on one GPU (the bound of
`hslake capture` on quantized MoE checkpoints, docs/PERFORMANCE.md), and whether libtorch's FP8
GEMM with block scales runs here:  python3 benchmarks/gpu/dequant.py [--rows 16384 --cols 7168]
Needs one CUDA GPU and torch.
Each line: milliseconds per call (median of 20 after 3 warm-ups) and the bytes it moves per second."""
import argparse
import torch


def timed(fn, moved_bytes, label):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    print(f"{label:<62} {ms:8.3f} ms {moved_bytes / ms / 1e6:8.0f} GB/s", flush=True)
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", type=int, default=7168)
    a = p.parse_args()
    r, c, dev = a.rows, a.cols, "cuda"
    n = r * c
    print(torch.__version__, torch.cuda.get_device_name(), f"[{r}, {c}] = {n / 1e6:.0f} M values")
    w8 = (torch.randn(r, c, device=dev) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(r // 128, c // 128, device=dev) + 0.5
    out = torch.empty(r, c, device=dev, dtype=torch.bfloat16)
    w16 = w8.to(torch.bfloat16)
    timed(lambda: out.copy_(w16), 4 * n, "bf16 copy (bandwidth reference)")
    timed(lambda: w8.to(torch.bfloat16), 3 * n, "fp8 -> bf16")
    timed(lambda: w8.to(torch.float32), 5 * n, "fp8 -> f32")
    tiles = lambda t: t.view(r // 128, 128, c // 128, 128)
    sv = s.view(r // 128, 1, c // 128, 1)
    timed(lambda: torch.mul(tiles(w16), sv, out=tiles(out)), 4 * n, "bf16 x f32 block scale -> bf16 (broadcast, mixed)")
    w32 = w8.to(torch.float32)
    timed(lambda: torch.mul(tiles(w32), sv, out=tiles(out)), 6 * n, "f32 x f32 block scale -> bf16 (broadcast, mixed out)")
    o32 = torch.empty_like(w32)
    timed(lambda: torch.mul(tiles(w32), sv, out=tiles(o32)), 8 * n, "f32 x f32 block scale -> f32 (broadcast, one dtype)")
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1).contiguous()
    timed(lambda: torch.mul(w16, full, out=out), 8 * n, "bf16 x f32 full-size scale -> bf16 (no broadcast)")
    sb = s.to(torch.bfloat16).view(r // 128, 1, c // 128, 1)
    timed(lambda: torch.mul(tiles(w16), sb, out=tiles(out)), 4 * n, "bf16 x bf16 block scale (inexact; one dtype)")
    timed(lambda: torch.mul(tiles(w8.to(torch.bfloat16)), sv, out=tiles(out)), 7 * n, "hslake FP8 now: fp8 -> bf16, x f32 scale -> bf16")
    # INT4: [r, c/8] int32 words, scales per 32 inputs.
    packed = torch.randint(-2**31, 2**31 - 1, (r, c // 8), device=dev, dtype=torch.int32)
    gs = torch.rand(r, c // 32, device=dev) + 0.5

    def int4_now():
        b = packed.view(torch.uint8)
        codes = torch.empty(r, c // 2, 2, device=dev, dtype=torch.uint8)
        torch.bitwise_and(b, 15, out=codes[..., 0])
        torch.bitwise_right_shift(b, 4, out=codes[..., 1])
        codes = codes.view(r, c // 32, 32)
        codes.sub_(8)
        torch.mul(codes.view(torch.int8), gs.unsqueeze(-1), out=out.view(r, c // 32, 32))
    timed(int4_now, 7.5 * n, "hslake INT4 now: nibbles as bytes, -8, x f32 scale -> bf16")
    codes8 = torch.randint(-8, 8, (r, c), device=dev, dtype=torch.int8)
    timed(lambda: torch.mul(codes8.view(r, c // 32, 32), gs.unsqueeze(-1), out=out.view(r, c // 32, 32)), 3 * n,
          "  its last step alone: int8 x f32 group scale -> bf16")
    b = packed.view(torch.uint8)
    codes = torch.empty(r, c // 2, 2, device=dev, dtype=torch.uint8)
    timed(lambda: (torch.bitwise_and(b, 15, out=codes[..., 0]), torch.bitwise_right_shift(b, 4, out=codes[..., 1])),
          2 * n, "  its unpack alone (two strided byte writes)")
    # FP8 GEMM with block scales: activations quantized per 1 x 128, weights per 128 x 128.
    m = 16384
    x = torch.randn(m, c, device=dev, dtype=torch.bfloat16)
    wt = w16[:4096]
    timed(lambda: x @ wt.t(), 2 * m * c * 4096 / 1e3, "bf16 GEMM [16384 x 7168] x [7168 x 4096] (GB/s column: GFLOP/s / 1000)")
    xq = x.to(torch.float8_e4m3fn)
    wq = w8[:4096]
    # Layouts to try for 1 x 128 (activations) and 128 x 128 (weights) block scales: libtorch's
    # error names the one it wants, printed whole.
    sa = torch.ones(m, c // 128, device=dev)
    sb2 = torch.ones(4096 // 128, c // 128, device=dev)
    tries = {
        "scale_a [M, K/128] row-major, scale_b [N/128, K/128]": (sa, sb2),
        "scale_a [M, K/128] column-major, scale_b [N/128, K/128]": (sa.t().contiguous().t(), sb2),
        "scale_a column-major, scale_b transposed [K/128, N/128]": (sa.t().contiguous().t(), sb2.t()),
        "scale_a column-major, scale_b [K/128, N/128] column-major": (sa.t().contiguous().t(), sb2.t().contiguous().t()),
    }
    for label, (sa_, sb_) in tries.items():
        try:
            f = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa_, scale_b=sb_, out_dtype=torch.bfloat16)
            f()
            timed(f, 2 * m * c * 4096 / 1e3, f"_scaled_mm block scales, {label}")
        except Exception as e:  # noqa: BLE001 - a probe: report what this torch build says
            print(f"_scaled_mm, {label}: {type(e).__name__}: {str(e)}")

if __name__ == "__main__":
    main()
