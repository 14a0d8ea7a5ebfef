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
