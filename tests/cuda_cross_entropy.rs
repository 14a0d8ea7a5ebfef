//! GPU tests of the fused cross-entropy against the CPU backend (the reference): per-row losses
//! and logits' gradients at a GPT-2 vocabulary (50304 classes) in f32/f16/bf16, and at GPT-2's
//! full [16384, 50304] bf16 step; ignore_index rows; no host reads and no f32 copy of the
//! logits; the out-of-range rule; and a diagnostic print of the fwd+bwd time. Ignored on CI (no
//! GPU): `cargo test --release --test cuda_cross_entropy -- --ignored --nocapture`.

use mixprec::backend::cuda::{self, host_sync_count, memory_stats, reset_peak_memory};
use mixprec::nn::{cross_entropy_with, CrossEntropyConfig, Reduction};
use mixprec::{DType, Device, Tensor};

const VOCAB: usize = 50304;
const IGNORE: i64 = -100;

fn gpu() -> Device {
    cuda::set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU")
}

fn sync() {
    cuda::device(0).unwrap().synchronize().unwrap();
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// ‖got − want‖ / ‖want‖; infinite when got has a NaN/Inf where want is finite.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        if w.is_finite() && !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Relative-error bound of the logits' gradient per dtype: one rounding of f32 math to it, and
/// for f32 the CPU's sum of 50k exponentials in order (~sqrt(V)·2^-24 off the GPU's tree).
fn grad_tol(d: DType) -> f64 {
    match d {
        DType::F32 => 3e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// Targets for `n` rows: every 7th row ignored, the others spread over the vocabulary (the
/// first and last class included).
fn targets(n: usize, c: usize) -> Vec<i64> {
    (0..n)
        .map(|i| match i % 7 {
            3 => IGNORE,
            0 => 0,
            5 => c as i64 - 1,
            _ => ((i * 7919 + 13) % c) as i64,
        })
        .collect()
}

fn cfg(reduction: Reduction, eps: f64) -> CrossEntropyConfig {
    CrossEntropyConfig {
        reduction,
        label_smoothing: eps,
        ignore_index: Some(IGNORE),
    }
}

/// Per-row losses and the gradient of `Σ w_r·loss_r` (the mean's gradient when `w` is None) on
/// `dev`, from logits `x` and targets `t` copied there.
fn run(x: &Tensor, t: &Tensor, eps: f64, dev: Device, mean: bool) -> (Tensor, Tensor, Tensor) {
    let x = x.to_device(dev).unwrap().to_variable();
    let t = t.to_device(dev).unwrap();
    let rows = cross_entropy_with(&x, &t, cfg(Reduction::None, eps)).unwrap();
    let loss = if mean {
        cross_entropy_with(&x, &t, cfg(Reduction::Mean, eps)).unwrap()
    } else {
        // Row weights 1, 2, 3, ... so that each row's gradient differs.
        let n = x.dims()[0];
        let w = Tensor::from_vec(
            (0..n).map(|i| 1.0 + (i % 5) as f32).collect::<Vec<_>>(),
            [n],
            Device::Cpu,
        )
        .unwrap()
        .to_device(dev)
        .unwrap();
        rows.mul(&w).unwrap().sum_all().unwrap()
    };
    loss.backward().unwrap();
    let g = x.grad().unwrap();
    (
        rows.to_device(Device::Cpu).unwrap(),
        loss.to_device(Device::Cpu).unwrap(),
        g.to_device(Device::Cpu).unwrap(),
    )
}

fn compare(what: &str, x: &Tensor, t: &Tensor, eps: f64, mean: bool) {
    let d = x.dtype();
    let (rg, lg, gg) = run(x, t, eps, gpu(), mean);
    let (rc, lc, gc) = run(x, t, eps, Device::Cpu, mean);
    assert_eq!(rg.dtype(), DType::F32, "{what}: f32 losses");
    assert_eq!(gg.dtype(), d, "{what}: the gradient has the logits' dtype");
    let (rgv, rcv) = (vals(&rg), vals(&rc));
    let e_rows = rel_err(&rgv, &rcv);
    assert!(
        e_rows <= 1e-5,
        "{what}: per-row losses, relative error {e_rows}"
    );
    let tv = t.to_vec::<i64>().unwrap();
    for (i, (&v, &ti)) in rgv.iter().zip(&tv).enumerate() {
        if ti == IGNORE {
            assert_eq!(v, 0.0, "{what}: ignored row {i}");
        }
    }
    let e_loss = rel_err(&vals(&lg), &vals(&lc));
    assert!(e_loss <= 1e-5, "{what}: loss, relative error {e_loss}");
    let e_grad = rel_err(&vals(&gg), &vals(&gc));
    assert!(
        e_grad <= grad_tol(d),
        "{what}: gradient, relative error {e_grad} (bound {})",
        grad_tol(d)
    );
    // Ignored rows' gradients are exactly 0.
    let c = x.dims()[1];
    let gv = vals(&gg);
    for (r, &ti) in tv.iter().enumerate() {
        if ti == IGNORE {
            assert!(
                gv[r * c..][..c].iter().all(|&v| v == 0.0),
                "{what}: row {r}"
            );
        }
    }
    println!("{what}: rows {e_rows:.2e}, loss {e_loss:.2e}, grad {e_grad:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt2_vocabulary_matches_the_cpu_in_every_dtype() {
    let n = 64;
    let t = Tensor::from_vec(targets(n, VOCAB), [n], Device::Cpu).unwrap();
    let x32 = Tensor::randn([n, VOCAB], 0.0, 3.0, 7, DType::F32, Device::Cpu).unwrap();
    for d in [DType::F32, DType::F16, DType::BF16] {
        let x = x32.to_dtype(d).unwrap();
        for eps in [0.0, 0.1] {
            compare(
                &format!("[{n}, {VOCAB}] {d} eps {eps} mean"),
                &x,
                &t,
                eps,
                true,
            );
            compare(
                &format!("[{n}, {VOCAB}] {d} eps {eps} weighted"),
                &x,
                &t,
                eps,
                false,
            );
        }
    }
    // A row length whose rows start off 16-byte boundaries (scalar heads and tails).
    let odd = Tensor::randn([33, 1001], 0.0, 2.0, 8, DType::F32, Device::Cpu).unwrap();
    let t = Tensor::from_vec(targets(33, 1001), [33], Device::Cpu).unwrap();
    for d in [DType::F32, DType::F16, DType::BF16] {
        compare(
            &format!("[33, 1001] {d}"),
            &odd.to_dtype(d).unwrap(),
            &t,
            0.1,
            false,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt2_step_shape_matches_the_cpu_without_host_reads_or_an_f32_copy() {
    let dev = gpu();
    let n = 16 * 1024;
    let tv = targets(n, VOCAB);
    let t = Tensor::from_vec(tv.clone(), [n], Device::Cpu).unwrap();
    let x = Tensor::randn([n, VOCAB], 0.0, 3.0, 11, DType::BF16, dev)
        .unwrap()
        .to_variable();
    let tg = t.to_device(dev).unwrap();
    sync();
    // No host read and no f32 [n, V] temporary: the pool's peak over fwd+bwd is the gradient
    // (the logits' size) plus per-row vectors.
    reset_peak_memory(0).unwrap();
    let before_mem = memory_stats(0).unwrap().used;
    let before = host_sync_count();
    let loss = cross_entropy_with(&x, &tg, cfg(Reduction::Mean, 0.1)).unwrap();
    loss.backward().unwrap();
    assert_eq!(
        host_sync_count(),
        before,
        "fwd + bwd read nothing on the host"
    );
    sync();
    let peak = memory_stats(0).unwrap().used_high - before_mem;
    let logits_bytes = (n * VOCAB * 2) as u64;
    assert!(
        peak < logits_bytes + (64 << 20),
        "peak pool growth {peak} B over fwd+bwd for {logits_bytes} B of bf16 logits"
    );
    let g = x.grad().unwrap().to_device(Device::Cpu).unwrap();
    let lg = loss.item().unwrap();
    // The CPU reference on the same bf16 logits.
    let xc = x.detach().to_device(Device::Cpu).unwrap().to_variable();
    let lc = cross_entropy_with(&xc, &t, cfg(Reduction::Mean, 0.1)).unwrap();
    lc.backward().unwrap();
    let lcv = lc.item().unwrap();
    assert!(
        (lg - lcv).abs() <= 1e-5 * lcv.abs(),
        "loss {lg} vs the CPU's {lcv}"
    );
    let e = rel_err(&vals(&g), &vals(&xc.grad().unwrap()));
    assert!(e <= grad_tol(DType::BF16), "gradient relative error {e}");
    println!("[{n}, {VOCAB}] bf16: loss {lg} (cpu {lcv}), grad {e:.2e}, peak +{peak} B");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_out_of_range_target_is_an_error_at_the_next_read_and_a_nan_row() {
    let dev = gpu();
    let x = Tensor::randn([4, 100], 0.0, 1.0, 3, DType::BF16, dev)
        .unwrap()
        .to_variable();
    let t = Tensor::from_vec(vec![1i64, 100, IGNORE, 5], [4], Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let before = host_sync_count();
    let rows = cross_entropy_with(&x, &t, cfg(Reduction::None, 0.0)).unwrap();
    assert_eq!(host_sync_count(), before, "queued without a read");
    let e = rows.to_vec::<f32>().unwrap_err();
    assert!(e.to_string().contains("cross_entropy"), "{e}");
    // The flag is cleared by the report: the values read now show the NaN row.
    let v = rows.to_vec::<f32>().unwrap();
    assert!(
        v[0].is_finite() && v[1].is_nan() && v[2] == 0.0 && v[3].is_finite(),
        "{v:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn diagnostic_gpt2_fwd_bwd_time() {
    let dev = gpu();
    cuda::set_poison_allocations(false);
    let n = 16 * 1024;
    let x = Tensor::randn([n, VOCAB], 0.0, 3.0, 5, DType::BF16, dev)
        .unwrap()
        .to_variable();
    let t = Tensor::from_vec(targets(n, VOCAB), [n], Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let step = |eps: f64, backward: bool| {
        x.zero_grad();
        let loss = cross_entropy_with(&x, &t, cfg(Reduction::Mean, eps)).unwrap();
        if backward {
            loss.backward().unwrap();
        }
    };
    for eps in [0.0, 0.1] {
        for backward in [false, true] {
            for _ in 0..3 {
                step(eps, backward);
            }
            sync();
            let iters = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..iters {
                step(eps, backward);
            }
            sync();
            let ms = t0.elapsed().as_secs_f64() * 1e3 / iters as f64;
            let what = if backward { "fwd+bwd" } else { "fwd" };
            // Bytes moved: the logits read once forward; read once and the gradient written once
            // backward.
            let bytes = (n * VOCAB * 2) as f64 * if backward { 3.0 } else { 1.0 };
            println!(
                "cross_entropy [{n}, {VOCAB}] bf16 eps {eps} {what}: {ms:.3} ms ({:.0} GB/s)",
                bytes / ms / 1e6
            );
        }
    }
}
