//! `mixprec::fuse` on the GPU against the CPU interpreter (the reference): random programs
//! (values and gradients, f32/f16/bf16), a batch norm written with it, a fused call inside a
//! captured graph (no host sync, no allocation on replay). Run with
//! `cargo test --test cuda_fuse -- --ignored` on a GPU machine.

mod fuse_support;

use fuse_support::{inputs, max_rel_diff, program, trace, Program, Rng};
use mixprec::backend::cuda::{allocation_count, device, host_sync_count};
use mixprec::fuse::Fused;
use mixprec::{fuse, graph, DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);

/// The captured test holds the device alone: while a thread captures, the device's stream takes
/// no other thread's work (a host-to-device copy of a parallel test failed with
/// `Error::Capture` on an H200 run), and its replay counts allocations and syncs process-wide.
/// The other tests share it.
static DEVICE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICE.read().unwrap_or_else(|e| e.into_inner())
}

fn fused_of(p: &Program) -> Fused {
    let outs = p.outputs.clone();
    fuse("random", move |f, x| {
        outs.iter().map(|e| trace(f, x, e)).collect()
    })
}

/// Outputs and input gradients (of `sum(y · w)`) of `f` on `xs`.
fn run(f: &Fused, xs: &[Tensor], seed: u64) -> (Vec<Tensor>, Vec<Option<Tensor>>) {
    let vars: Vec<Tensor> = xs.iter().map(|x| x.to_variable()).collect();
    for v in &vars {
        v.set_requires_grad(true);
    }
    let refs: Vec<&Tensor> = vars.iter().collect();
    let ys = f.call(&refs).unwrap();
    let mut total: Option<Tensor> = None;
    for (k, y) in ys.iter().enumerate() {
        let w = Tensor::randn(
            y.dims().to_vec(),
            0.0,
            1.0,
            seed + k as u64,
            y.dtype(),
            y.device(),
        )
        .unwrap();
        let l = y
            .mul(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        total = Some(match total {
            Some(t) => t.add(&l).unwrap(),
            None => l,
        });
    }
    total.unwrap().backward().unwrap();
    let cpu = |t: Tensor| t.to_device(Device::Cpu).unwrap();
    (
        ys.into_iter().map(cpu).collect(),
        vars.iter().map(|v| v.grad().map(cpu)).collect(),
    )
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn random_programs_on_the_gpu_match_the_cpu() {
    let _device = shared();
    let mut rng = Rng(0x0bad_cafe_1234_5678);
    for case in 0..60u64 {
        let sizes = [2 + rng.below(6), 1 + rng.below(40), 3 + rng.below(300)];
        let p = program(&mut rng, 1 + (case as usize) % 4, sizes);
        let (dtype, tol) = match case % 3 {
            0 => (DType::F32, 1e-4),
            1 => (DType::F16, 4e-3),
            _ => (DType::BF16, 2e-2),
        };
        let f = fused_of(&p);
        let host = inputs(&p, case, dtype, Device::Cpu).unwrap();
        let dev: Vec<Tensor> = host.iter().map(|x| x.to_device(GPU).unwrap()).collect();
        let (ys_c, gs_c) = run(&f, &host, case);
        let (ys_g, gs_g) = run(&f, &dev, case);
        for (k, (a, b)) in ys_g.iter().zip(&ys_c).enumerate() {
            assert_eq!(a.dims(), b.dims());
            assert_eq!(a.dtype(), b.dtype());
            let d = max_rel_diff(a, b);
            assert!(d <= tol, "output {k}: {d} for {p:?} ({dtype})");
        }
        for (i, (a, b)) in gs_g.iter().zip(&gs_c).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => {
                    let d = max_rel_diff(a, b);
                    assert!(d <= tol * 10.0, "grad {i}: {d} for {p:?} ({dtype})");
                }
                (None, None) => {}
                _ => panic!("grad {i}: present on one device only, {p:?}"),
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_written_with_fuse_on_the_gpu() {
    let _device = shared();
    let bn = fuse("bn_test", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.var(x[0], &axes);
        let y = f.mul(f.sub(x[0], mean), f.rsqrt(f.add_scalar(var, 1e-5)));
        vec![f.relu(f.add(f.mul(y, x[1]), x[2]))]
    });
    for dtype in [DType::F32, DType::F16] {
        let x = Tensor::randn(vec![8, 64, 14, 14], 0.3, 2.0, 1, dtype, Device::Cpu).unwrap();
        let w = Tensor::randn(vec![64, 1, 1], 1.0, 0.1, 2, DType::F32, Device::Cpu).unwrap();
        let b = Tensor::randn(vec![64, 1, 1], 0.0, 0.1, 3, DType::F32, Device::Cpu).unwrap();
        let (yc, gc) = run(&bn, &[x.clone(), w.clone(), b.clone()], 7);
        let on = |t: &Tensor| t.to_device(GPU).unwrap();
        let (yg, gg) = run(&bn, &[on(&x), on(&w), on(&b)], 7);
        let tol = if dtype == DType::F32 { 1e-4 } else { 4e-3 };
        assert!(max_rel_diff(&yg[0], &yc[0]) <= tol);
        for (a, b) in gg.iter().zip(&gc) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert!(max_rel_diff(a, b) <= tol * 10.0, "{}", max_rel_diff(a, b));
        }
    }
}

/// A fused call captured into a graph replays with new input values, without host work.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_fused_call_replays_without_host_work() {
    let _device = DEVICE.write().unwrap_or_else(|e| e.into_inner());
    let f = fuse("softmax_rows", |f, x| {
        let m = f.max(x[0], &[-1]);
        let e = f.exp(f.sub(x[0], m));
        vec![f.div(e, f.sum(e, &[-1]))]
    });
    let x = Tensor::randn(vec![64, 1000], 0.0, 1.0, 1, DType::F32, GPU).unwrap();
    let y = Tensor::zeros(vec![64, 1000], DType::F32, GPU).unwrap();
    y.copy_in_place(&f.call1(&[&x]).unwrap()).unwrap(); // warm-up: compiled and loaded
    let mut g = graph::capture(GPU, || y.copy_in_place(&f.call1(&[&x])?)).unwrap();
    let fresh = Tensor::randn(vec![64, 1000], 0.0, 1.0, 9, DType::F32, GPU).unwrap();
    x.copy_in_place(&fresh).unwrap();
    device(0).unwrap().synchronize().unwrap();
    let (syncs, allocs) = (host_sync_count(), allocation_count());
    for _ in 0..10 {
        g.launch().unwrap();
    }
    assert_eq!(host_sync_count() - syncs, 0, "host syncs in replays");
    assert_eq!(allocation_count() - allocs, 0, "allocations in replays");
    let want = f.call1(&[&fresh.to_device(Device::Cpu).unwrap()]).unwrap();
    let d = max_rel_diff(&y.to_device(Device::Cpu).unwrap(), &want);
    assert!(d < 1e-5, "{d}");
}

/// `f` on `xs` on the GPU against the CPU interpreter: outputs within `tol` (relative to
/// max(|y|, 1)), input gradients within `10 · tol`; and a second GPU call repeats the first bit
/// for bit (the partials are folded in a fixed order whichever block finishes last).
fn check_against_cpu(what: &str, f: &Fused, xs: &[Tensor], tol: f64) {
    let (ys_c, gs_c) = run(f, xs, 11);
    let dev: Vec<Tensor> = xs.iter().map(|x| x.to_device(GPU).unwrap()).collect();
    let (ys_g, gs_g) = run(f, &dev, 11);
    for (k, (a, b)) in ys_g.iter().zip(&ys_c).enumerate() {
        assert_eq!(a.dims(), b.dims(), "{what}: output {k}");
        let d = max_rel_diff(a, b);
        assert!(d <= tol, "{what}: output {k} differs by {d}");
    }
    for (i, (a, b)) in gs_g.iter().zip(&gs_c).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) => {
                let d = max_rel_diff(a, b);
                assert!(d <= tol * 10.0, "{what}: grad {i} differs by {d}");
            }
            (None, None) => {}
            _ => panic!("{what}: grad {i} present on one device only"),
        }
    }
    let refs: Vec<&Tensor> = dev.iter().collect();
    let _g = mixprec::no_grad();
    let (a, b) = (f.call(&refs).unwrap(), f.call(&refs).unwrap());
    for (k, (a, b)) in a.iter().zip(&b).enumerate() {
        let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: output {k} differs between two calls"
        );
    }
}

