"""The operations of benches/cuda_bandwidth.rs through PyTorch on the same GPU, for the ratios.

Timed as the Rust bench times them (benches/common: warm-up, then the median of 5 rounds of
back-to-back calls, one synchronisation per round) on the same data (uniform in [-1, 1)).
An argument `bandwidth`, `matmul` or `conv` runs that section only."""
import sys
import torch, torch.nn.functional as F

only = [a for a in sys.argv[1:] if not a.startswith("--")]
def section(name): return not only or name in only

def med(fn, warm=3, iters=20):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters): fn()
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3 / iters)
    ts.sort(); return ts[len(ts) // 2]

def uniform(*shape, dtype=torch.float32):
    return (torch.rand(*shape, device="cuda") * 2 - 1).to(dtype)

def loaded(lib):
    for l in open("/proc/self/maps"):
        if lib in l: return l.split()[-1]
    return lib + ": not loaded"

torch.backends.cudnn.benchmark = True
print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
if section("bandwidth"):
    n = 1 << 28
    x32 = uniform(n); y32 = uniform(n)
    x16 = x32.half(); y16 = y32.half()
    t = med(lambda: x32.clone()); cbw = 8 * n / t
    print(f"torch d2d copy f32 {t*1e3:.3f} ms {cbw/1e9:.1f} GB/s")
    for name, fn, b in [("cast f32->f16", lambda: x32.half(), 6*n), ("cast f16->f32", lambda: x16.float(), 6*n),
                        ("add f32", lambda: x32 + y32, 12*n), ("add f16", lambda: x16 + y16, 6*n),
                        ("relu f32", lambda: torch.relu(x32), 8*n), ("relu f16", lambda: torch.relu(x16), 4*n)]:
        t = med(fn); print(f"torch {name:<30} {t*1e3:8.3f} ms {b/t/1e9:8.1f} GB/s {b/t/cbw:6.3f} of copy")
    w = torch.ones(64, device="cuda"); b = torch.zeros(64, device="cuda")
    rm = torch.zeros(64, device="cuda"); rv = torch.ones(64, device="cuda")
    for dt, xx, by in [("f32", x32, 8*n), ("f16", x16, 4*n)]:
        xb = xx.view(256, 64, 128, 128)
        t = med(lambda: F.batch_norm(xb, rm, rv, w, b, training=True), 2, 10)
        print(f"torch batch_norm fwd {dt:<20} {t*1e3:8.3f} ms {by/t/1e9:8.1f} GB/s {by/t/cbw:6.3f} of copy")
    del x32, y32, x16, y16
    torch.cuda.empty_cache()
if section("matmul"):
    m = 8192
    for dt in [torch.float16, torch.bfloat16]:
        a = uniform(m, m, dtype=dt); bm = uniform(m, m, dtype=dt)
        t = med(lambda: a @ bm, 10, 20); print(f"torch matmul {dt} 8192^3 {t*1e3:.3f} ms {2*m**3/t/1e12:.1f} TFLOP/s")
    print("torch cuBLAS:", loaded("libcublas"))
if section("conv"):
    for name, (nb, ci, h, co, k, s, p) in [("layer1 3x3 64->64 56x56", (64, 64, 56, 64, 3, 1, 1)),
                                          ("layer3 3x3 256->256 14x14", (64, 256, 14, 256, 3, 1, 1)),
                                          ("conv1 7x7/2 3->64 224x224", (64, 3, 224, 64, 7, 2, 3))]:
        x = uniform(nb, ci, h, h, dtype=torch.float16).requires_grad_()
        wt = uniform(co, ci, k, k, dtype=torch.float16).requires_grad_()
        y = F.conv2d(x, wt, stride=s, padding=p); g = uniform(*y.shape, dtype=torch.float16)
        oh = y.shape[2]; fl = 2 * nb * co * oh * oh * ci * k * k
        t = med(lambda: F.conv2d(x, wt, stride=s, padding=p)); print(f"torch resnet50 {name} fwd f16 {t*1e3:.3f} ms {fl/t/1e12:.1f} TFLOP/s")
        t = med(lambda: torch.ops.aten.convolution_backward(g, x, wt, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [True, False, False]))
        print(f"torch resnet50 {name} bwd-data f16 {t*1e3:.3f} ms {fl/t/1e12:.1f} TFLOP/s")
        t = med(lambda: torch.ops.aten.convolution_backward(g, x, wt, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [False, True, False]))
        print(f"torch resnet50 {name} bwd-filter f16 {t*1e3:.3f} ms {fl/t/1e12:.1f} TFLOP/s")
