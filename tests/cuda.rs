//! GPU tests: every CUDA op, forward and backward, in F32/F16/BF16, against the CPU backend on
//! fresh random inputs, with outputs poisoned (NaN-filled) before each op so that unwritten
//! elements fail. Ignored on CI (no GPU); run them on a GPU machine with
//! `scripts/gpu-stage` then `bash .gpu/run.sh cuda`.
//!
//! The error measure is ‖gpu − cpu‖ / ‖cpu‖ over all elements; any NaN/Inf where the reference
//! is finite fails.

use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::{
    set_poison_allocations, with_batch_norm_impl, BatchNormImpl, CudaStorage,
};
// The backend contract: the storage trait, each op family's trait and parameter types.
use mixprec::backend::prelude::*;
use mixprec::tensor::{random, Layout, MemoryFormat};
use mixprec::{DType, Device, Shape, Tensor};

/// The whole buffer as one contiguous dimension.
fn whole<S: BackendStorage>(s: &S) -> Layout {
    Layout::contiguous(Shape::new(vec![s.len()]))
}

/// A contiguous layout of `dims`.
fn lay(dims: &[usize]) -> Layout {
    Layout::contiguous(Shape::new(dims.to_vec()))
}

/// The buffer converted to `d` (whole).
fn cast<S: BackendStorage>(s: &S, d: DType) -> S {
    s.to_dtype(&whole(s), d).unwrap()
}

/// `s·mul + add` (whole).
fn scale<S: ElementwiseOps>(s: &S, mul: f64, add: f64) -> S {
    s.affine(&whole(s), mul, add).unwrap()
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Relative-error bound per dtype (elementwise-style ops).
fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => 1e-12,
    }
}

/// Bound for matmul/conv: f32 may go through other summation orders / algorithms (Winograd,
/// FFT), but not TF32 (~3e-4 here) or half inputs (~1e-3).
fn tol_gemm(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-4,
        other => tol(other),
    }
}

fn gpu() {
    set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU");
    // Captured by the test harness and shown only when the test fails: what replays its inputs.
    eprintln!(
        "inputs drawn from MIXPREC_TEST_SEED={} (set it to replay this test's inputs)",
        base_seed()
    );
}

/// The run's base seed: MIXPREC_TEST_SEED, else the clock at the first draw.
fn base_seed() -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BASE.get_or_init(|| {
        std::env::var("MIXPREC_TEST_SEED")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
            })
    })
}

