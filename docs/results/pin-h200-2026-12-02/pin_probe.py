# What pinning a capture's host buffer set costs on this machine, and whether it stalls the GPU.
import mmap, time, torch
cudart = torch.cuda.cudart()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
SET = 5 * 8 * 2048 * 7168 * 2  # one DeepSeek-V3-cut batch set: 1.17 GB
for f in ("enabled", "defrag"):
    try: print("thp", f, open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except Exception as e: print("thp", f, e)
keep = []
def register(t):
    t0 = time.time(); r = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0); dt = time.time() - t0
    assert int(r) == 0, r; keep.append(t); return dt
def huge(n):
    m = mmap.mmap(-1, n); m.madvise(mmap.MADV_HUGEPAGE); keep.append(m)
    return torch.frombuffer(m, dtype=torch.uint8)
for rep in range(2):
    t = torch.empty(SET, dtype=torch.uint8); print(f"torch.empty + register: {register(t):.3f} s")
    t = torch.empty(SET, dtype=torch.uint8); t0 = time.time(); t.fill_(0); f = time.time() - t0
    print(f"torch.empty, fill_ {f:.3f} s (torch threads {torch.get_num_threads()}), then register {register(t):.3f} s")
    t = huge(SET); print(f"mmap MADV_HUGEPAGE + register: {register(t):.3f} s")
    t = huge(SET); t0 = time.time(); t.fill_(0); f = time.time() - t0
    print(f"mmap MADV_HUGEPAGE, fill_ {f:.3f} s, then register {register(t):.3f} s")
# Does registering wait for the GPU? Queue ~1 s of matmuls, register, then synchronize.
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
def queued(n):
    for _ in range(n): a @ a
torch.cuda.synchronize(); t0 = time.time(); queued(100); torch.cuda.synchronize(); gpu = time.time() - t0
print(f"100 matmuls alone: {gpu:.3f} s")
t = torch.empty(SET, dtype=torch.uint8); t.fill_(0)
torch.cuda.synchronize(); t0 = time.time(); queued(100); q = time.time() - t0
r = register(t); t1 = time.time(); torch.cuda.synchronize(); s = time.time() - t1
print(f"queue {q:.3f} s, register {r:.3f} s while they run, then synchronize {s:.3f} s; total {time.time() - t0:.3f} s")
t = torch.empty(SET, dtype=torch.uint8); t.fill_(0)
r = register(t)
torch.cuda.synchronize(); t0 = time.time(); queued(100); q = time.time() - t0
t = torch.empty(SET, dtype=torch.uint8); t.fill_(0)
t1 = time.time(); cudart.cudaHostUnregister(keep[-1].data_ptr()); u = time.time() - t1
torch.cuda.synchronize(); print(f"unregister of a set while matmuls run: {u:.3f} s; total {time.time() - t0:.3f} s")