fn tol_of(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

/// Batch norm with E[x²] − E[x]² (one reduction set: both sums in one pass over x), on shapes
/// that take each reduction path: rows cut over many blocks with 8-wide loads (H·W a multiple
/// of 8), over many blocks element by element (odd H·W), a block per row, rows shorter than a
/// block; f32, f16 and bf16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn reductions_split_over_many_blocks_match_the_cpu() {
    let _device = shared();
    let bn = fuse("bn_two_sums", |f, x| {
        let axes = [0, 2, 3];
        let mean = f.mean(x[0], &axes);
        let var = f.sub(f.mean(f.sqr(x[0]), &axes), f.sqr(mean));
        let y = f.mul(f.sub(x[0], mean), f.rsqrt(f.add_scalar(var, 1e-5)));
        vec![f.cast(f.add(f.mul(y, x[1]), x[2]), f.dtype(x[0])), var]
    });
    let shapes = [
        vec![32, 4, 56, 56], // long rows, 8-wide: many blocks per channel
        vec![64, 3, 33, 35], // long rows, odd H·W: many blocks, element by element
        vec![8, 16, 14, 14], // a few blocks per channel, 8-wide
        vec![3, 40, 3, 5],   // rows shorter than a block
    ];
    for (s, shape) in shapes.iter().enumerate() {
        for (d, dtype) in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .enumerate()
        {
            let c = shape[1];
            let seed = (10 * s + d) as u64;
            let x = Tensor::randn(shape.clone(), 0.3, 2.0, seed, dtype, Device::Cpu).unwrap();
            let w = Tensor::randn(vec![c, 1, 1], 1.0, 0.1, seed + 1, DType::F32, Device::Cpu);
            let b = Tensor::randn(vec![c, 1, 1], 0.0, 0.1, seed + 2, DType::F32, Device::Cpu);
            let what = format!("batch norm {shape:?} {dtype}");
            check_against_cpu(&what, &bn, &[x, w.unwrap(), b.unwrap()], tol_of(dtype));
        }
    }
}