/// A fresh seed per call, so every check draws new inputs: the base seed and the count of
/// draws so far on this test's thread (the harness runs each test on a thread of its own), so
/// a test's inputs depend on the base seed alone, not on the tests that ran beside it.
fn seed() -> u64 {
    thread_local! {
        static DRAWS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    let k = DRAWS.with(|d| {
        let k = d.get();
        d.set(k + 1);
        k
    });
    base_seed() ^ k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn randn(n: usize, d: DType) -> CpuStorage {
    let v: Vec<f32> = random::normal(seed(), n, 0.0, 1.0)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    cast(&CpuStorage::F32(v), d)
}

/// Positive inputs in [lo, hi).
fn randu(n: usize, lo: f64, hi: f64, d: DType) -> CpuStorage {
    let v: Vec<f32> = random::uniform(seed(), n, lo, hi)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    cast(&CpuStorage::F32(v), d)
}

fn randi(n: usize, below: usize) -> CpuStorage {
    CpuStorage::I64(
        random::uniform(seed(), n, 0.0, below as f64)
            .into_iter()
            .map(|x| (x as i64).min(below as i64 - 1))
            .collect(),
    )
}

fn up(c: &CpuStorage) -> CudaStorage {
    CudaStorage::from_cpu(c, 0).unwrap()
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        if w.is_finite() && !g.is_finite() {
            return f64::INFINITY;
        }
        if w.is_nan() && !g.is_nan() {
            return f64::INFINITY;
        }
        if w.is_finite() {
            num += (g - w) * (g - w);
            den += w * w;
        }
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

#[track_caller]
fn check(what: &str, got: &CudaStorage, want: &CpuStorage, bound: f64) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let g = got.to_cpu().unwrap().to_f64_vec();
    let w = want.to_f64_vec();
    let e = rel_err(&g, &w);
    assert!(e <= bound, "{what}: relative error {e:e} > {bound:e}");
}

#[track_caller]
fn check_exact(what: &str, got: &CudaStorage, want: &CpuStorage) {
    assert_eq!(&got.to_cpu().unwrap(), want, "{what}");
}

// ---- device, fallback ---------------------------------------------------------------------

/// Runs everywhere (CI included): `Device::cuda` answers with an error, never a panic, and the
/// fallback agrees with it.
#[test]
fn cuda_device_is_an_error_or_a_device_never_a_panic() {
    let r = Device::cuda(0);
    let fallback = Device::cuda_if_available(0);
    match r {
        Ok(d) => assert_eq!(fallback, d),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("Device::cuda(0) here: {msg}");
            assert!(msg.starts_with("cuda:"), "{msg}");
            // One short line: the library file names searched are logged at debug level only
            // (they made a 400-character warning on every CPU run).
            assert!(
                msg.len() < 300 && !msg.contains(".so") && !msg.contains('\n'),
                "{msg}"
            );
            assert_eq!(fallback, Device::Cpu);
            // A device that does not exist is an error too.
            assert!(Device::cuda(1 << 20).is_err());
        }
    }
    if std::env::var_os("MIXPREC_TEST_CUDA").is_none()
        && !std::path::Path::new("/dev/nvidia0").exists()
    {
        assert!(
            Device::cuda(0).is_err(),
            "no GPU here, yet Device::cuda(0) succeeded"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_if_available_finds_the_gpu_and_rejects_a_missing_ordinal() {
    assert_eq!(Device::cuda_if_available(0), Device::Cuda(0));
    assert_eq!(Device::cuda_if_available(4096), Device::Cpu);
    let e = Device::cuda(4096).unwrap_err().to_string();
    assert!(e.contains("no CUDA device 4096"), "{e}");
}

/// A read check (what a process group registers once an abort has cut a collective short)
/// refuses the host reads of the device while it lives, with its error; dropped, it refuses
/// nothing. This one refuses only this thread's reads: the other tests share the device.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_read_check_refuses_host_reads_while_it_lives() {
    gpu();
    let dev = mixprec::backend::cuda::device(0).unwrap();
    let t = Tensor::ones([3], DType::F32, Device::Cuda(0)).unwrap();
    let me = std::thread::current().id();
    let check: std::sync::Arc<mixprec::backend::cuda::ReadCheck> = std::sync::Arc::new(move || {
        if std::thread::current().id() == me {
            Err(mixprec::Error::Cuda("the test's check refuses".into()))
        } else {
            Ok(())
        }
    });
    dev.add_read_check(&check);
    let e = t.to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("the test's check refuses"), "{e}");
    let one = Tensor::ones([1], DType::F32, Device::Cuda(0)).unwrap();
    let e = one.item().unwrap_err().to_string();
    assert!(e.contains("the test's check refuses"), "{e}");
    drop(check);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0; 3]);
    assert_eq!(one.item().unwrap(), 1.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_kernel_family_compiles() {
    gpu();
    let dev = mixprec::backend::cuda::device(0).unwrap();
    if let Err(e) = dev.compile_all() {
        panic!("{e}");
    }
    // With MIXPREC_KERNEL_CACHE set (as the GPU run does), the cubins are on disk for next time.
    if let Some(dir) = std::env::var_os("MIXPREC_KERNEL_CACHE") {
        let files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cubin"))
            .collect();
        for fam in [
            "cast",
            "elementwise",
            "reduce",
            "index",
            "layout",
            "softmax",
            "batch_norm",
            "pool",
        ] {
            assert!(
                files.iter().any(|f| f.starts_with(&format!("{fam}-sm"))),
                "no cached cubin for {fam} in {files:?}"
            );
        }
    }
}

/// After `compile_all` (what the trainer runs before its first timed step), the first AMP steps
/// of a ResNet and of a GPT load no kernel module: every family is there, and nothing reaches the
/// driver some other way inside a step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn after_compile_all_the_first_step_loads_no_kernel() {
    use mixprec::nn::{self, Gpt, GptConfig, Module};
    use mixprec::optim::{AdamConfig, FusedAdam, FusedSgd, SgdConfig};
    gpu();
    let dev = mixprec::backend::cuda::device(0).unwrap();
    let before = dev.module_loads();
    let loaded = dev.compile_all().unwrap();
    let families = mixprec::backend::cuda::kernel_families().len();
    assert_eq!(dev.module_loads(), families, "every family loaded");
    assert_eq!(
        loaded,
        families - before,
        "compile_all reports what it loaded"
    );
    assert_eq!(dev.compile_all().unwrap(), 0, "a second call loads nothing");

    let cuda = Device::Cuda(0);
    let policy = || mixprec::amp::Policy::builtin("O2").unwrap();
    let model = nn::resnet::ResNet::cifar_style(&[1, 1, 1, 1], 1, 10, &cuda).unwrap();
    let opt = FusedSgd::new(model.parameters(), SgdConfig::default()).unwrap();
    let (model, mut opt) = mixprec::amp::initialize(model, opt, policy()).unwrap();
    let x = Tensor::randn(vec![4, 1, 28, 28], 0.0, 1.0, 1, DType::F32, cuda).unwrap();
    let y = Tensor::from_vec(vec![0i64, 3, 7, 9], vec![4], cuda).unwrap();
    let loss = nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    opt.zero_grad().unwrap();
    opt.backward(&loss).unwrap();
    opt.step().unwrap();

    let gpt = Gpt::new(GptConfig::named("tiny").unwrap(), 0, &cuda).unwrap();
    let opt = FusedAdam::new(gpt.parameters(), AdamConfig::default()).unwrap();
    let (gpt, mut opt) = mixprec::amp::initialize(gpt, opt, policy()).unwrap();
    let ids = Tensor::from_vec(
        (0..2 * 32).map(|i| i % 97).collect::<Vec<i64>>(),
        vec![2, 32],
        cuda,
    )
    .unwrap();
    let loss = gpt.scope(|m| m.loss(&ids, &ids)).unwrap();
    opt.zero_grad().unwrap();
    opt.backward(&loss).unwrap();
    opt.step().unwrap();
    assert!(loss.item().unwrap().is_finite());
    assert_eq!(
        dev.module_loads(),
        families,
        "a kernel module was loaded inside the first steps, after compile_all"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trip_and_fill() {
    gpu();
    for d in [DType::F16, DType::BF16, DType::F32, DType::F64, DType::I64] {
        for n in [0, 1, 7, 4099] {
            let c = cast(
                &CpuStorage::F32((0..n).map(|i| i as f32 * 0.37 - 5.0).collect()),
                d,
            );
            check_exact(&format!("round trip {d} {n}"), &up(&c), &c);
            let f = CudaStorage::full(0, d, n, 0.3).unwrap();
            check_exact(
                &format!("full {d} {n}"),
                &f,
                &CpuStorage::full(d, n, 0.3).unwrap(),
            );
        }
    }
}

// ---- cast ---------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn cast_every_pair() {
    gpu();
    let all = [DType::F16, DType::BF16, DType::F32, DType::F64, DType::I64];
    for &src in &all {
        for &dst in &all {
            for n in [5, 1 << 20 | 3] {
                let x = if src == DType::I64 {
                    randi(n, 1000)
                } else {
                    let v = randn(n, DType::F32);
                    // Spread values over a wide range so i64 truncation is exercised.
                    cast(&scale(&v, 100.0, 0.0), src)
                };
                let want = cast(&x, dst);
                let got = cast(&up(&x), dst);
                // Single-rounding paths are bit-exact; f64 → bf16 may double-round by one ulp.
                check(
                    &format!("cast {src}->{dst} n={n}"),
                    &got,
                    &want,
                    tol(dst).min(1e-2) * 0.5,
                );
            }
        }
    }
}

// ---- elementwise --------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn unary_affine_powf() {
    gpu();
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Relu,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Sqr,
        UnaryOp::Abs,
    ];
    for d in DTYPES {
        for n in [1, 13, 1_000_003] {
            for op in ops {
                let x = match op {
                    UnaryOp::Log | UnaryOp::Sqrt => randu(n, 0.1, 4.0, d),
                    _ => randn(n, d),
                };
                let got = up(&x).unary(&whole(&x), op).unwrap();
                check(
                    &format!("{} {d} n={n}", op.name()),
                    &got,
                    &x.unary(&whole(&x), op).unwrap(),
                    tol(d),
                );
            }
            let x = randn(n, d);
            check(
                &format!("affine {d}"),
                &scale(&up(&x), 0.75, -1.25),
                &scale(&x, 0.75, -1.25),
                tol(d),
            );
            let x = randu(n, 0.1, 3.0, d);
            for e in [2.5, -1.5, 0.5] {
                check(
                    &format!("powf {e} {d}"),
                    &up(&x).powf(&whole(&x), e).unwrap(),
                    &x.powf(&whole(&x), e).unwrap(),
                    tol(d) * 4.0,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn binary_same_shape_and_broadcast() {
    gpu();
    let ops = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
    ];
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![1_000_003], vec![1_000_003]),
        (vec![3, 5], vec![3, 5]),
        (vec![4, 1, 5], vec![3, 1]),
        (vec![2, 3], vec![]),
        (vec![], vec![7]),
        (vec![8, 16, 9, 9], vec![16, 1, 1]),
        (vec![2, 1, 3, 1, 2, 1, 2], vec![2, 1, 3, 1, 2, 1]),
        // A bias over rows (the row-vector kernel) and the same with the operands swapped.
        (vec![64, 300], vec![300]),
        (vec![2, 7, 33], vec![33]),
        (vec![300], vec![64, 300]),
    ];
    for d in DTYPES {
        for (sa, sb) in &cases {
            let (sa, sb) = (Shape::new(sa.clone()), Shape::new(sb.clone()));
            let out = sa.broadcast_with("test", &sb).unwrap();
            let a = randn(sa.elem_count(), d);
            // Keep divisors away from zero.
            let b = randu(sb.elem_count(), 0.5, 2.0, d);
            let (la, lb) = (
                Layout::contiguous(sa.clone()).expand(&out),
                Layout::contiguous(sb.clone()).expand(&out),
            );
            let lo = Layout::contiguous(out.clone());
            for op in ops {
                let want = a.binary(&la, &b, &lb, op, &lo).unwrap();
                let got = up(&a).binary(&la, &up(&b), &lb, op, &lo).unwrap();
                check(
                    &format!("{} {d} {sa:?} {sb:?}", op.name()),
                    &got,
                    &want,
                    tol(d),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn relu_backward_and_broadcast_to() {
    gpu();
    for d in DTYPES {
        let n = 100_003;
        let (g, x) = (randn(n, d), randn(n, d));
        check(
            &format!("relu_backward {d}"),
            &up(&g)
                .relu_backward(&whole(&g), &up(&x), &whole(&x))
                .unwrap(),
            &g.relu_backward(&whole(&g), &x, &whole(&x)).unwrap(),
            tol(d),
        );
        for (s, t) in [
            (vec![3, 1], vec![2, 3, 4]),
            (vec![], vec![5]),
            (vec![1, 4], vec![6, 4]),
        ] {
            let (s, t) = (Shape::new(s), Shape::new(t));
            let x = randn(s.elem_count(), d);
            let (src, dst) = (Layout::contiguous(s).expand(&t), Layout::contiguous(t));
            check_exact(
                &format!("broadcast (strided copy) {d}"),
                &up(&x).copy_strided(&src, &dst).unwrap(),
                &x.copy_strided(&src, &dst).unwrap(),
            );
        }
    }
}

// ---- reductions, index --------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn reduce_sum_max_min() {
    gpu();
    let splits = [
        // Few long rows (a whole tensor's sum): chunks of a row, their partials folded after;
        // three rows with a short last chunk.
        (1, 1_000_000, 1),
        (3, 200_003, 1),
        (64, 1000, 1),
        (8, 100, 37),
        (3, 1, 5),
        (1, 7, 1),
        (2, 5000, 300),
        // A bias gradient (few long lanes: a block per lane).
        (1, 128, 10),
        // A transformer's bias gradients (many long lanes: tiles of 32 lanes by row chunks, the
        // chunks' partials folded in a second pass), one with a short last chunk and tile.
        (1, 16384, 768),
        (4, 1000, 150),
    ];
    for d in DTYPES {
        for split in splits {
            let x = randn(split.0 * split.1 * split.2, d);
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let l = lay(&[split.0, split.1, split.2]);
                let want = x.reduce(&l, op, 1).unwrap();
                let got = up(&x).reduce(&l, op, 1).unwrap();
                // Sums of n normals: the f32 accumulation order differs, the rounding once.
                // (The CPU's sequential f32 sum of 10^6 terms is itself off by ~1e-5.)
                let b = if op == ReduceOp::Sum {
                    tol(d).max(1e-4)
                } else {
                    0.0
                };
                check(&format!("reduce {op:?} {d} {split:?}"), &got, &want, b);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn argmax_first_maximum() {
    gpu();
    for d in DTYPES {
        for split in [(64, 1000, 1), (8, 10, 37), (1, 100_000, 1)] {
            let x = randn(split.0 * split.1 * split.2, d);
            let l = lay(&[split.0, split.1, split.2]);
            let got = up(&x).argmax(&l, 1).unwrap().to_cpu().unwrap();
            let want = x.argmax(&l, 1).unwrap();
            if d == DType::F32 {
                assert_eq!(got, want, "argmax {d} {split:?}");
            } else {
                // Half types tie more often: the values at the chosen positions must agree.
                let (gi, wi) = (got.to_f64_vec(), want.to_f64_vec());
                let xv = x.to_f64_vec();
                let (_, len, inner) = split;
                for k in 0..gi.len() {
                    let (o, i) = (k / inner, k % inner);
                    let at = |j: f64| xv[(o * len + j as usize) * inner + i];
                    assert_eq!(at(gi[k]), at(wi[k]), "argmax {d} {split:?} lane {k}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gather_and_scatter_add() {
    gpu();
    for d in DTYPES {
        for (outer, len, inner, idx_len) in [(128, 10, 1, 1), (4, 7, 33, 11), (2, 3, 1000, 50)] {
            let x = randn(outer * len * inner, d);
            let idx = randi(outer * idx_len * inner, len);
            let (lx, li) = (lay(&[outer, len, inner]), lay(&[outer, idx_len, inner]));
            check_exact(
                &format!("gather {d}"),
                &up(&x).gather(&lx, &up(&idx), &li, 1).unwrap(),
                &x.gather(&lx, &idx, &li, 1).unwrap(),
            );
            let g = randn(outer * idx_len * inner, d);
            let out = Shape::new(vec![outer, len, inner]);
            check(
                &format!("scatter_add {d}"),
                &up(&g).scatter_add(&li, &up(&idx), &li, 1, &out).unwrap(),
                &g.scatter_add(&li, &idx, &li, 1, &out).unwrap(),
                tol(d),
            );
        }
        // Out-of-range indices are an error, not a crash: reported at the next read from the
        // device (index ops themselves never synchronise), and only once.
        let x = randn(20, d);
        let (lx, li) = (lay(&[2, 10, 1]), lay(&[2, 2, 1]));
        let bad = CpuStorage::I64(vec![0, 3, 10, 1]);
        let y = up(&x).gather(&lx, &up(&bad), &li, 1).unwrap();
        assert!(y.to_cpu().is_err());
        assert!(y.to_cpu().is_ok(), "the flag is cleared once reported");
        let g = randn(4, d);
        let y = up(&g)
            .scatter_add(&li, &up(&bad), &li, 1, &Shape::new(vec![2, 10, 1]))
            .unwrap();
        assert!(y.to_cpu().is_err());
        let neg = CpuStorage::I64(vec![0, -1, 2, 1]);
        let y = up(&x).gather(&lx, &up(&neg), &li, 1).unwrap();
        assert!(y.to_cpu().is_err());
        let good = CpuStorage::I64(vec![0, 3, 9, 1]);
        assert!(up(&x)
            .gather(&lx, &up(&good), &li, 1)
            .unwrap()
            .to_cpu()
            .is_ok());
    }
    // i64 gathers too (labels).
    let x = randi(50, 1000);
    let idx = randi(20, 10);
    check_exact(
        "gather i64",
        &up(&x)
            .gather(&lay(&[5, 10, 1]), &up(&idx), &lay(&[5, 4, 1]), 1)
            .unwrap(),
        &x.gather(&lay(&[5, 10, 1]), &idx, &lay(&[5, 4, 1]), 1)
            .unwrap(),
    );
}

/// The strided kernels' 16-byte-pack paths (an attention head's `[B, H, T, D]` view of a
/// `[B, T, H, D]` projection, a broadcast scalar gradient) and their fallbacks (an inner dim
/// that is no multiple of a pack, a start that is not 16-byte aligned), against the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn strided_kernels_in_packs() {
    gpu();
    for d in DTYPES {
        for inner in [64, 24, 12] {
            let bthd = Shape::new(vec![2, 9, 3, inner]);
            let x = randn(bthd.elem_count() + 1, d);
            let y = randn(bthd.elem_count(), d);
            for start in [0, 1] {
                // A head view of the projection (from element `start`) against a row-major
                // operand, either way round.
                let heads = Layout::contiguous(Shape::new(vec![bthd.elem_count()]))
                    .narrow(0, start, bthd.elem_count())
                    .reshape(&bthd)
                    .unwrap()
                    .permute(&[0, 2, 1, 3]);
                let out = Layout::contiguous(heads.shape().clone());
                for (what, la, lb, a, b) in [
                    ("view · row-major", &heads, &out, &x, &y),
                    ("row-major · view", &out, &heads, &y, &x),
                ] {
                    let want = a.binary(la, b, lb, BinaryOp::Mul, &out).unwrap();
                    let got = up(a).binary(la, &up(b), lb, BinaryOp::Mul, &out).unwrap();
                    check(
                        &format!("{what} {d} inner {inner} start {start}"),
                        &got,
                        &want,
                        tol(d),
                    );
                }
                check_exact(
                    &format!("head view to row-major {d} inner {inner} start {start}"),
                    &up(&x).copy_strided(&heads, &out).unwrap(),
                    &x.copy_strided(&heads, &out).unwrap(),
                );
            }
            // A scalar broadcast over a row-major tensor: as an operand, and materialised.
            let out = Layout::contiguous(bthd.clone());
            let one = Layout::contiguous(Shape::scalar()).expand(&bthd);
            let g = randn(1, d);
            let want = g.binary(&one, &y, &out, BinaryOp::Mul, &out).unwrap();
            let got = up(&g)
                .binary(&one, &up(&y), &out, BinaryOp::Mul, &out)
                .unwrap();
            check(
                &format!("scalar · row-major {d} inner {inner}"),
                &got,
                &want,
                tol(d),
            );
            check_exact(
                &format!("scalar broadcast materialised {d} inner {inner}"),
                &up(&g).copy_strided(&one, &out).unwrap(),
                &g.copy_strided(&one, &out).unwrap(),
            );
        }
    }
}

// ---- layout -------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn strided_copies_and_cat() {
    gpu();
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64] {
        let mk = |n: usize| {
            if d == DType::I64 {
                randi(n, 1 << 20)
            } else {
                randn(n, d)
            }
        };
        for (dims, perm) in [
            (vec![2, 3, 4], vec![2, 0, 1]),
            (vec![16, 32, 7, 5], vec![0, 2, 3, 1]),
            (vec![5], vec![0]),
            (vec![64, 129], vec![1, 0]),
        ] {
            let s = Shape::new(dims);
            let x = mk(s.elem_count());
            // A permuted view copied to row-major, and row-major copied into a permuted order.
            let src = Layout::contiguous(s.clone()).permute(&perm);
            let dst = Layout::contiguous(src.shape().clone());
            check_exact(
                &format!("permute {d} {s:?} {perm:?}"),
                &up(&x).copy_strided(&src, &dst).unwrap(),
                &x.copy_strided(&src, &dst).unwrap(),
            );
            let scattered = Layout::contiguous(s.clone()).permute(&perm).dense_like();
            check_exact(
                &format!("copy into permuted order {d} {s:?} {perm:?}"),
                &up(&x).copy_strided(&dst, &scattered).unwrap(),
                &x.copy_strided(&dst, &scattered).unwrap(),
            );
        }
        let x = mk(6 * 10 * 7);
        for (start, count) in [(0, 10), (3, 4), (9, 1), (5, 0)] {
            let src = lay(&[6, 10, 7]).narrow(1, start, count);
            let dst = lay(&[6, count, 7]);
            check_exact(
                &format!("narrow {d} {start} {count}"),
                &up(&x).copy_strided(&src, &dst).unwrap(),
                &x.copy_strided(&src, &dst).unwrap(),
            );
        }
        // NCHW <-> NHWC.
        let s = Shape::new(vec![3, 5, 4, 6]);
        let x = mk(s.elem_count());
        let (c, cl) = (
            Layout::contiguous(s.clone()),
            Layout::with_format(s.clone(), MemoryFormat::ChannelsLast),
        );
        check_exact(
            &format!("to channels_last {d}"),
            &up(&x).copy_strided(&c, &cl).unwrap(),
            &x.copy_strided(&c, &cl).unwrap(),
        );
        check_exact(
            &format!("from channels_last {d}"),
            &up(&x).copy_strided(&cl, &c).unwrap(),
            &x.copy_strided(&cl, &c).unwrap(),
        );
        let lens = [3usize, 1, 5];
        let parts: Vec<CpuStorage> = lens.iter().map(|&l| mk(4 * l * 9)).collect();
        let gparts: Vec<CudaStorage> = parts.iter().map(up).collect();
        let layouts: Vec<Layout> = lens.iter().map(|&l| lay(&[4, l, 9])).collect();
        let cref: Vec<(&CpuStorage, &Layout)> = parts.iter().zip(&layouts).collect();
        let gref: Vec<(&CudaStorage, &Layout)> = gparts.iter().zip(&layouts).collect();
        check_exact(
            &format!("cat {d}"),
            &CudaStorage::cat(&gref, 1).unwrap(),
            &CpuStorage::cat(&cref, 1).unwrap(),
        );
    }
}

// ---- matmul -------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_all_layouts() {
    gpu();
    for d in DTYPES {
        for &(batch, m, n, k) in &[
            (1, 64, 48, 32),
            (3, 17, 9, 33),
            (2, 128, 256, 512),
            (1, 1, 1, 1),
            (2, 5, 7, 0),
        ] {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    for bcast_b in [false, true] {
                        let dims = MatmulDims {
                            batch,
                            m,
                            n,
                            k,
                            trans_a,
                            trans_b,
                            a_batch_stride: m * k,
                            b_batch_stride: if bcast_b { 0 } else { k * n },
                        };
                        let a = randn(batch * m * k, d);
                        let b = randn(if bcast_b { k * n } else { batch * k * n }, d);
                        let want = a.matmul(&whole(&a), &b, &whole(&b), &dims).unwrap();
                        let got = up(&a)
                            .matmul(&whole(&a), &up(&b), &whole(&b), &dims)
                            .unwrap();
                        check(&format!("matmul {d} {dims:?}"), &got, &want, tol_gemm(d));
                    }
                }
            }
        }
    }
}

// The TF32 switch is process-global, so its test lives in its own binary (tests/cuda_tf32.rs):
// toggled here, it would put the f32 precision checks running beside it on TF32.

// ---- softmax ------------------------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU"]
fn softmax_and_log_softmax_fwd_bwd() {
    gpu();
    for d in DTYPES {
        for split in [(256, 10, 1), (4, 5000, 1), (8, 33, 17), (1, 1, 1)] {
            let n = split.0 * split.1 * split.2;
            let x = scale(&randn(n, d), 3.0, 0.0);
            let l = lay(&[split.0, split.1, split.2]);
            for log in [false, true] {
                let y = x.softmax(&l, 1, log).unwrap();
                let gy = up(&x).softmax(&l, 1, log).unwrap();
                check(&format!("softmax log={log} {d} {split:?}"), &gy, &y, tol(d));
                let g = randn(n, d);
                // Feed the same y to both so only the backward kernel is compared.
                let want = g.softmax_backward(&l, &y, &l, 1, log).unwrap();
                let got = up(&g).softmax_backward(&l, &up(&y), &l, 1, log).unwrap();
                check(
                    &format!("softmax_backward log={log} {d} {split:?}"),
                    &got,
                    &want,
                    tol(d) * 2.0,
                );
            }
        }
    }
}

// ---- batch norm, pooling, conv -----------------------------------------------------------------

fn f32s(c: &CpuStorage) -> CpuStorage {
    cast(c, DType::F32)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_train_and_backward() {
    gpu();
    for d in DTYPES {
        // (Not 2 values per channel: there dx is eps-sized cancellation, no test of anything.)
        // bn_fwd's geometry (on a 132-SM H100/H200): one block per channel; 4 blocks per channel;
        // teams taking several channels one after the other, with 1 and 2 blocks each (a mean of
        // 30 against a spread of 0.5 in the second); channels of 20 MB (f32) whose slices fill
        // most of each block's ring, so that the next channel waits for ring space; a 32 MB f32
        // channel, larger than all shared memory, in 16-byte units and in single values (the
        // excess re-read from L2 by the writers).
        let shapes = [
            (8, 16, 49, 0.5),
            (6, 3, 1, 0.5),
            (32, 4, 1024, 0.5),
            (16, 300, 64, 0.5),
            (8, 80, 4096, 30.0),
            (2, 2, 2_500_000, 0.5),
            (2, 2, 2_500_001, 0.5),
            (2, 1, 4_000_000, 0.5),
            (2, 1, 4_000_001, 0.5),
        ];
        for (n, c, spatial, shift) in shapes {
            let p = BatchNormParams {
                n,
                c,
                spatial,
                eps: 1e-5,
                momentum: 0.1,
                format: MemoryFormat::Contiguous,
                residual: false,
                relu: false,
            };
            let spread = if shift > 1.0 { 0.5 } else { 2.0 };
            let x = scale(&randn(n * c * spatial, d), spread, shift);
            let l = lay(&[n, c, spatial]);
            let (w, b) = (f32s(&randn(c, DType::F32)), f32s(&randn(c, DType::F32)));
            let (rm_in, rv_in) = (randn(c, DType::F32), randu(c, 0.5, 2.0, DType::F32));
            let (mut rm, mut rv) = (rm_in.clone(), rv_in.clone());
            let (mut grm, mut grv) = (up(&rm), up(&rv));
            let (y, saved) = x
                .batch_norm_train(
                    &l,
                    BatchNormTrainOperands {
                        residual: None,
                        weight: &w,
                        bias: &b,
                        running_mean: &mut rm,
                        running_var: &mut rv,
                    },
                    &p,
                )
                .unwrap();
            let (mean, invstd) = (saved.mean, saved.invstd);
            let (gy, gsaved) = up(&x)
                .batch_norm_train(
                    &l,
                    BatchNormTrainOperands {
                        residual: None,
                        weight: &up(&w),
                        bias: &up(&b),
                        running_mean: &mut grm,
                        running_var: &mut grv,
                    },
                    &p,
                )
                .unwrap();
            let (gmean, ginvstd) = (gsaved.mean, gsaved.invstd);
            let what = format!("batch_norm {d} {n}x{c}x{spatial}");
            // The blocks of a channel wait for each other: a race would move the result.
            let (mut grm2, mut grv2) = (up(&rm_in), up(&rv_in));
            let (gy2, gsaved2) = up(&x)
                .batch_norm_train(
                    &l,
                    BatchNormTrainOperands {
                        residual: None,
                        weight: &up(&w),
                        bias: &up(&b),
                        running_mean: &mut grm2,
                        running_var: &mut grv2,
                    },
                    &p,
                )
                .unwrap();
            let gmean2 = gsaved2.mean;
            check_exact(&format!("{what} y, run twice"), &gy2, &gy.to_cpu().unwrap());
            check_exact(
                &format!("{what} mean, run twice"),
                &gmean2,
                &gmean.to_cpu().unwrap(),
            );
            check(&format!("{what} y"), &gy, &y, tol(d) * 2.0);
            check(&format!("{what} mean"), &gmean, &mean, 1e-4);
            check(&format!("{what} invstd"), &ginvstd, &invstd, 1e-4);
            check(&format!("{what} running_mean"), &grm, &rm, 1e-4);
            check(&format!("{what} running_var"), &grv, &rv, 1e-4);
            let g = randn(n * c * spatial, d);
            let r = g
                .batch_norm_backward(
                    &l,
                    BatchNormBackwardOperands {
                        x: (&x, &l),
                        y: None,
                        weight: &w,
                        bias: &b,
                        saved: saved_of(&mean, &invstd),
                    },
                    &p,
                )
                .unwrap();
            let (gm, gs) = (up(&mean), up(&invstd));
            let gr = up(&g)
                .batch_norm_backward(
                    &l,
                    BatchNormBackwardOperands {
                        x: (&up(&x), &l),
                        y: None,
                        weight: &up(&w),
                        bias: &up(&b),
                        saved: saved_of(&gm, &gs),
                    },
                    &p,
                )
                .unwrap();
            check(&format!("{what} dx"), &gr.input, &r.input, tol(d) * 4.0);
            // dw = Σ g·x̂ and db = Σ g per channel are sums of millions of terms of both signs:
            // measured against the sum of the terms' magnitudes (what f32 rounding scales with),
            // since the sum itself may by chance lie near 0 (a norm-wise 1e-4 failed on bf16
            // 2x1x4000001, with both sides f32-accurate).
            let (xs, gs) = (x.to_f64_vec(), g.to_f64_vec());
            let (ms, is) = (mean.to_f64_vec(), invstd.to_f64_vec());
            let mut mag_w = vec![0.0; c];
            let mut mag_b = vec![0.0; c];
            for (k, (&xv, &gv)) in xs.iter().zip(&gs).enumerate() {
                let ch = (k / spatial) % c;
                mag_w[ch] += (gv * (xv - ms[ch]) * is[ch]).abs();
                mag_b[ch] += gv.abs();
            }
            check_sums(&format!("{what} dw"), &gr.weight, &r.weight, &mag_w, 1e-6);
            check_sums(&format!("{what} db"), &gr.bias, &r.bias, &mag_b, 1e-6);
        }
    }
}

/// Per channel, `|got − want|` at most `bound` times `magnitude` (the sum of the magnitudes of
/// the terms that channel's value sums).
#[track_caller]
fn check_sums(what: &str, got: &CudaStorage, want: &CpuStorage, magnitude: &[f64], bound: f64) {
    let g = got.to_cpu().unwrap().to_f64_vec();
    let w = want.to_f64_vec();
    for (ch, ((a, b), m)) in g.iter().zip(&w).zip(magnitude).enumerate() {
        let e = (a - b).abs() / m.max(f64::MIN_POSITIVE);
        assert!(
            e <= bound,
            "{what} channel {ch}: |{a} - {b}| is {e:e} of the terms' magnitude {m} (bound {bound:e})"
        );
    }
}

/// Where cuDNN's ReLU mask may lawfully differ from the CPU's in a batch norm fused with a ReLU,
/// and by how much each gradient may then stand from the CPU's. cuDNN masks the gradient by the
/// sign of the pre-activation it computes, the CPU (and our kernels) by the stored output, so an
/// element whose output is 0 from a value within FP32 reach of 0 may pass its gradient on one
/// side only. Such ties are rare (about one per run on the largest cases); each moves dw by its
/// `g·x̂`, db by its `g`, its own dx by `w·invstd·g`, and every dx of its channel by
/// `w·invstd/m·(g + x̂_j·g·x̂)` (dx = w·invstd/m·(m·g' − Σg' − x̂·Σg'x̂) is linear in g').
struct ReluTies {
    /// Per element (NCHW): whether it is a tie.
    tie: Vec<bool>,
    /// Per channel: Σ|g·x̂| and Σ|g| over its ties (dw's and db's slack).
    dw: Vec<f64>,
    db: Vec<f64>,
}

/// One batch norm's input, parameters and statistics (NCHW, as f64): what the tie analysis reads.
struct BnCase<'a> {
    shape: (usize, usize, usize),
    x: &'a [f64],
    residual: Option<&'a [f64]>,
    w: &'a [f64],
    b: &'a [f64],
    mean: &'a [f64],
    invstd: &'a [f64],
}

impl BnCase<'_> {
    fn xhat(&self, k: usize) -> (usize, f64) {
        let (_, c, sp) = self.shape;
        let ch = (k / sp) % c;
        (ch, (self.x[k] - self.mean[ch]) * self.invstd[ch])
    }

    /// The ties of output `y` under output gradient `g`.
    fn relu_ties(&self, y: &[f64], g: &[f64]) -> ReluTies {
        // cuDNN's pre-activation is FP32 arithmetic on O(1) operands: its sign can differ from
        // the exact one only within a few FP32 ulps of 0.
        const BAND: f64 = 1e-5;
        let (n, c, sp) = self.shape;
        let mut t = ReluTies {
            tie: vec![false; n * c * sp],
            dw: vec![0.0; c],
            db: vec![0.0; c],
        };
        for k in 0..n * c * sp {
            if y[k] != 0.0 {
                continue;
            }
            let (ch, xhat) = self.xhat(k);
            let z = xhat * self.w[ch] + self.b[ch] + self.residual.map_or(0.0, |r| r[k]);
            if z > -BAND {
                t.tie[k] = true;
                t.dw[ch] += (g[k] * xhat).abs();
                t.db[ch] += g[k].abs();
            }
        }
        t
    }

    /// Each dx element's slack under `ties` (all 0 without ties).
    fn dx_slack(&self, ties: &ReluTies, g: &[f64]) -> Vec<f64> {
        let (n, _, sp) = self.shape;
        let m = (n * sp) as f64;
        (0..g.len())
            .map(|k| {
                let (ch, xhat) = self.xhat(k);
                let k0 = (self.w[ch] * self.invstd[ch]).abs();
                let own = if ties.tie[k] { k0 * g[k].abs() } else { 0.0 };
                own + k0 / m * (ties.db[ch] + xhat.abs() * ties.dw[ch])
            })
            .collect()
    }
}

/// [`rel_err`] after taking each element's allowed `slack` off its difference.
fn rel_err_beyond(got: &[f64], want: &[f64], slack: &[f64]) -> f64 {
    let shrunk: Vec<f64> = got
        .iter()
        .zip(want)
        .zip(slack)
        .map(|((&g, &w), &s)| {
            let d = g - w;
            w + d.signum() * (d.abs() - s).max(0.0)
        })
        .collect();
    rel_err(&shrunk, want)
}

/// Saved statistics with no reserve space (our kernels' backward).
fn saved_of<'a, S>(mean: &'a S, invstd: &'a S) -> BatchNormSaved<&'a S> {
    BatchNormSaved {
        mean,
        invstd,
        reserve: None,
    }
}

/// `[n, c, sp]` stored NHWC (`[n, sp, c]` in memory): the layout the channels_last kernels take.
fn nhwc(n: usize, c: usize, sp: usize) -> Layout {
    Layout::new(Shape::new(vec![n, c, sp]), vec![sp * c, 1, c], 0)
}

/// The fused batch norm (residual add, ReLU) and the channels_last one, forward and backward,
/// against the CPU's NCHW reference: the GPU gets the same logical values in its format, and its
/// results are brought back to NCHW before the comparison. Run with our kernels, then with
/// cuDNN's wherever it covers the case (channels_last).
#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_fused_and_channels_last() {
    gpu();
    with_batch_norm_impl(BatchNormImpl::Own, || {
        batch_norm_fused_cases(BatchNormImpl::Own)
    });
    let ran = with_batch_norm_impl(BatchNormImpl::Cudnn, || {
        batch_norm_fused_cases(BatchNormImpl::Cudnn)
    });
    println!("cuDNN ran: {ran:?}");
    // ResNet's batch norms in half precision, each epilogue: cuDNN must have run them, or this
    // test would test our kernels twice.
    for epi in ["plain", "relu", "add_relu"] {
        let case = format!("f16 64x64x3136 {epi}");
        assert!(
            ran.contains(&case),
            "cuDNN did not run {case}; it ran {ran:?}"
        );
    }
}

/// One pass of [`batch_norm_fused_and_channels_last`] under `imp`: the cases that ran on cuDNN
/// (from the reserve space the forward returned), as "dtype NxCxS epilogue".
fn batch_norm_fused_cases(imp: BatchNormImpl) -> Vec<String> {
    let mut on_cudnn = Vec::new();
    for d in DTYPES {
        // Channel counts that take 16-byte packs (64, 256) and that do not (3, 20, 1000 in f32).
        let shapes = [
            (8, 64, 49),
            (4, 3, 100),
            (32, 256, 196),
            (2, 20, 7),
            (3, 1000, 9),
            (64, 64, 3136),
        ];
        for (n, c, sp) in shapes {
            for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
                for (residual, relu) in [(false, false), (false, true), (true, true)] {
                    if format == MemoryFormat::Contiguous && !residual && !relu {
                        continue; // the single-pass kernel, tested above
                    }
                    let p = BatchNormParams {
                        n,
                        c,
                        spatial: sp,
                        eps: 1e-5,
                        momentum: 0.1,
                        format: MemoryFormat::Contiguous,
                        residual,
                        relu,
                    };
                    let gp = BatchNormParams { format, ..p };
                    let what = format!(
                        "batch_norm {d} {n}x{c}x{sp} {} res={residual} relu={relu}",
                        format.name()
                    );
                    let cl = lay(&[n, c, sp]);
                    let gl = match format {
                        MemoryFormat::ChannelsLast => nhwc(n, c, sp),
                        MemoryFormat::Contiguous => cl.clone(),
                    };
                    // CPU values (NCHW) and their GPU copies in the GPU's format.
                    let to_gpu = |v: &CpuStorage| up(&v.copy_strided(&cl, &gl).unwrap());
                    let to_nchw = |v: &CudaStorage| {
                        let h = v.to_cpu().unwrap();
                        let back =
                            Layout::new(Shape::new(vec![n, c, sp]), gl.strides().to_vec(), 0);
                        h.copy_strided(&back, &cl).unwrap()
                    };
                    let x = scale(&randn(n * c * sp, d), 1.5, 0.3);
                    let res = randn(n * c * sp, d);
                    let (w, b) = (f32s(&randn(c, DType::F32)), f32s(&randn(c, DType::F32)));
                    let (mut rm, mut rv) = (randn(c, DType::F32), randu(c, 0.5, 2.0, DType::F32));
                    let (mut grm, mut grv) = (up(&rm), up(&rv));
                    let rarg = residual.then_some((&res, &cl));
                    let what = format!("{what} ({imp:?})");
                    let (y, saved) = x
                        .batch_norm_train(
                            &cl,
                            BatchNormTrainOperands {
                                residual: rarg,
                                weight: &w,
                                bias: &b,
                                running_mean: &mut rm,
                                running_var: &mut rv,
                            },
                            &p,
                        )
                        .unwrap();
                    let (mean, invstd) = (saved.mean, saved.invstd);
                    let (gx, gres) = (to_gpu(&x), to_gpu(&res));
                    let grarg = residual.then_some((&gres, &gl));
                    let (gw, gb) = (up(&w), up(&b));
                    let (gy, gsaved) = gx
                        .batch_norm_train(
                            &gl,
                            BatchNormTrainOperands {
                                residual: grarg,
                                weight: &gw,
                                bias: &gb,
                                running_mean: &mut grm,
                                running_var: &mut grv,
                            },
                            &gp,
                        )
                        .unwrap();
                    let cudnn = gsaved.reserve.is_some();
                    if cudnn {
                        assert_eq!(imp, BatchNormImpl::Cudnn, "{what}: cuDNN ran");
                        let epi = match (residual, relu) {
                            (true, _) => "add_relu",
                            (false, true) => "relu",
                            (false, false) => "plain",
                        };
                        on_cudnn.push(format!("{d} {n}x{c}x{sp} {epi}"));
                    }
                    let (gmean, ginvstd) = (&gsaved.mean, &gsaved.invstd);
                    let gy_nchw = to_nchw(&gy);
                    let e = rel_err(&gy_nchw.to_f64_vec(), &y.to_f64_vec());
                    assert!(e <= tol(d) * 2.0, "{what} y: relative error {e:e}");
                    check(&format!("{what} mean"), gmean, &mean, 1e-4);
                    check(&format!("{what} invstd"), ginvstd, &invstd, 1e-4);
                    check(&format!("{what} running_mean"), &grm, &rm, 1e-4);
                    check(&format!("{what} running_var"), &grv, &rv, 1e-4);
                    // Backward: both sides read the same y (the GPU's, brought to NCHW), so a
                    // ReLU tie at zero cannot move the comparison.
                    let g = randn(n * c * sp, d);
                    let yarg = relu.then_some((&gy_nchw, &cl));
                    let r = g
                        .batch_norm_backward(
                            &cl,
                            BatchNormBackwardOperands {
                                x: (&x, &cl),
                                y: yarg,
                                weight: &w,
                                bias: &b,
                                saved: saved_of(&mean, &invstd),
                            },
                            &p,
                        )
                        .unwrap();
                    let gyarg = relu.then_some((&gy, &gl));
                    // The GPU's own saved statistics (and cuDNN's reserve space when it ran).
                    let gsaved_ref = BatchNormSaved {
                        mean: gmean,
                        invstd: ginvstd,
                        reserve: gsaved.reserve.as_ref(),
                    };
                    let gr = to_gpu(&g)
                        .batch_norm_backward(
                            &gl,
                            BatchNormBackwardOperands {
                                x: (&gx, &gl),
                                y: gyarg,
                                weight: &gw,
                                bias: &gb,
                                saved: gsaved_ref,
                            },
                            &gp,
                        )
                        .unwrap();
                    // Where cuDNN's ReLU mask may differ from the CPU's (see ReluTies).
                    let (xv, rv, wv, bv) = (
                        x.to_f64_vec(),
                        residual.then(|| res.to_f64_vec()),
                        w.to_f64_vec(),
                        b.to_f64_vec(),
                    );
                    let (meanv, invstdv, gv) =
                        (mean.to_f64_vec(), invstd.to_f64_vec(), g.to_f64_vec());
                    let case = BnCase {
                        shape: (n, c, sp),
                        x: &xv,
                        residual: rv.as_deref(),
                        w: &wv,
                        b: &bv,
                        mean: &meanv,
                        invstd: &invstdv,
                    };
                    let ties = if cudnn && relu {
                        case.relu_ties(&gy_nchw.to_f64_vec(), &gv)
                    } else {
                        ReluTies {
                            tie: vec![false; n * c * sp],
                            dw: vec![0.0; c],
                            db: vec![0.0; c],
                        }
                    };
                    let e = rel_err_beyond(
                        &to_nchw(&gr.input).to_f64_vec(),
                        &r.input.to_f64_vec(),
                        &case.dx_slack(&ties, &gv),
                    );
                    assert!(e <= tol(d) * 4.0, "{what} dx: relative error {e:e}");
                    let (slack_w, slack_b) = (&ties.dw, &ties.db);
                    let (gw_, gb_) = (gr.weight.to_cpu().unwrap(), gr.bias.to_cpu().unwrap());
                    let e = rel_err_beyond(&gw_.to_f64_vec(), &r.weight.to_f64_vec(), slack_w);
                    assert!(e <= 1e-4, "{what} dw: relative error {e:e} > 1e-4");
                    let e = rel_err_beyond(&gb_.to_f64_vec(), &r.bias.to_f64_vec(), slack_b);
                    assert!(e <= 1e-4, "{what} db: relative error {e:e} > 1e-4");
                    match (gr.residual, r.residual) {
                        (Some(gd), Some(cd)) => {
                            // The output gradient through the ReLU's mask: exact. cuDNN takes
                            // its mask from before the rounding of y, so where y rounded to 0
                            // it may pass the gradient; nowhere else.
                            let (gd, cd) = (to_nchw(&gd).to_f64_vec(), cd.to_f64_vec());
                            let yv = gy_nchw.to_f64_vec();
                            for (k, (a, b)) in gd.iter().zip(&cd).enumerate() {
                                let tie = cudnn && yv[k] == 0.0;
                                assert!(
                                    a == b || tie,
                                    "{what} d_residual[{k}]: {a} against {b} (y = {})",
                                    yv[k]
                                );
                            }
                        }
                        (None, None) => assert!(!residual, "{what}: no residual gradient"),
                        _ => panic!("{what}: residual gradients on one side only"),
                    }
                }
            }
        }
    }
    on_cudnn
}

fn pool_cases() -> Vec<Pool2dParams> {
    let mk =
        |n, c, h, w, k: (usize, usize), s: (usize, usize), pd: (usize, usize), cip| Pool2dParams {
            n,
            c,
            h,
            w,
            kh: k.0,
            kw: k.1,
            stride: s,
            padding: pd,
            count_include_pad: cip,
            format: MemoryFormat::Contiguous,
        };
    vec![
        mk(2, 3, 8, 8, (2, 2), (2, 2), (0, 0), true),
        mk(2, 4, 9, 7, (3, 3), (2, 2), (1, 1), true),
        mk(1, 2, 10, 10, (3, 3), (1, 1), (1, 1), false),
        mk(4, 8, 32, 32, (3, 3), (2, 2), (1, 1), true),
        mk(1, 1, 5, 6, (2, 3), (1, 2), (1, 0), false),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn max_pool_fwd_bwd() {
    gpu();
    for d in DTYPES {
        for p in pool_cases() {
            let x = randn(p.n * p.c * p.h * p.w, d);
            let (y, idx) = x.max_pool2d(&whole(&x), &p).unwrap();
            let (gy, gidx) = up(&x).max_pool2d(&whole(&x), &p).unwrap();
            check(&format!("max_pool2d {d} {p:?}"), &gy, &y, 0.0);
            if d == DType::F32 {
                check_exact(&format!("max_pool2d argmax {p:?}"), &gidx, &idx);
            }
            let g = randn(y.len(), d);
            // The same argmax for both, so ties in half types cannot move gradients.
            let want = g
                .max_pool2d_backward(&whole(&g), &idx, &whole(&idx), &p)
                .unwrap();
            let got = up(&g)
                .max_pool2d_backward(&whole(&g), &up(&idx), &whole(&idx), &p)
                .unwrap();
            check(
                &format!("max_pool2d_backward {d} {p:?}"),
                &got,
                &want,
                tol(d),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn avg_and_adaptive_pool_fwd_bwd() {
    gpu();
    for d in DTYPES {
        for p in pool_cases() {
            let x = randn(p.n * p.c * p.h * p.w, d);
            let y = x.avg_pool2d(&whole(&x), &p).unwrap();
            check(
                &format!("avg_pool2d {d} {p:?}"),
                &up(&x).avg_pool2d(&whole(&x), &p).unwrap(),
                &y,
                tol(d),
            );
            let g = randn(y.len(), d);
            check(
                &format!("avg_pool2d_backward {d} {p:?}"),
                &up(&g).avg_pool2d_backward(&whole(&g), &p).unwrap(),
                &g.avg_pool2d_backward(&whole(&g), &p).unwrap(),
                tol(d),
            );
        }
        for (h, w, oh, ow) in [(7, 7, 1, 1), (10, 9, 3, 4), (5, 5, 5, 5), (4, 4, 6, 3)] {
            let p = AdaptivePoolParams {
                n: 2,
                c: 3,
                h,
                w,
                out_h: oh,
                out_w: ow,
                format: MemoryFormat::Contiguous,
            };
            let x = randn(2 * 3 * h * w, d);
            check(
                &format!("adaptive_avg_pool2d {d} {p:?}"),
                &up(&x).adaptive_avg_pool2d(&whole(&x), &p).unwrap(),
                &x.adaptive_avg_pool2d(&whole(&x), &p).unwrap(),
                tol(d),
            );
            let g = randn(2 * 3 * oh * ow, d);
            check(
                &format!("adaptive_avg_pool2d_backward {d} {p:?}"),
                &up(&g).adaptive_avg_pool2d_backward(&whole(&g), &p).unwrap(),
                &g.adaptive_avg_pool2d_backward(&whole(&g), &p).unwrap(),
                tol(d),
            );
        }
    }
}

/// NCHW and NHWC layouts of one logical `[n, c, h, w]`.
fn nchw_nhwc(n: usize, c: usize, h: usize, w: usize) -> (Layout, Layout) {
    let s = Shape::new(vec![n, c, h, w]);
    (
        Layout::contiguous(s.clone()),
        Layout::with_format(s, MemoryFormat::ChannelsLast),
    )
}

/// Pooling in NHWC on the GPU against the CPU's NCHW reference (values moved between the
/// layouts on the host). The GPU's argmax is the flat h·w index, as the CPU's, or, where the
/// channels fill 16-byte packs, a byte per output (the window offset): then each side's
/// backward reads its own record, from a gradient aligned and (copied first) unaligned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pooling_channels_last() {
    gpu();
    for d in DTYPES {
        for p in pool_cases().into_iter().chain([Pool2dParams {
            n: 4,
            c: 64,
            h: 112,
            w: 112,
            kh: 3,
            kw: 3,
            stride: (2, 2),
            padding: (1, 1),
            count_include_pad: true,
            format: MemoryFormat::Contiguous,
        }]) {
            let gp = Pool2dParams {
                format: MemoryFormat::ChannelsLast,
                ..p
            };
            let (ci, li) = nchw_nhwc(p.n, p.c, p.h, p.w);
            let (co, lo) = nchw_nhwc(p.n, p.c, p.out_h(), p.out_w());
            let to_gpu =
                |v: &CpuStorage, from: &Layout, to: &Layout| up(&v.copy_strided(from, to).unwrap());
            let back = |v: &CudaStorage, from: &Layout, to: &Layout| {
                v.to_cpu().unwrap().copy_strided(from, to).unwrap()
            };
            let what = format!("{d} {p:?} NHWC");
            let x = randn(p.n * p.c * p.h * p.w, d);
            let gx = to_gpu(&x, &ci, &li);
            let (y, idx) = x.max_pool2d(&ci, &p).unwrap();
            let (gy, gidx) = gx.max_pool2d(&li, &gp).unwrap();
            assert_eq!(back(&gy, &lo, &co), y, "max_pool2d {what}");
            let packed = p.c % (16 / d.size_in_bytes()) == 0;
            let record = if packed { y.len().div_ceil(8) } else { y.len() };
            assert_eq!(gidx.len(), record, "max_pool2d argmax record {what}");
            if !packed && d == DType::F32 {
                assert_eq!(back(&gidx, &lo, &co), idx, "max_pool2d argmax {what}");
            }
            let g = randn(y.len(), d);
            let want = g.max_pool2d_backward(&co, &idx, &co, &p).unwrap();
            let g_nhwc = g.copy_strided(&co, &lo).unwrap();
            let agrees = |g: &CudaStorage, gl: &Layout, idx: &CudaStorage, il: &Layout, how| {
                let got = g.max_pool2d_backward(gl, idx, il, &gp).unwrap();
                let e = rel_err(&back(&got, &li, &ci).to_f64_vec(), &want.to_f64_vec());
                assert!(e <= tol(d), "max_pool2d_backward, {how}, {what}: {e:e}");
            };
            // The CPU's flat indices, moved to NHWC order, through the flat-index kernel.
            let flat = to_gpu(&idx, &co, &lo);
            agrees(&up(&g_nhwc), &lo, &flat, &lo, "CPU's flat indices");
            agrees(&up(&g_nhwc), &lo, &gidx, &whole(&gidx), "own record");
            // And from a gradient one element into its buffer.
            let shifted: Vec<f32> = std::iter::once(0.0)
                .chain(g_nhwc.to_f64_vec().into_iter().map(|v| v as f32))
                .collect();
            let shifted = up(&cast(&CpuStorage::F32(shifted), d));
            let lo1 = Layout::new(lo.shape().clone(), lo.strides().to_vec(), 1);
            agrees(&shifted, &lo1, &gidx, &whole(&gidx), "unaligned gradient");
            let want = x.avg_pool2d(&ci, &p).unwrap();
            let got = gx.avg_pool2d(&li, &gp).unwrap();
            let e = rel_err(&back(&got, &lo, &co).to_f64_vec(), &want.to_f64_vec());
            assert!(e <= tol(d), "avg_pool2d {what}: {e:e}");
            let want = g.avg_pool2d_backward(&co, &p).unwrap();
            let got = to_gpu(&g, &co, &lo).avg_pool2d_backward(&lo, &gp).unwrap();
            let e = rel_err(&back(&got, &li, &ci).to_f64_vec(), &want.to_f64_vec());
            assert!(e <= tol(d), "avg_pool2d_backward {what}: {e:e}");
        }
        for (c, h, w, oh, ow) in [(64, 7, 7, 1, 1), (3, 10, 9, 3, 4), (2048, 7, 7, 1, 1)] {
            let p = AdaptivePoolParams {
                n: 2,
                c,
                h,
                w,
                out_h: oh,
                out_w: ow,
                format: MemoryFormat::Contiguous,
            };
            let gp = AdaptivePoolParams {
                format: MemoryFormat::ChannelsLast,
                ..p
            };
            let (ci, li) = nchw_nhwc(2, c, h, w);
            let (co, lo) = nchw_nhwc(2, c, oh, ow);
            let what = format!("adaptive {d} {p:?} NHWC");
            let x = randn(2 * c * h * w, d);
            let gx = up(&x.copy_strided(&ci, &li).unwrap());
            let want = x.adaptive_avg_pool2d(&ci, &p).unwrap();
            let got = gx.adaptive_avg_pool2d(&li, &gp).unwrap();
            let got = got.to_cpu().unwrap().copy_strided(&lo, &co).unwrap();
            let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
            assert!(e <= tol(d), "{what}: {e:e}");
            let g = randn(2 * c * oh * ow, d);
            let want = g.adaptive_avg_pool2d_backward(&co, &p).unwrap();
            let got = up(&g.copy_strided(&co, &lo).unwrap())
                .adaptive_avg_pool2d_backward(&lo, &gp)
                .unwrap();
            let got = got.to_cpu().unwrap().copy_strided(&li, &ci).unwrap();
            let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
            assert!(e <= tol(d), "{what} backward: {e:e}");
        }
    }
}

/// A square-kernel convolution with the same stride, padding and dilation on both axes.
#[allow(clippy::too_many_arguments)]
fn mk(
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    groups: usize,
) -> Conv2dParams {
    Conv2dParams {
        n,
        c_in,
        h,
        w,
        c_out,
        kh: k,
        kw: k,
        stride: (stride, stride),
        padding: (padding, padding),
        dilation: (dilation, dilation),
        groups,
        format: MemoryFormat::Contiguous,
    }
}

fn conv_cases() -> Vec<Conv2dParams> {
    vec![
        mk(2, 3, 16, 16, 8, 3, 1, 1, 1, 1),
        mk(2, 8, 15, 15, 16, 3, 2, 1, 1, 1),
        mk(1, 4, 9, 9, 6, 1, 1, 0, 1, 2),
        mk(2, 8, 12, 12, 8, 3, 1, 2, 2, 4),
        mk(4, 64, 14, 14, 64, 3, 1, 1, 1, 1),
        mk(2, 3, 32, 32, 16, 7, 2, 3, 1, 1),
        // ResNet-18 on 4 images of 128x128 (resnet18_forward_backward_matches_cpu): stem,
        // layer1, layer2's strided 3x3 and its 1x1 shortcut, layer4.
        mk(4, 3, 128, 128, 64, 7, 2, 3, 1, 1),
        mk(4, 64, 32, 32, 64, 3, 1, 1, 1, 1),
        mk(4, 64, 32, 32, 128, 3, 2, 1, 1, 1),
        mk(4, 64, 32, 32, 128, 1, 2, 0, 1, 1),
        mk(4, 512, 4, 4, 512, 3, 1, 1, 1, 1),
    ]
}

/// What device 0 runs for this convolution (for failure messages).
fn conv_algorithm(p: &Conv2dParams, d: DType, direction: &str) -> String {
    mixprec::backend::cuda::conv_plans(0)
        .unwrap()
        .into_iter()
        .find(|i| i.params == *p && i.dtype == d && i.direction == direction)
        .map_or_else(|| "no plan".into(), |i| i.algorithm)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv2d_fwd_bwd_data_bwd_filter() {
    gpu();
    for d in DTYPES {
        for p in conv_cases() {
            let x = randn(p.n * p.c_in * p.h * p.w, d);
            let w = scale(
                &randn(p.c_out * (p.c_in / p.groups) * p.kh * p.kw, d),
                0.2,
                0.0,
            );
            let (lx, lw) = (whole(&x), whole(&w));
            let y = x.conv2d(&lx, &w, &lw, &p).unwrap();
            let y_gpu = up(&x).conv2d(&lx, &up(&w), &lw, &p).unwrap();
            let ly = whole(&y);
            check(
                &format!("conv2d {d} {p:?} ({})", conv_algorithm(&p, d, "forward")),
                &y_gpu,
                &y,
                tol_gemm(d),
            );
            let g = randn(y.len(), d);
            let dx = up(&g).conv2d_backward_input(&ly, &up(&w), &lw, &p).unwrap();
            check(
                &format!(
                    "conv2d_backward_input {d} {p:?} ({})",
                    conv_algorithm(&p, d, "backward-data")
                ),
                &dx,
                &g.conv2d_backward_input(&ly, &w, &lw, &p).unwrap(),
                tol_gemm(d),
            );
            let dw = up(&g)
                .conv2d_backward_weight(&ly, &up(&x), &lx, &p)
                .unwrap();
            check(
                &format!(
                    "conv2d_backward_weight {d} {p:?} ({})",
                    conv_algorithm(&p, d, "backward-filter")
                ),
                &dw,
                &g.conv2d_backward_weight(&ly, &x, &lx, &p).unwrap(),
                tol_gemm(d) * 2.0,
            );
        }
    }
}

/// Logical `dims` stored row-major, re-stored channels-last (NHWC / KRSC), on the CPU.
fn channels_last(v: &CpuStorage, dims: [usize; 4]) -> CpuStorage {
    let shape = Shape::new(dims.to_vec());
    v.copy_strided(
        &lay(&dims),
        &Layout::with_format(shape, MemoryFormat::ChannelsLast),
    )
    .unwrap()
}

/// Channels-last storage of logical `dims` back in the logical (row-major) order.
fn channels_first(v: &CpuStorage, dims: [usize; 4]) -> CpuStorage {
    let shape = Shape::new(dims.to_vec());
    v.copy_strided(
        &Layout::with_format(shape, MemoryFormat::ChannelsLast),
        &lay(&dims),
    )
    .unwrap()
}

/// ResNet-50's convolution geometries at batch 2 (the stem, layer1's 1x1 and 3x3, every strided
/// 3x3 and 1x1 downsample, layer4's 3x3), and two with groups and dilation.
fn resnet50_conv_cases() -> Vec<Conv2dParams> {
    vec![
        mk(2, 3, 224, 224, 64, 7, 2, 3, 1, 1),
        mk(2, 64, 56, 56, 256, 1, 1, 0, 1, 1),
        mk(2, 64, 56, 56, 64, 3, 1, 1, 1, 1),
        mk(2, 256, 56, 56, 512, 1, 2, 0, 1, 1),
        mk(2, 128, 56, 56, 128, 3, 2, 1, 1, 1),
        mk(2, 512, 28, 28, 1024, 1, 2, 0, 1, 1),
        mk(2, 256, 28, 28, 256, 3, 2, 1, 1, 1),
        mk(2, 1024, 14, 14, 2048, 1, 2, 0, 1, 1),
        mk(2, 512, 7, 7, 512, 3, 1, 1, 1, 1),
        mk(2, 8, 12, 12, 8, 3, 1, 2, 2, 4),
        mk(1, 16, 9, 9, 32, 3, 1, 1, 1, 16),
    ]
}

/// One convolution's three directions run by `run` on the GPU in channels_last (NHWC activations,
/// KRSC weights: the input, weight and output gradient with their layouts), against the CPU's
/// NCHW results (the GPU's outputs permuted back); `what(direction)` names a failure.
fn check_conv_channels_last(
    p: Conv2dParams,
    d: DType,
    run: impl FnOnce(&Conv2dParams, [(&CudaStorage, &Layout); 3]) -> [CudaStorage; 3],
    what: impl Fn(&str) -> String,
) {
    let cl = Conv2dParams {
        format: MemoryFormat::ChannelsLast,
        ..p
    };
    let xd = [p.n, p.c_in, p.h, p.w];
    let wd = [p.c_out, p.c_in / p.groups, p.kh, p.kw];
    let yd = [p.n, p.c_out, p.out_h(), p.out_w()];
    let x = randn(xd.iter().product(), d);
    let w = randn(wd.iter().product(), d);
    let w = w.affine(&whole(&w), 0.2, 0.0).unwrap();
    let g = randn(yd.iter().product(), d);
    let (lx, lw, lg) = (lay(&xd), lay(&wd), lay(&yd));
    let (xl, wl, gl) = (
        up(&channels_last(&x, xd)),
        up(&channels_last(&w, wd)),
        up(&channels_last(&g, yd)),
    );
    let cl_lay = |dims: [usize; 4]| {
        Layout::with_format(Shape::new(dims.to_vec()), MemoryFormat::ChannelsLast)
    };
    let (lxl, lwl, lgl) = (cl_lay(xd), cl_lay(wd), cl_lay(yd));
    let [fwd, bwd_data, bwd_filter] = run(&cl, [(&xl, &lxl), (&wl, &lwl), (&gl, &lgl)]);
    let cases = [
        (
            "forward",
            fwd,
            yd,
            x.conv2d(&lx, &w, &lw, &p).unwrap(),
            tol_gemm(d),
        ),
        (
            "backward-data",
            bwd_data,
            xd,
            g.conv2d_backward_input(&lg, &w, &lw, &p).unwrap(),
            tol_gemm(d),
        ),
        (
            "backward-filter",
            bwd_filter,
            wd,
            g.conv2d_backward_weight(&lg, &x, &lx, &p).unwrap(),
            tol_gemm(d) * 2.0,
        ),
    ];
    for (direction, got, dims, want, bound) in cases {
        let got = channels_first(&got.to_cpu().unwrap(), dims);
        let e = rel_err(&got.to_f64_vec(), &want.to_f64_vec());
        assert!(
            e <= bound,
            "{}: relative error {e:e} > {bound:e}",
            what(direction)
        );
    }
}

/// The three directions of a convolution as the backend runs them, on channels_last operands.
fn conv_directions(
    cl: &Conv2dParams,
    [(x, lx), (w, lw), (g, lg)]: [(&CudaStorage, &Layout); 3],
) -> [CudaStorage; 3] {
    [
        x.conv2d(lx, w, lw, cl).unwrap(),
        g.conv2d_backward_input(lg, w, lw, cl).unwrap(),
        g.conv2d_backward_weight(lg, x, lx, cl).unwrap(),
    ]
}

/// channels_last convolutions (NHWC activations, KRSC weights) in every direction and dtype,
/// through whichever API the choice picks, against the CPU's NCHW result (the GPU's output
/// permuted back). `MIXPREC_CUDNN_API=graph` / `=legacy` runs them through one API.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv2d_channels_last_matches_cpu_nchw() {
    gpu();
    for d in DTYPES {
        for p in resnet50_conv_cases() {
            check_conv_channels_last(p, d, conv_directions, |direction| {
                let cl = Conv2dParams {
                    format: MemoryFormat::ChannelsLast,
                    ..p
                };
                format!(
                    "channels_last {direction} {d} {p:?} ({})",
                    conv_algorithm(&cl, d, direction)
                )
            });
        }
    }
}

/// The space-to-depth rewrite of strided convolutions over few channels
/// (`backend/cuda/conv_space_to_depth.rs`), forced on, in every direction and dtype against the
/// CPU's NCHW result: a stem (7x7/2 over 3 channels) and geometries that exercise the index maps
/// (unequal strides and kernel sides, padding past the stride, no pad channel). With the choice
/// timed (the default), the stem's choices are reported.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv2d_space_to_depth_matches_cpu_nchw() {
    use mixprec::backend::cuda::{
        conv_space_to_depth_choices, with_conv_space_to_depth, SpaceToDepth,
    };
    gpu();
    let geo = |n, c, hw: (usize, usize), k, kernel: (usize, usize), stride, padding| Conv2dParams {
        n,
        c_in: c,
        h: hw.0,
        w: hw.1,
        c_out: k,
        kh: kernel.0,
        kw: kernel.1,
        stride,
        padding,
        dilation: (1, 1),
        groups: 1,
        format: MemoryFormat::Contiguous,
    };
    let cases = [
        geo(4, 3, (56, 56), 64, (7, 7), (2, 2), (3, 3)),
        geo(3, 2, (19, 22), 24, (5, 3), (3, 2), (2, 1)),
        geo(2, 4, (17, 16), 32, (3, 3), (2, 2), (1, 1)),
        geo(2, 1, (30, 30), 16, (4, 4), (2, 2), (0, 0)),
    ];
    for mode in [SpaceToDepth::Only, SpaceToDepth::Auto] {
        for d in DTYPES {
            for p in cases {
                check_conv_channels_last(
                    p,
                    d,
                    |cl, ops| with_conv_space_to_depth(mode, || conv_directions(cl, ops)),
                    |direction| format!("space-to-depth {mode:?} {direction} {d} {p:?}"),
                );
            }
        }
    }
    let stem = Conv2dParams {
        format: MemoryFormat::ChannelsLast,
        ..cases[0]
    };
    let timed = conv_space_to_depth_choices(0);
    for d in DTYPES {
        for direction in ["forward", "backward-data", "backward-filter"] {
            assert!(
                timed
                    .iter()
                    .any(|c| c.params == stem && c.dtype == d && c.direction == direction),
                "{d} {direction}: the stem's choice was timed and reported: {timed:?}"
            );
        }
    }
}

/// Convolution plans come from cuDNN's graph API and its legacy API, the faster on the first
/// call's buffers (`MIXPREC_CUDNN_API=graph` or `=legacy` forces one: run this binary's conv2d
/// and resnet18 tests once each way too). This checks that the graph API really offers
/// candidates for a ResNet-shaped convolution in every dtype and direction, and that forced, it
/// is what runs: a broken graph path cannot hide behind the legacy one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv2d_resnet_shape_has_graph_api_plans() {
    gpu();
    let api = std::env::var("MIXPREC_CUDNN_API").unwrap_or_default();
    if api == "legacy" {
        return;
    }
    // A geometry no other test uses, so that its plans are built here.
    let p = mk(3, 32, 10, 10, 48, 3, 1, 1, 1, 1);
    for d in DTYPES {
        let x = randn(p.n * p.c_in * p.h * p.w, d);
        let w = randn(p.c_out * p.c_in * p.kh * p.kw, d);
        let (xg, wg) = (up(&x), up(&w));
        let (lx, lw) = (whole(&x), whole(&w));
        let y = xg.conv2d(&lx, &wg, &lw, &p).unwrap();
        let ly = whole(&y);
        let g = up(&randn(y.len(), d));
        g.conv2d_backward_input(&ly, &wg, &lw, &p).unwrap();
        g.conv2d_backward_weight(&ly, &xg, &lx, &p).unwrap();
        let plans: Vec<_> = mixprec::backend::cuda::conv_plans(0)
            .unwrap()
            .into_iter()
            .filter(|i| i.params == p && i.dtype == d)
            .collect();
        assert_eq!(plans.len(), 3, "{d}: {plans:?}");
        assert!(
            plans.iter().all(|i| i.graph_candidates > 0),
            "{d}: {plans:?}"
        );
        if api == "graph" {
            assert!(plans.iter().all(|i| i.graph_api), "{d}: {plans:?}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_geometry_is_an_error() {
    gpu();
    let x = up(&randn(16, DType::F32));
    let w = up(&randn(9, DType::F32));
    // A 3x3 kernel on a 2x2 input without padding.
    let p = mk(1, 1, 2, 2, 1, 3, 1, 0, 1, 1);
    assert!(x.conv2d(&whole(&x), &w, &whole(&w), &p).is_err());
    // Mismatched dtypes reach no kernel, even through the backend API directly.
    let y = up(&randn(16, DType::F16));
    assert!(x
        .binary(&lay(&[16]), &y, &lay(&[16]), BinaryOp::Add, &lay(&[16]))
        .is_err());
}

/// Geometries where whole kernel rows or columns see only padding (input 1x1, kernel 3x3,
/// padding 2, dilation 2: PyTorch gives 1x1); the CPU backend panicked on them before issue 19.
/// cuDNN must take them too and agree with the CPU in every direction.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv2d_padding_only_kernel_cells_match_cpu() {
    gpu();
    let mut odd = mk(1, 2, 1, 4, 2, 3, 1, 1, 2, 2);
    odd.kh = 2;
    odd.padding = (1, 3);
    odd.dilation = (2, 3);
    for p in [
        mk(1, 1, 1, 1, 1, 3, 1, 2, 2, 1),
        mk(2, 2, 2, 3, 2, 3, 2, 3, 3, 1),
        odd,
    ] {
        for d in DTYPES {
            let x = randn(p.n * p.c_in * p.h * p.w, d);
            let w = randn(p.c_out * (p.c_in / p.groups) * p.kh * p.kw, d);
            let (lx, lw) = (whole(&x), whole(&w));
            let y = x.conv2d(&lx, &w, &lw, &p).unwrap();
            assert_eq!(y.len(), p.n * p.c_out * p.out_h() * p.out_w(), "{p:?}");
            let y_gpu = up(&x)
                .conv2d(&lx, &up(&w), &lw, &p)
                .unwrap_or_else(|e| panic!("conv2d {d} {p:?}: {e}"));
            check(&format!("conv2d {d} {p:?}"), &y_gpu, &y, tol_gemm(d));
            let g = randn(y.len(), d);
            let lg = whole(&g);
            let dx = up(&g).conv2d_backward_input(&lg, &up(&w), &lw, &p).unwrap();
            let want = g.conv2d_backward_input(&lg, &w, &lw, &p).unwrap();
            check(
                &format!("conv2d_backward_input {d} {p:?}"),
                &dx,
                &want,
                tol_gemm(d),
            );
            let dw = up(&g)
                .conv2d_backward_weight(&lg, &up(&x), &lx, &p)
                .unwrap();
            let want = g.conv2d_backward_weight(&lg, &x, &lx, &p).unwrap();
            check(
                &format!("conv2d_backward_weight {d} {p:?}"),
                &dw,
                &want,
                tol_gemm(d) * 2.0,
            );
        }
    }
}

/// A buffer larger than the GPU (2^45 bytes) is `Error::OutOfMemory` naming the op, the bytes
/// and the device, not a generic CUDA error; the device keeps working afterwards.
#[test]
#[ignore = "needs a CUDA GPU"]
fn allocation_beyond_device_memory_is_out_of_memory() {
    gpu();
    let dev = Device::Cuda(0);
    match Tensor::zeros([1usize << 43], DType::F32, dev) {
        Err(
            e @ mixprec::Error::OutOfMemory {
                op: "zeros",
                bytes,
                device: Device::Cuda(0),
                ..
            },
        ) => {
            assert_eq!(bytes, 1u64 << 45, "{e}");
            println!("as expected: {e}");
        }
        other => panic!("expected OutOfMemory for 2^45 bytes, got {other:?}"),
    }
    let ones = Tensor::ones([1000], DType::F32, dev).unwrap();
    assert_eq!(ones.sum_all().unwrap().item().unwrap(), 1000.0);
}

// ---- the tensor layer: autograd through the GPU backend -----------------------------------

/// A two-layer MLP with log-softmax + gather (cross-entropy): forward and backward on the GPU
/// against the CPU, every dtype.
#[test]
#[ignore = "needs a CUDA GPU"]
fn mlp_forward_backward_matches_cpu() {
    gpu();
    for d in DTYPES {
        let run = |dev: Device, s: [u64; 4]| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
            let x = Tensor::randn(vec![32, 20], 0.0, 1.0, s[0], d, dev).unwrap();
            let w1 = Tensor::randn(vec![64, 20], 0.0, 0.2, s[1], d, dev)
                .unwrap()
                .to_variable();
            let w2 = Tensor::randn(vec![10, 64], 0.0, 0.2, s[2], d, dev)
                .unwrap()
                .to_variable();
            let b1 = Tensor::zeros(vec![64], d, dev).unwrap().to_variable();
            let labels: Vec<i64> = (0..32)
                .map(|i| ((s[3] as usize + i * 7) % 10) as i64)
                .collect();
            let y = Tensor::from_vec(labels, vec![32, 1], dev).unwrap();
            let h = x.linear(&w1, Some(&b1)).unwrap().relu().unwrap();
            let logits = h.linear(&w2, None).unwrap();
            let lp = logits.to_dtype(DType::F32).unwrap().log_softmax(1).unwrap();
            let loss = lp.gather(1, &y).unwrap().mean_all().unwrap().neg().unwrap();
            loss.backward().unwrap();
            (
                loss.to_vec_f64().unwrap(),
                w1.grad().unwrap().to_vec_f64().unwrap(),
                w2.grad().unwrap().to_vec_f64().unwrap(),
            )
        };
        let s = [seed(), seed(), seed(), seed() % 1000];
        let (lc, g1c, g2c) = run(Device::Cpu, s);
        let (lg, g1g, g2g) = run(Device::Cuda(0), s);
        let b = tol_gemm(d) * 4.0;
        assert!(rel_err(&lg, &lc) <= b, "mlp loss {d}: {lg:?} vs {lc:?}");
        assert!(
            rel_err(&g1g, &g1c) <= b,
            "mlp grad w1 {d}: {:e}",
            rel_err(&g1g, &g1c)
        );
        assert!(
            rel_err(&g2g, &g2c) <= b,
            "mlp grad w2 {d}: {:e}",
            rel_err(&g2g, &g2c)
        );
    }
}

// ---- a torchvision-shaped ResNet-18, forward + backward, GPU vs CPU -------------------------

/// ResNet-18 (torchvision's layer shapes: 7×7/2 stem, max-pool, 4 stages of 2 basic blocks,
/// 64→512 channels, global average pool, fc) built from tensor ops, on a 2×3×64×64 batch.
struct ResNet18 {
    params: Vec<Tensor>,
    bn_stats: Vec<(Tensor, Tensor)>,
}

impl ResNet18 {
    fn new(dtype: DType, dev: Device, seed: u64) -> ResNet18 {
        let mut s = seed;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s
        };
        let mut params = Vec::new();
        let mut bn_stats = Vec::new();
        let mut conv = |params: &mut Vec<Tensor>, co: usize, ci: usize, k: usize| {
            let std = (2.0 / (ci * k * k) as f64).sqrt();
            params.push(
                Tensor::randn(vec![co, ci, k, k], 0.0, std, next(), dtype, dev)
                    .unwrap()
                    .to_variable(),
            );
        };
        let bn = |params: &mut Vec<Tensor>, stats: &mut Vec<(Tensor, Tensor)>, c: usize| {
            params.push(
                Tensor::ones(vec![c], DType::F32, dev)
                    .unwrap()
                    .to_variable(),
            );
            params.push(
                Tensor::zeros(vec![c], DType::F32, dev)
                    .unwrap()
                    .to_variable(),
            );
            stats.push((
                Tensor::zeros(vec![c], DType::F32, dev).unwrap(),
                Tensor::ones(vec![c], DType::F32, dev).unwrap(),
            ));
        };
        conv(&mut params, 64, 3, 7);
        bn(&mut params, &mut bn_stats, 64);
        let mut cin = 64;
        for (stage, cout) in [64, 128, 256, 512].into_iter().enumerate() {
            for block in 0..2 {
                let c_in = if block == 0 { cin } else { cout };
                conv(&mut params, cout, c_in, 3);
                bn(&mut params, &mut bn_stats, cout);
                conv(&mut params, cout, cout, 3);
                bn(&mut params, &mut bn_stats, cout);
                if block == 0 && stage > 0 {
                    conv(&mut params, cout, c_in, 1);
                    bn(&mut params, &mut bn_stats, cout);
                }
            }
            cin = cout;
        }
        params.push(
            Tensor::randn(vec![10, 512], 0.0, 0.04, next(), dtype, dev)
                .unwrap()
                .to_variable(),
        );
        params.push(Tensor::zeros(vec![10], dtype, dev).unwrap().to_variable());
        ResNet18 { params, bn_stats }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (mut pi, mut si) = (0usize, 0usize);
        let mut conv = |x: &Tensor, stride: usize, pad: usize| {
            let w = &self.params[pi];
            pi += 1;
            let cfg = mixprec::Conv2dConfig {
                stride: (stride, stride),
                padding: (pad, pad),
                ..Default::default()
            };
            let y = x.conv2d(w, None, cfg).unwrap();
            let (g, b) = (&self.params[pi], &self.params[pi + 1]);
            pi += 2;
            let (rm, rv) = &self.bn_stats[si];
            si += 1;
            y.batch_norm(g, b, rm, rv, mixprec::BatchNormConfig::default())
                .unwrap()
        };
        let mut h = conv(x, 2, 3)
            .relu()
            .unwrap()
            .max_pool2d((3, 3), (2, 2), (1, 1))
            .unwrap();
        for stage in 0..4 {
            for block in 0..2 {
                let stride = if block == 0 && stage > 0 { 2 } else { 1 };
                let a = conv(&h, stride, 1).relu().unwrap();
                let a = conv(&a, 1, 1);
                let short = if block == 0 && stage > 0 {
                    conv(&h, 2, 0)
                } else {
                    h.clone()
                };
                h = a.add(&short).unwrap().relu().unwrap();
            }
        }
        let h = h.adaptive_avg_pool2d(1, 1).unwrap().flatten(1, -1).unwrap();
        let n = self.params.len();
        h.linear(&self.params[n - 2], Some(&self.params[n - 1]))
            .unwrap()
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet18_forward_backward_matches_cpu() {
    gpu();
    for d in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        // The network and input are drawn in `d` from seed `s`; `compute` may widen those same
        // values (the truth of a run).
        let run = |dev: Device, compute: DType, s: u64| {
            let net = ResNet18::new(d, dev, s);
            for p in &net.params {
                p.cast_in_place(compute).unwrap();
            }
            // 4 images of 128x128 keep 64 values per channel in layer4's batch norm: with fewer,
            // its statistics (and every gradient below it) amplify single-ulp differences.
            let x = Tensor::randn(vec![4, 3, 128, 128], 0.0, 1.0, s ^ 1, d, dev)
                .unwrap()
                .to_dtype(compute)
                .unwrap();
            let y = Tensor::from_vec(vec![3i64, 7, 1, 9], vec![4, 1], dev).unwrap();
            let logits = net.forward(&x);
            // The loss in F32 (as training computes it), or F64 for an F64 run.
            let loss_dtype = if compute == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let lp = logits.to_dtype(loss_dtype).unwrap().log_softmax(1).unwrap();
            let loss = lp.gather(1, &y).unwrap().mean_all().unwrap().neg().unwrap();
            loss.backward().unwrap();
            let mut out = vec![logits.to_vec_f64().unwrap()];
            for p in &net.params {
                out.push(
                    p.grad()
                        .map(|g| g.to_vec_f64().unwrap())
                        .unwrap_or_default(),
                );
            }
            for (rm, rv) in &net.bn_stats {
                out.push(rm.to_vec_f64().unwrap());
                out.push(rv.to_vec_f64().unwrap());
            }
            out
        };
        let n_grads = ResNet18::new(d, Device::Cpu, 0).params.len();
        let is_grad = |k: usize| (1..=n_grads).contains(&k);
        let worst = |errs: &[f64]| {
            let mut w: Vec<(usize, f64)> = errs.iter().copied().enumerate().collect();
            w.sort_by(|a, b| b.1.total_cmp(&a.1));
            w.truncate(5);
            w
        };
        let errs = |a: &[Vec<f64>], b: &[Vec<f64>]| -> Vec<f64> {
            a.iter().zip(b).map(|(x, y)| rel_err(x, y)).collect()
        };
        let what = "tensor (0 = logits, then grads, then bn stats)";
        // Why three schemes: this net's training-mode backward sums many terms of both signs
        // (conv weight gradients over every position), so one discrete event — a ReLU input or a
        // max-pool candidate within rounding of a tie, decided one way on one side and the other
        // way on the other — moves a whole weight gradient by ~1e-3..1e-2. On the CPU alone, f32
        // against an F64 run of the same values is 7e-6 for some draws and up to 1.7e-2 for
        // others (reproducible per seed), and the GPU, with other summation orders, meets such
        // events on other draws. So:
        // - F64: rounding is ~1e-16 and ties within it do not happen: the GPU and CPU compute the
        //   same network, every tensor within 1e-9 (the exact check of the GPU's ops and graph).
        // - F32: compared with the F64 truth. Forward tensors (logits, running statistics) are
        //   well conditioned: within 2x the CPU's distance + 1e-4 (TF32 or a half accumulation
        //   would be ~1e-3 here). Gradients can be ill-conditioned as a whole (layer4's batch-norm
        //   backward sees 64 values per channel; one draw puts every CPU f32 gradient 1.4e-2
        //   from F64): each within 2x the CPU's + 5e-2 (a wrong kernel is off by O(1)), and the
        //   median gradient within 10x the CPU's median + 1e-3. An event on the GPU's side alone
        //   breaks that median on about one draw in four (H200, either cuDNN API: 2.6e-3 to
        //   1.4e-2 against a CPU at 4e-6), while a kernel that computes in reduced precision
        //   breaks it on every draw: so it must hold on one of up to four draws, and every draw
        //   must pass the other bounds.
        // - F16/BF16: compared with the f32 run of the same values; the GPU no further from it
        //   than about the CPU reference is (half roundings dwarf the events above).
        if d == DType::F64 {
            let s = seed();
            let e = errs(&run(Device::Cuda(0), d, s), &run(Device::Cpu, d, s));
            println!("resnet18 f64: worst GPU vs CPU {what}: {:?}", worst(&e));
            for (k, e) in e.iter().enumerate() {
                assert!(
                    *e <= 1e-9,
                    "resnet18 f64: {what} {k}: GPU vs CPU {e:e} > 1e-9"
                );
            }
            continue;
        }
        let truth_dtype = if d == DType::F32 {
            DType::F64
        } else {
            DType::F32
        };
        let draws = if d == DType::F32 { 4 } else { 1 };
        let mut medians = Vec::new();
        for _ in 0..draws {
            let s = seed();
            let truth = run(Device::Cpu, truth_dtype, s);
            let (e_gpu, e_cpu) = (
                errs(&run(Device::Cuda(0), d, s), &truth),
                errs(&run(Device::Cpu, d, s), &truth),
            );
            println!(
                "resnet18 {d} (seed {s}): worst GPU vs {truth_dtype} {what}: {:?}; CPU vs {truth_dtype}: {:?}",
                worst(&e_gpu),
                worst(&e_cpu)
            );
            if d != DType::F32 {
                for (k, (g, c)) in e_gpu.iter().zip(&e_cpu).enumerate() {
                    assert!(
                        *g <= 2.0 * c + tol(d),
                        "resnet18 {d}: {what} {k}: GPU {g:e} from the f32 truth, CPU {c:e}"
                    );
                }
                break;
            }
            for (k, (g, c)) in e_gpu.iter().zip(&e_cpu).enumerate() {
                let bound = if is_grad(k) {
                    2.0 * c + 5e-2
                } else {
                    2.0 * c + 1e-4
                };
                assert!(
                    *g <= bound,
                    "resnet18 f32 (seed {s}): {what} {k}: GPU {g:e} from the F64 truth (CPU {c:e}), bound {bound:e}"
                );
            }
            let median_grad = |e: &[f64]| {
                let mut g: Vec<f64> = (0..e.len()).filter(|&k| is_grad(k)).map(|k| e[k]).collect();
                g.sort_by(f64::total_cmp);
                g[g.len() / 2]
            };
            let (mg, mc) = (median_grad(&e_gpu), median_grad(&e_cpu));
            println!(
                "resnet18 f32 (seed {s}): median gradient error vs F64: GPU {mg:e}, CPU {mc:e}"
            );
            medians.push((s, mg, mc));
            if mg <= 10.0 * mc + 1e-3 {
                break;
            }
        }
        if d == DType::F32 {
            assert!(
                medians.iter().any(|&(_, mg, mc)| mg <= 10.0 * mc + 1e-3),
                "resnet18 f32: median gradient error above 10x the CPU's + 1e-3 on every draw \
                 (seed, GPU, CPU): {medians:?}"
            );
        }
    }
}

/// A backward adds the persistent gradients together (`mt_add_<dtype>`, 64 gradients a launch,
/// the list passed by value): the same bits as the CPU's adds, for more gradients than one
/// launch takes, every float dtype (F64 one at a time), chunk tails, tensors of one element,
/// and a channels_last weight, over two backward passes so the second add rounds.
#[test]
#[ignore = "needs a CUDA GPU"]
fn persistent_gradients_added_together_match_the_cpu() {
    gpu();
    let dtypes = [DType::F16, DType::F32, DType::BF16, DType::F64];
    let sizes = [1usize, 3, 8192, 8193, 20001, 100];
    let mut values = Vec::new();
    for i in 0..140 {
        // Variable i % 70's values, then its coefficients: the same length.
        let n = sizes[(i % 70) % sizes.len()];
        values.push(random::uniform(seed(), n, -2.0, 2.0));
    }
    let weight = random::uniform(seed(), 16 * 3 * 3 * 3, -1.0, 1.0);
    let run = |dev: Device| -> Vec<Vec<f64>> {
        let t = |v: &Vec<f64>, dims: &[usize], dt: DType| {
            Tensor::from_vec(v.clone(), dims.to_vec(), Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .to_device(dev)
                .unwrap()
        };
        // Variables 0..70, each with a coefficient tensor of its own (70..140).
        let mut vars: Vec<Tensor> = (0..70)
            .map(|i| t(&values[i], &[values[i].len()], dtypes[i % 4]).to_variable())
            .collect();
        let mut coefs: Vec<Tensor> = (0..70)
            .map(|i| t(&values[70 + i], &[values[i].len()], dtypes[i % 4]))
            .collect();
        let dims = [4, 4, 3, 3];
        let w = t(&weight[..144].to_vec(), &dims, DType::F16)
            .to_memory_format(MemoryFormat::ChannelsLast)
            .unwrap()
            .to_variable();
        assert_eq!(w.memory_format(), Some(MemoryFormat::ChannelsLast));
        vars.push(w);
        coefs.push(t(&weight[144..288].to_vec(), &dims, DType::F16));
        mixprec::multi_tensor::zero_grads_in_place(&vars).unwrap();
        for k in [0.37, -1.9] {
            let mut loss: Option<Tensor> = None;
            for (v, c) in vars.iter().zip(&coefs) {
                let term = v
                    .mul(c)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .mul_scalar(k)
                    .unwrap();
                loss = Some(match loss {
                    Some(l) => l.add(&term).unwrap(),
                    None => term,
                });
            }
            loss.unwrap().backward().unwrap();
        }
        vars.iter()
            .map(|v| v.grad().unwrap().to_vec_f64().unwrap())
            .collect()
    };
    let (want, got) = (run(Device::Cpu), run(Device::Cuda(0)));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if let Some(j) = (0..w.len()).find(|&j| g[j].to_bits() != w[j].to_bits()) {
            panic!(
                "gradient {i} ({} elements, {:?}): element {j} is {} on the GPU, {} on the CPU",
                w.len(),
                if i < 70 { dtypes[i % 4] } else { DType::F16 },
                g[j],
                w[j]
            );
        }
    }
}

// ================================================================================================
// Fused multi-tensor kernels and optimizers (issue 5): the CPU tests' cases on the GPU, against
// the same F64 references / host-computed expectations, plus CPU ↔ CUDA agreement and the chunk
// table cache.
// ================================================================================================

#[path = "fused_support/mod.rs"]
mod fused_support;

#[path = "fused_support/multi_tensor_cases.rs"]
mod multi_tensor_cases;

mod fused_gpu {
    use super::fused_support::*;
    use super::multi_tensor_cases as mtc;
    use mixprec::optim::{
        AdamConfig, GradScaling, LambConfig, NovoGradConfig, NovoGradNorm, SgdConfig,
    };
    use mixprec::{DType, Device, Tensor};

    const DEV: Device = Device::Cuda(0);

    fn gpu() {
        super::gpu();
    }

    fn kinds() -> Vec<Kind> {
        let s = SgdConfig {
            lr: 0.05,
            ..Default::default()
        };
        let a = AdamConfig {
            lr: 1e-2,
            ..Default::default()
        };
        let l = LambConfig {
            lr: 1e-2,
            ..Default::default()
        };
        let n = NovoGradConfig {
            lr: 1e-2,
            ..Default::default()
        };
        vec![
            Kind::Sgd(s),
            Kind::Sgd(SgdConfig {
                momentum: 0.9,
                weight_decay: 1e-2,
                ..s
            }),
            Kind::Sgd(SgdConfig {
                momentum: 0.9,
                dampening: 0.2,
                weight_decay: 1e-2,
                wd_after_momentum: true,
                ..s
            }),
            Kind::Sgd(SgdConfig {
                momentum: 0.8,
                nesterov: true,
                weight_decay: 1e-3,
                ..s
            }),
            Kind::Adam(a),
            Kind::Adam(AdamConfig {
                adam_w_mode: false,
                weight_decay: 0.1,
                betas: (0.8, 0.99),
                ..a
            }),
            Kind::Adam(AdamConfig {
                weight_decay: 0.05,
                eps: 1e-6,
                bias_correction: false,
                ..a
            }),
            Kind::Adam(AdamConfig {
                amsgrad: true,
                weight_decay: 0.01,
                ..a
            }),
            Kind::Lamb(l),
            Kind::Lamb(LambConfig {
                weight_decay: 0.0,
                use_nvlamb: true,
                ..l
            }),
            Kind::Lamb(LambConfig {
                bias_correction: false,
                max_grad_norm: 0.0,
                grad_averaging: false,
                ..l
            }),
            Kind::Novo(n),
            Kind::Novo(NovoGradConfig {
                weight_decay: 0.01,
                reg_inside_moment: true,
                ..n
            }),
            Kind::Novo(NovoGradConfig {
                weight_decay: 0.01,
                norm_type: NovoGradNorm::Inf,
                grad_averaging: false,
                ..n
            }),
        ]
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_multi_tensor_scale() {
        gpu();
        mtc::scale_cases(DEV);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_multi_tensor_zero() {
        gpu();
        mtc::zero_cases(DEV);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_multi_tensor_axpby() {
        gpu();
        mtc::axpby_cases(DEV);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_multi_tensor_norms() {
        gpu();
        mtc::norm_cases(DEV);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_multi_tensor_update_scale_and_errors() {
        gpu();
        mtc::update_scale_cases(DEV);
        mtc::error_cases(DEV);
        mtc::view_cases(DEV);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_fused_option_matrix() {
        gpu();
        let dims = vec![vec![37], vec![5, 7], vec![1], vec![65_537]];
        for kind in kinds() {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                for masters in [false, true] {
                    if masters && dt == DType::F32 {
                        continue;
                    }
                    run_case(kind, &dims, dt, masters, 7, DEV, false);
                }
            }
            run_case(kind, &dims, DType::F16, true, 3, DEV, true);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_fused_issue_sizes() {
        gpu();
        let dims = vec![
            vec![4096, 1024],
            vec![4096],
            vec![4096, 2048],
            vec![32320, 1024],
            vec![1],
            vec![278_011],
        ];
        for kind in [kinds()[3], kinds()[7], kinds()[8], kinds()[12]] {
            run_case(kind, &dims, DType::F32, false, 7, DEV, false);
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_fused_skip_exactly() {
        gpu();
        for kind in [kinds()[1], kinds()[7], kinds()[8], kinds()[11]] {
            for (bad, at) in [(f32::INFINITY, 0), (f32::NAN, 1), (f32::NEG_INFINITY, 2)] {
                for (dt, masters) in [(DType::F32, false), (DType::F16, true), (DType::BF16, true)]
                {
                    check_skip(kind, dt, masters, bad, at, DEV);
                }
            }
        }
    }

    /// The same steps on the CPU and the GPU agree (FP32 masters, F16 model, unscaled in-kernel),
    /// and repeated steps reuse the cached chunk tables.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_fused_matches_cpu_and_caches_tables() {
        gpu();
        for kind in kinds() {
            let dims = [vec![300, 7], vec![65_536], vec![3]];
            let mut outs = Vec::new();
            let mut cached = Vec::new();
            for dev in [Device::Cpu, DEV] {
                let ps: Vec<Tensor> = dims
                    .iter()
                    .enumerate()
                    .map(|(k, d)| tensor(70 + k as u64, d, DType::F32, dev).to_variable())
                    .collect();
                let mut o = kind.make(ps.clone());
                o.use_master_weights().unwrap();
                for p in &ps {
                    p.cast_in_place(DType::F16).unwrap();
                }
                let m = Tensor::scalar(0.5, DType::F32, dev).unwrap();
                let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
                for s in 0..5u64 {
                    for (k, p) in ps.iter().enumerate() {
                        p.set_grad(Some(tensor(
                            500 + 3 * s + k as u64,
                            p.dims(),
                            DType::F16,
                            dev,
                        )));
                    }
                    o.step_scaled(Some(GradScaling {
                        grad_multiplier: &m,
                        found_inf: &f,
                    }))
                    .unwrap();
                    if dev != Device::Cpu {
                        cached.push(mixprec::backend::cuda::cached_lists());
                    }
                }
                outs.push(
                    o.master_params()
                        .iter()
                        .map(|p| p.to_vec_f64().unwrap())
                        .collect::<Vec<_>>(),
                );
            }
            for (k, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
                assert_close(
                    &format!("{kind:?} cpu vs cuda, param {k}"),
                    b,
                    a,
                    (1e-6, 1e-5),
                );
            }
            // Grads are fresh tensors every step (new addresses, new tables, at most a few per
            // step); the step counters / state lists stay: the cache does not grow unboundedly.
            assert!(cached.iter().all(|&c| c <= 256), "{cached:?}");
        }
    }

    /// With persistent gradient buffers (as AMP's), the tables are built once and reused.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_tables_are_reused_across_steps() {
        gpu();
        let ps: Vec<Tensor> = (0..10)
            .map(|k| tensor(k, &[1000 + k as usize], DType::F32, DEV).to_variable())
            .collect();
        for p in &ps {
            p.set_grad(Some(tensor(3, p.dims(), DType::F32, DEV)));
        }
        let mut o = Kind::Adam(AdamConfig::default()).make(ps.clone());
        o.step().unwrap();
        // Per-thread count: the global cache size also moves with tests running in parallel
        // (what failed on the H200 run of 2026-11-21, which used the global count).
        let n = mixprec::backend::cuda::tables_built_on_this_thread();
        assert!(
            n >= 2,
            "the first step built its tables (update, step counters)"
        );
        // Parallel tests fill the process-wide cache too, and a full cache is cleared, which makes
        // this thread rebuild once (what failed on an H200 run of 2026-11-21: 4 built, 2
        // expected). So the check is a window of steps with no clear in it. A window starts by
        // reading the clears, then takes one step that absorbs the rebuild of a clear made
        // before that read (a clear between the first step's count and the window's read
        // failed an H200 run of 2026-11-28: 3 built), and counts from there.
        use mixprec::backend::cuda::{table_cache_clears, tables_built_on_this_thread};
        for _ in 0..10 {
            let clears = table_cache_clears();
            o.step().unwrap();
            let n = tables_built_on_this_thread();
            for _ in 0..20 {
                o.step().unwrap();
            }
            if table_cache_clears() == clears {
                assert_eq!(
                    tables_built_on_this_thread(),
                    n,
                    "no new tables after the first step"
                );
                return;
            }
        }
        panic!("the table cache was cleared during each of 10 windows of 20 steps");
    }
}

// =================================================================================================
// ---- amp: the device cases of tests/amp_cases (apex's suite) on the GPU -------------------------
// =================================================================================================
//
// The same functions tests/amp.rs runs on the CPU in CI, here on CUDA device 0:
// `cargo test --release --test cuda -- --ignored amp_gpu::`.

mod amp_cases;

/// The device of the amp cases in this binary.
fn amp_device() -> Device {
    gpu();
    Device::Cuda(0)
}

mod amp_gpu {
    macro_rules! on_gpu {
        ($($name:ident),* $(,)?) => {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU"]
                fn $name() {
                    super::amp_cases::$name()
                }
            )*
        };
    }

    on_gpu!(
        o1_op_result_dtypes,
        o1_gradients_have_the_parameters_dtype_and_scopes_nest,
        user_ops_register_a_class,
        cache_holds_parameter_casts_per_grad_mode_until_backward,
        cache_never_goes_stale_across_train_eval_train,
        checkpoint_at_step_5_of_10_restores_bitwise_at_every_level,
        casts_per_level,
        three_scalers_decrease_independently,
        dynamic_scale_grows_after_the_window_and_clamps,
        bf16_policy_runs_unscaled_and_trains,
        multiple_models_optimizers_losses_with_planted_inf,
        accumulation_unscales_once_and_matches_fp32,
        clipping_uses_the_unscaled_norm,
        o2_master_params_are_fp32_and_model_weights_follow_them,
        initialize_twice_is_an_error,
        initialize_checks_its_inputs,
        tiny_resnet_trains_on_fashion_mnist_at_every_level,
    );
}

/// One O2 training step (zero_grad, forward, loss, scaled backward, step with the scale update)
/// on an MLP with an MSE loss makes no host synchronisation: the scaler's state, the overflow
/// flag and the skip decision stay on the device. (MLP and MSE: cross-entropy's index check and
/// BatchNorm's batch counter are not AMP's; the ResNet case below counts those too.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn amp_training_step_makes_no_host_sync() {
    use mixprec::amp::{self, OptLevel, Policy};
    use mixprec::backend::cuda::host_sync_count;
    use mixprec::nn::{mse_loss, Linear, Module, ReLU, Reduction, Sequential};
    use mixprec::optim::{Sgd, SgdConfig};
    let dev = amp_device();
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let model = Sequential::new()
            .with(Linear::new(64, 128, true, &dev, 1).unwrap())
            .with(ReLU::new())
            .with(Linear::new(128, 10, true, &dev, 2).unwrap());
        let cfg = SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            ..Default::default()
        };
        let opt = Sgd::new(model.parameters(), cfg).unwrap();
        let policy = Policy::opt_level(level).with_report_interval(0);
        let (model, mut opt) = amp::initialize(model, opt, policy).unwrap();
        let x = Tensor::randn(vec![32, 64], 0.0, 1.0, 3, DType::F32, dev).unwrap();
        let t = Tensor::randn(vec![32, 10], 0.0, 1.0, 4, DType::F32, dev).unwrap();
        let step = |opt: &mut amp::AmpOptimizer<Sgd>| {
            let loss = mse_loss(&model.forward(&x).unwrap(), &t, Reduction::Mean).unwrap();
            opt.zero_grad().unwrap();
            opt.backward(&loss).unwrap();
            opt.step().unwrap();
        };
        for _ in 0..3 {
            step(&mut opt);
        }
        let before = host_sync_count();
        for _ in 0..5 {
            step(&mut opt);
        }
        let syncs = host_sync_count() - before;
        assert_eq!(
            syncs, 0,
            "{level}: {syncs} host synchronisations in 5 steps"
        );
        assert_eq!(opt.stats().unwrap()[0].steps, 8);
    }
}

/// The same count for the main job's step: the small ResNet with cross-entropy at O2.
#[test]
#[ignore = "needs a CUDA GPU"]
fn amp_resnet_step_host_syncs() {
    use mixprec::amp::{self, OptLevel, Policy};
    use mixprec::backend::cuda::host_sync_count;
    use mixprec::nn::{cross_entropy, Module, ResNet};
    use mixprec::optim::{Sgd, SgdConfig};
    let dev = amp_device();
    let model = ResNet::cifar_style(&[1, 1], 1, 10, &dev).unwrap();
    let cfg = SgdConfig {
        lr: 0.01,
        momentum: 0.9,
        ..Default::default()
    };
    let opt = Sgd::new(model.parameters(), cfg).unwrap();
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (model, mut opt) = amp::initialize(model, opt, policy).unwrap();
    let x = Tensor::randn(vec![16, 1, 28, 28], 0.0, 1.0, 3, DType::F32, dev).unwrap();
    let y = Tensor::from_vec((0..16).map(|i| i % 10).collect::<Vec<i64>>(), vec![16], dev).unwrap();
    let mut step = || {
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        opt.zero_grad().unwrap();
        opt.backward(&loss).unwrap();
        opt.step().unwrap();
    };
    step();
    let before = host_sync_count();
    for _ in 0..3 {
        step();
    }
    let syncs = host_sync_count() - before;
    assert_eq!(syncs, 0, "{syncs} host synchronisations in 3 ResNet steps");
}

/// The batch-norm weight gradients of a CIFAR ResNet-18's last stage in f32 on the GPU against
/// the same network in f64 on the CPU (batch 8 and 32, 32x32). PyTorch's f32 gradients are ~3e-6
/// from f64 here; one of ours was 3e-4 (issue 14): this bounds them at PyTorch's level, and
/// prints every layer4 gradient's error and the convolution plans that made them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet18_batch_norm_weight_gradients_are_f32_accurate() {
    use mixprec::nn::{self, Module};
    gpu();
    for batch in [8usize, 32] {
        let gpu_net =
            nn::resnet::ResNet::cifar_style(&[2, 2, 2, 2], 3, 10, &Device::Cuda(0)).unwrap();
        let cpu_net = nn::resnet::ResNet::cifar_style(&[2, 2, 2, 2], 3, 10, &Device::Cpu).unwrap();
        cpu_net.cast(DType::F64, false).unwrap();
        let x = Tensor::randn([batch, 3, 32, 32], 0.0, 1.0, 7, DType::F32, Device::Cpu).unwrap();
        let labels: Vec<i64> = (0..batch as i64).map(|i| (i * 7) % 10).collect();
        let y = Tensor::from_vec(labels, [batch], Device::Cpu).unwrap();
        let loss = |net: &nn::resnet::ResNet, x: &Tensor, y: &Tensor| {
            nn::loss::cross_entropy(&net.forward(x).unwrap(), y)
                .unwrap()
                .backward()
                .unwrap()
        };
        loss(
            &gpu_net,
            &x.to_device(Device::Cuda(0)).unwrap(),
            &y.to_device(Device::Cuda(0)).unwrap(),
        );
        loss(&cpu_net, &x.to_dtype(DType::F64).unwrap(), &y);
        let mut bn_errs = Vec::new();
        for ((name, g), (_, c)) in gpu_net
            .named_parameters()
            .into_iter()
            .zip(cpu_net.named_parameters())
        {
            if !name.starts_with("layer4") {
                continue;
            }
            let e = rel_err(
                &g.grad().unwrap().to_vec_f64().unwrap(),
                &c.grad().unwrap().to_vec_f64().unwrap(),
            );
            println!("batch {batch} {name}: {e:.2e}");
            if name.contains(".bn") && name.ends_with("weight") {
                bn_errs.push((name, e));
            }
        }
        let worst = bn_errs.iter().map(|e| e.1).fold(0.0, f64::max);
        if worst > 3e-5 {
            for i in mixprec::backend::cuda::conv_plans(0).unwrap() {
                if i.dtype == DType::F32 && i.params.h <= 4 {
                    println!("{} {:?}: {}", i.direction, i.params, i.algorithm);
                }
            }
        }
        assert!(
            worst <= 3e-5,
            "batch {batch}: batch-norm weight gradients {bn_errs:?} (PyTorch f32: ~3e-6)"
        );
    }
}