/// Several reductions of different kinds over the same axes in one kernel (sum, max, min and
/// a mean of a function of x), over the innermost axis (rows along memory: 8-wide loads, long
/// rows cut over many blocks, odd lengths) and over outer axes (rows across memory).
#[test]
#[ignore = "needs a CUDA GPU"]
fn several_reductions_per_kernel_over_inner_and_outer_axes_match_the_cpu() {
    let _device = shared();
    for axes in [vec![-1isize], vec![0], vec![0, 2]] {
        let ax = axes.clone();
        let f = fuse("stats", move |f, x| {
            let s = f.sum(x[0], &ax);
            let hi = f.max(x[0], &ax);
            let lo = f.min(x[0], &ax);
            let m = f.mean(f.tanh(x[0]), &ax);
            // An elementwise output over the reductions, broadcast back over x.
            let y = f.mul(f.sub(x[0], lo), f.recip(f.add_scalar(f.sub(hi, lo), 1.0)));
            vec![s, hi, lo, m, f.add(y, f.mul_scalar(m, 0.5))]
        });
        let shapes = [
            vec![3, 7, 40_000], // long rows of 8-wide units
            vec![5, 2, 1_001],  // odd lengths
            vec![2_000, 3, 24], // long outer axis
            vec![1, 1, 8],      // a single unit
        ];
        for (s, shape) in shapes.iter().enumerate() {
            for (d, dtype) in [DType::F32, DType::F16, DType::BF16]
                .into_iter()
                .enumerate()
            {
                let seed = (100 + 10 * s + d) as u64;
                let x = Tensor::randn(shape.clone(), 0.0, 1.0, seed, dtype, Device::Cpu).unwrap();
                let what = format!("stats over {axes:?} of {shape:?} {dtype}");
                check_against_cpu(&what, &f, &[x], tol_of(dtype));
            }
        }
    }
}

/// AMP's clipping step (`clip_grad_norm_into`: the multiplier times min(1, max/(norm + 1e-6)),
/// a fused kernel) on the GPU against the CPU, clipping and not clipping, and an Inf norm.
#[test]
#[ignore = "needs a CUDA GPU"]
fn clipping_multiplier_on_the_gpu_matches_the_cpu() {
    let _device = shared();
    for (max_norm, planted_inf) in [(0.25, false), (100.0, false), (1.0, true)] {
        let mut results = Vec::new();
        for dev in [Device::Cpu, GPU] {
            let mut g = Tensor::randn(vec![1000], 0.0, 1.0, 5, DType::F32, dev).unwrap();
            if planted_inf {
                g = g.mul_scalar(f64::INFINITY).unwrap();
            }
            let gs = vec![
                g,
                Tensor::randn(vec![33], 0.0, 1.0, 6, DType::F32, dev).unwrap(),
            ];
            let m = Tensor::scalar(0.5, DType::F32, dev).unwrap();
            let found = Tensor::scalar(0.0, DType::F32, dev).unwrap();
            let n = mixprec::optim::clip_grad_norm_into(&gs, max_norm, &m, &found).unwrap();
            results.push((n.item().unwrap(), m.item().unwrap(), found.item().unwrap()));
        }
        let ((n_c, m_c, f_c), (n_g, m_g, f_g)) = (results[0], results[1]);
        assert_eq!(f_c, f_g, "found_inf (max {max_norm})");
        if planted_inf {
            assert!(f_g != 0.0);
            continue;
        }
        assert!((n_c - n_g).abs() <= 1e-5 * n_c, "norm {n_c} vs {n_g}");
        assert!(
            (m_c - m_g).abs() <= 1e-6,
            "multiplier {m_c} vs {m_g} (max {max_norm})"
        );
        let want = 0.5 * (max_norm / (n_c + 1e-6)).min(1.0);
        assert!((m_g - want).abs() <= 1e-6, "multiplier {m_g}, want {want}");
    }
}
