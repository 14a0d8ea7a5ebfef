//! GPU tests of the transformer op family against the CPU backend (the reference), forward and
//! backward, in f32/f16/bf16, with outputs poisoned (NaN-filled) before each op so that unwritten
//! elements fail. Ignored on CI (no GPU): run with `cargo test --test cuda_transformer --
//! --ignored` on a GPU machine.
//!
//! The error measure is ‖gpu − cpu‖ / ‖cpu‖ over all elements; a NaN/Inf where the reference is
//! finite fails.

use mixprec::backend::cuda::{host_sync_count, set_poison_allocations};
use mixprec::{DType, Device, Tensor};

fn gpu() -> Device {
    set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU")
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

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

/// Relative-error bound per dtype.
fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

fn check(what: &str, got: &Tensor, want: &Tensor, d: DType) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let e = rel_err(&vals(got), &vals(want));
    assert!(e <= tol(d), "{what}: relative error {e} (bound {})", tol(d));
}

/// [`check`], except where the result is ill-conditioned (e.g. an RMS norm's dx over one
/// column, `rstd·w·dy·(1 − x̂²)`, which cancels to a few ulps of its terms): there the GPU's
/// distance from the f64 result `exact` is measured against the size of the terms the result is
/// made of (`scale`, e.g. ‖rstd·w·dy‖; 0 for a result that does not cancel).
fn check_against(what: &str, got: &Tensor, want: &Tensor, exact: &Tensor, scale: f64, d: DType) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let e = rel_err(&vals(got), &vals(want));
    if e <= tol(d) {
        return;
    }
    let (g, x) = (vals(got), vals(exact));
    let diff = g
        .iter()
        .zip(&x)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    let size = x.iter().map(|v| v * v).sum::<f64>().sqrt().max(scale);
    let e_terms = if g.iter().all(|v| v.is_finite()) {
        diff / size
    } else {
        f64::INFINITY
    };
    assert!(
        e_terms <= tol(d),
        "{what}: relative error {e} against the CPU and {e_terms} against f64 at the terms' size \
         (bound {})",
        tol(d)
    );
}

/// ‖rstd·w·dy‖ over the rows of x: the size of the terms a norm's dx is summed from.
fn dx_terms(rms: bool, x: &Tensor, w: Option<&Tensor>, g: &Tensor) -> f64 {
    let cols = *x.dims().last().unwrap();
    let (xv, gv) = (vals(x), vals(g));
    let wv = w.map(vals);
    let mut sum = 0.0;
    for (r, row) in xv.chunks(cols).enumerate() {
        let n = cols as f64;
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f64>() / n
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        for j in 0..cols {
            let t = rstd * wv.as_ref().map_or(1.0, |w| w[j]) * gv[r * cols + j];
            sum += t * t;
        }
    }
    sum.sqrt()
}

/// One norm, forward and backward on `dev`: the output and the gradients of x, weight, bias.
fn run_norm(
    rms: bool,
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    g: &Tensor,
    dev: Device,
    transpose: bool,
) -> (Tensor, Tensor, Option<Tensor>, Option<Tensor>) {
    let on = |t: &Tensor| t.to_device(dev).unwrap().to_variable();
    let xv = on(x);
    let (wv, bv) = (w.map(on), b.map(on));
    let xin = if transpose {
        xv.transpose(0, 1).unwrap()
    } else {
        xv.clone()
    };
    let cols = *xin.dims().last().unwrap();
    let y = if rms {
        xin.rms_norm(&[cols], wv.as_ref(), 1e-5).unwrap()
    } else {
        xin.layer_norm(&[cols], wv.as_ref(), bv.as_ref(), 1e-5)
            .unwrap()
    };
    let loss = y
        .to_dtype(DType::F32)
        .unwrap()
        .mul(&g.to_device(dev).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    loss.backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
    (
        cpu(&y),
        cpu(&xv.grad().unwrap()),
        wv.map(|t| cpu(&t.grad().unwrap())),
        bv.map(|t| cpu(&t.grad().unwrap())),
    )
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_match_the_cpu_forward_and_backward() {
    let dev = gpu();
    let mut seed = 1u64;
    let mut next = || {
        seed += 1;
        seed
    };
    for (rows, cols) in [
        (1usize, 1usize),
        (7, 33),
        (1024, 768),
        (5, 1000),
        (9, 1024),
        (64, 5000),
        (3000, 64),
        // Many rows per partial block of the parameters' gradients.
        (20000, 256),
    ] {
        for d in [DType::F32, DType::F16, DType::BF16] {
            let params = if d == DType::F32 {
                vec![d]
            } else {
                vec![d, DType::F32]
            };
            for pd in params {
                for rms in [false, true] {
                    for affine in [true, false] {
                        let x =
                            Tensor::randn([rows, cols], 0.5, 2.0, next(), DType::F32, Device::Cpu)
                                .unwrap()
                                .to_dtype(d)
                                .unwrap();
                        let w = Tensor::randn([cols], 1.0, 0.5, next(), pd, Device::Cpu).unwrap();
                        let b = Tensor::randn([cols], 0.0, 0.5, next(), pd, Device::Cpu).unwrap();
                        let g =
                            Tensor::randn([rows, cols], 0.0, 1.0, next(), DType::F32, Device::Cpu)
                                .unwrap();
                        let (wa, ba) = if affine {
                            (Some(&w), (!rms).then_some(&b))
                        } else {
                            (None, None)
                        };
                        let want = run_norm(rms, &x, wa, ba, &g, Device::Cpu, false);
                        let got = run_norm(rms, &x, wa, ba, &g, dev, false);
                        let f64_of = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                        let (x64, w64, b64) = (f64_of(&x), f64_of(&w), f64_of(&b));
                        let (wa64, ba64) = if affine {
                            (Some(&w64), (!rms).then_some(&b64))
                        } else {
                            (None, None)
                        };
                        let exact = run_norm(rms, &x64, wa64, ba64, &g, Device::Cpu, false);
                        let tag =
                            format!("{rows}x{cols} {d} params {pd} rms {rms} affine {affine}");
                        let terms = dx_terms(rms, &x, wa, &g);
                        check_against(&format!("{tag}: y"), &got.0, &want.0, &exact.0, 0.0, d);
                        check_against(&format!("{tag}: dx"), &got.1, &want.1, &exact.1, terms, d);
                        if let (Some(a), Some(b), Some(c)) = (&got.2, &want.2, &exact.2) {
                            let what = format!("{tag}: dweight");
                            check_against(&what, a, b, c, 0.0, pd.max_with(d));
                        }
                        if let (Some(a), Some(b), Some(c)) = (&got.3, &want.3, &exact.3) {
                            check_against(&format!("{tag}: dbias"), a, b, c, 0.0, pd.max_with(d));
                        }
                    }
                }
            }
        }
    }
}

/// A looser bound where either operand is half.
trait Looser {
    fn max_with(self, other: DType) -> DType;
}
impl Looser for DType {
    fn max_with(self, other: DType) -> DType {
        if self == DType::BF16 || other == DType::BF16 {
            DType::BF16
        } else if self == DType::F16 || other == DType::F16 {
            DType::F16
        } else {
            DType::F32
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_strided_input_normalises_its_logical_rows() {
    let dev = gpu();
    for d in [DType::F32, DType::BF16] {
        let x = Tensor::randn([96, 40], 0.0, 1.0, 3, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(d)
            .unwrap();
        let w = Tensor::randn([96], 1.0, 0.5, 4, DType::F32, Device::Cpu).unwrap();
        let g = Tensor::randn([40, 96], 0.0, 1.0, 5, DType::F32, Device::Cpu).unwrap();
        let want = run_norm(false, &x, Some(&w), None, &g, Device::Cpu, true);
        let got = run_norm(false, &x, Some(&w), None, &g, dev, true);
        check("strided y", &got.0, &want.0, d);
        check("strided dx", &got.1, &want.1, d);
        check(
            "strided dw",
            got.2.as_ref().unwrap(),
            want.2.as_ref().unwrap(),
            d,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_parameter_gradients_repeat_bit_for_bit_without_host_reads() {
    let dev = gpu();
    let x = Tensor::randn([4096, 768], 0.0, 1.0, 6, DType::BF16, dev).unwrap();
    let w = Tensor::randn([768], 1.0, 0.1, 7, DType::F32, dev)
        .unwrap()
        .to_variable();
    let b = Tensor::randn([768], 0.0, 0.1, 8, DType::F32, dev)
        .unwrap()
        .to_variable();
    let g = Tensor::randn([4096, 768], 0.0, 1.0, 9, DType::BF16, dev).unwrap();
    let step = || {
        w.zero_grad();
        b.zero_grad();
        let xv = x.detach().to_variable();
        let y = xv.layer_norm(&[768], Some(&w), Some(&b), 1e-5).unwrap();
        // Σ y·g: the norm's backward receives g.
        y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        (w.grad().unwrap(), b.grad().unwrap(), xv.grad().unwrap())
    };
    let _ = step();
    let before = host_sync_count();
    let (w1, b1, x1) = step();
    assert_eq!(
        host_sync_count(),
        before,
        "a norm forward + backward read the device"
    );
    let (w2, b2, x2) = step();
    for (a, b) in [(&w1, &w2), (&b1, &b2), (&x1, &x2)] {
        assert_eq!(
            vals(a),
            vals(b),
            "gradients differ between two identical steps"
        );
    }
}

/// `op` forward and backward (Σ op(x)·g) on `dev`: the output and x's gradient, on the host.
fn run_unary(
    op: &dyn Fn(&Tensor) -> mixprec::Result<Tensor>,
    x: &Tensor,
    g: &Tensor,
    dev: Device,
) -> (Tensor, Tensor) {
    let xv = x.to_device(dev).unwrap().to_variable();
    let y = op(&xv).unwrap();
    let gd = g.to_device(dev).unwrap().to_dtype(y.dtype()).unwrap();
    y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
    (cpu(&y), cpu(&xv.grad().unwrap()))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn activations_match_the_cpu() {
    let dev = gpu();
    type Op = fn(&Tensor) -> mixprec::Result<Tensor>;
    let ops: [(&str, Op); 3] = [
        ("gelu", |t| t.gelu()),
        ("gelu_tanh", |t| t.gelu_tanh()),
        ("silu", |t| t.silu()),
    ];
    for (name, op) in ops {
        for d in [DType::F32, DType::F16, DType::BF16] {
            for n in [1usize, 7, 4099, 1 << 20] {
                let x = Tensor::randn([n], 0.0, 3.0, n as u64, DType::F32, Device::Cpu)
                    .unwrap()
                    .to_dtype(d)
                    .unwrap();
                let g =
                    Tensor::randn([n], 0.0, 1.0, 7 + n as u64, DType::F32, Device::Cpu).unwrap();
                let (yc, dc) = run_unary(&op, &x, &g, Device::Cpu);
                let (yg, dg) = run_unary(&op, &x, &g, dev);
                check(&format!("{name} {d} n {n}: y"), &yg, &yc, d);
                check(&format!("{name} {d} n {n}: dx"), &dg, &dc, d);
            }
            // A transposed (dense, non-contiguous) input keeps its strides.
            let x = Tensor::randn([33, 17], 0.0, 2.0, 3, DType::F32, Device::Cpu)
                .unwrap()
                .to_dtype(d)
                .unwrap();
            let g = Tensor::randn([17, 33], 0.0, 1.0, 4, DType::F32, Device::Cpu).unwrap();
            let t = |x: &Tensor| op(&x.transpose(0, 1)?);
            let (yc, dc) = run_unary(&t, &x, &g, Device::Cpu);
            let (yg, dg) = run_unary(&t, &x, &g, dev);
            check(&format!("{name} {d} strided: y"), &yg, &yc, d);
            check(&format!("{name} {d} strided: dx"), &dg, &dc, d);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_matches_the_cpu_bit_for_bit_sums() {
    let dev = gpu();
    for d in [DType::F32, DType::F16, DType::BF16] {
        for (num, dim, count) in [
            (5usize, 3usize, 40usize),
            (50257, 64, 4096),
            (1024, 768, 2048),
        ] {
            let ids: Vec<i64> =
                mixprec::tensor::random::uniform(count as u64, count, 0.0, num as f64)
                    .into_iter()
                    .map(|v| (v as i64).min(num as i64 - 1))
                    .collect();
            // A popular token, as padding or a frequent word would be.
            let ids: Vec<i64> = ids
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 5 == 0 { 3 } else { v })
                .collect();
            let idx = Tensor::from_vec(ids, [count], Device::Cpu).unwrap();
            let table = Tensor::randn([num, dim], 0.0, 1.0, 11, DType::F32, Device::Cpu)
                .unwrap()
                .to_dtype(d)
                .unwrap();
            let g = Tensor::randn([count, dim], 0.0, 1.0, 12, DType::F32, Device::Cpu).unwrap();
            let run = |dev: Device| {
                let t = table.to_device(dev).unwrap().to_variable();
                let y = idx.to_device(dev).unwrap().embedding(&t, Some(1)).unwrap();
                let gd = g.to_device(dev).unwrap().to_dtype(d).unwrap();
                y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
                let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
                (cpu(&y), cpu(&t.grad().unwrap()))
            };
            let (yc, dc) = run(Device::Cpu);
            // Default: atomics, each row's sum in some order (f32 accumulation, rounded once).
            let (yg, dg) = run(dev);
            assert_eq!(vals(&yg), vals(&yc), "{d} {num}x{dim}: the gather is exact");
            check(&format!("{d} {num}x{dim}: dweight (atomics)"), &dg, &dc, d);
            // Under the determinism switch: position order, repeating bit for bit.
            mixprec::backend::cuda::set_deterministic(true);
            let (_, dg) = run(dev);
            let (_, dg2) = run(dev);
            mixprec::backend::cuda::set_deterministic(false);
            check(&format!("{d} {num}x{dim}: dweight (ordered)"), &dg, &dc, d);
            assert_eq!(
                vals(&dg),
                vals(&dg2),
                "{d} {num}x{dim}: the ordered scatter-add repeats"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dropout_draws_the_cpus_masks_from_the_same_state() {
    let dev = gpu();
    for d in [DType::F32, DType::F16, DType::BF16] {
        for (n, offset_draws) in [(1usize, 0usize), (1001, 1), (1 << 20, 2)] {
            let x = Tensor::randn([n], 0.0, 1.0, 21, DType::F32, Device::Cpu)
                .unwrap()
                .to_dtype(d)
                .unwrap();
            let g = Tensor::randn([n], 0.0, 1.0, 22, DType::F32, Device::Cpu).unwrap();
            let run = |dev: Device| {
                let gen = mixprec::DropoutGenerator::new(77, dev).unwrap();
                // Earlier draws move the offset off a Philox block boundary.
                for _ in 0..offset_draws {
                    let _ = Tensor::ones([3], d, dev)
                        .unwrap()
                        .dropout(0.5, &gen)
                        .unwrap();
                }
                let xv = x.to_device(dev).unwrap().to_variable();
                let y = xv.dropout(0.1, &gen).unwrap();
                let gd = g.to_device(dev).unwrap().to_dtype(d).unwrap();
                y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
                let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
                (cpu(&y), cpu(&xv.grad().unwrap()), gen.state().unwrap())
            };
            let (yc, dc, sc) = run(Device::Cpu);
            let (yg, dg, sg) = run(dev);
            assert_eq!(sg, sc, "the state advanced alike");
            assert_eq!(vals(&yg), vals(&yc), "{d} n {n}: the same mask and scaling");
            assert_eq!(vals(&dg), vals(&dc), "{d} n {n}: the same backward");
        }
    }
}

/// A looser bound for the attention paths, whose scores and probabilities are rounded to the
/// half type between kernels on both devices (a rounding that may fall either way).
fn attn_tol(d: DType) -> f64 {
    match d {
        DType::F32 => 2e-5,
        DType::F16 => 5e-3,
        _ => 4e-2,
    }
}

fn check_attn(what: &str, got: &Tensor, want: &Tensor, d: DType) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let e = rel_err(&vals(got), &vals(want));
    assert!(
        e <= attn_tol(d),
        "{what}: relative error {e} (bound {})",
        attn_tol(d)
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn masked_softmax_matches_the_cpu_forward_and_backward() {
    let dev = gpu();
    // (batch, Tq, Tk): GPT-2's, odd sizes, a block per row, the long-row kernels.
    for (b, tq, tk) in [
        (24usize, 1024usize, 1024usize),
        (3, 77, 130),
        (2, 5, 4096),
        (2, 3, 5000),
        (1, 2, 40000),
        (4, 1, 1),
    ] {
        for d in [DType::F32, DType::F16, DType::BF16] {
            for causal in [true, false] {
                for offset in [0usize, 1] {
                    // offset 1: a view one element into its buffer, so the rows are unaligned.
                    let n = b * tq * tk;
                    let base = Tensor::randn([n + offset], 0.0, 3.0, 1, DType::F32, Device::Cpu)
                        .unwrap()
                        .to_dtype(d)
                        .unwrap();
                    let g = Tensor::randn([b, tq, tk], 0.0, 1.0, 2, DType::F32, Device::Cpu)
                        .unwrap()
                        .to_dtype(d)
                        .unwrap();
                    let run = |dev: Device| {
                        let xb = base.to_device(dev).unwrap().to_variable();
                        let x = xb
                            .narrow(0, offset, n)
                            .unwrap()
                            .reshape([b, tq, tk])
                            .unwrap();
                        let y = x.scaled_masked_softmax(0.125, causal).unwrap();
                        let gd = g.to_device(dev).unwrap();
                        y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
                        let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
                        (cpu(&y), cpu(&xb.grad().unwrap()))
                    };
                    let (yc, dc) = run(Device::Cpu);
                    let (yg, dg) = run(dev);
                    let tag = format!("{b}x{tq}x{tk} {d} causal {causal} offset {offset}");
                    check(&format!("{tag}: y"), &yg, &yc, d);
                    check_attn(&format!("{tag}: dx"), &dg, &dc, d);
                }
            }
        }
    }
}

/// Attention forward and backward (Σ out·g) on `dev`: the output and the gradients of q, k, v,
/// on the host. `fused_qkv`: q, k, v are slices of one [B, T, 3, H, D] tensor.
fn run_attention(
    qkv: &[Tensor; 3],
    mask: Option<&Tensor>,
    causal: bool,
    g: &Tensor,
    dev: Device,
) -> [Tensor; 4] {
    let on = |t: &Tensor| t.to_device(dev).unwrap().to_variable();
    let (q, k, v) = (on(&qkv[0]), on(&qkv[1]), on(&qkv[2]));
    let m = mask.map(|m| m.to_device(dev).unwrap());
    let o = mixprec::tensor::SdpaOptions {
        causal,
        mask: m.as_ref(),
        ..Default::default()
    };
    let y = q.scaled_dot_product_attention(&k, &v, &o).unwrap();
    let gd = g.to_device(dev).unwrap().to_dtype(y.dtype()).unwrap();
    y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
    [
        cpu(&y),
        cpu(&q.grad().unwrap()),
        cpu(&k.grad().unwrap()),
        cpu(&v.grad().unwrap()),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_math_path_matches_the_cpu() {
    let dev = gpu();
    // (B, H, Tq, Tk, D, causal, mask): GPT-2's shape, and an odd one with and without a mask.
    let cases = [
        (2usize, 12usize, 1024usize, 1024usize, 64usize, true, false),
        (2, 3, 77, 130, 40, false, false),
        (2, 3, 77, 130, 40, true, true),
    ];
    for (b, h, tq, tk, hd, causal, with_mask) in cases {
        for d in [DType::F32, DType::F16, DType::BF16] {
            let r = |shape: [usize; 4], seed: u64| {
                Tensor::randn(shape, 0.0, 1.0, seed, DType::F32, Device::Cpu)
                    .unwrap()
                    .to_dtype(d)
                    .unwrap()
            };
            let qkv = [
                r([b, h, tq, hd], 1),
                r([b, h, tk, hd], 2),
                r([b, h, tk, hd], 3),
            ];
            let mask = with_mask.then(|| {
                Tensor::randn([1, 1, tq, tk], 0.0, 1.0, 4, DType::F32, Device::Cpu).unwrap()
            });
            let g = Tensor::randn([b, h, tq, hd], 0.0, 1.0, 5, DType::F32, Device::Cpu).unwrap();
            let want = run_attention(&qkv, mask.as_ref(), causal, &g, Device::Cpu);
            let got = run_attention(&qkv, mask.as_ref(), causal, &g, dev);
            let tag = format!("{b}x{h}x{tq}x{tk}x{hd} {d} causal {causal} mask {with_mask}");
            for (what, (a, c)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                check_attn(&format!("{tag}: {what}"), a, c, d);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_math_path_reads_fused_qkv_views_and_reads_nothing_back() {
    let dev = gpu();
    let (b, t, h, hd) = (2usize, 128usize, 4usize, 64usize);
    for d in [DType::BF16, DType::F16] {
        let qkv = Tensor::randn([b, t, 3, h, hd], 0.0, 1.0, 9, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(d)
            .unwrap();
        let g = Tensor::randn([b, h, t, hd], 0.0, 1.0, 10, DType::F32, Device::Cpu).unwrap();
        let run = |dev: Device| {
            let x = qkv.to_device(dev).unwrap().to_variable();
            let part = |i: usize| {
                x.narrow(2, i, 1)
                    .unwrap()
                    .squeeze(2)
                    .unwrap()
                    .permute(&[0, 2, 1, 3])
                    .unwrap()
            };
            let o = mixprec::tensor::SdpaOptions {
                causal: true,
                ..Default::default()
            };
            let y = part(0)
                .scaled_dot_product_attention(&part(1), &part(2), &o)
                .unwrap();
            let gd = g.to_device(dev).unwrap().to_dtype(d).unwrap();
            y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
            let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
            (cpu(&y), cpu(&x.grad().unwrap()))
        };
        let (yc, dc) = run(Device::Cpu);
        let (yg, dg) = run(dev);
        check_attn(&format!("{d} fused-qkv out"), &yg, &yc, d);
        check_attn(&format!("{d} fused-qkv dqkv"), &dg, &dc, d);
    }
    // The forward and backward themselves read nothing back to the host.
    let q = Tensor::randn([2, 4, 256, 64], 0.0, 1.0, 11, DType::BF16, dev).unwrap();
    let k = Tensor::randn([2, 4, 256, 64], 0.0, 1.0, 12, DType::BF16, dev).unwrap();
    let v = Tensor::randn([2, 4, 256, 64], 0.0, 1.0, 13, DType::BF16, dev).unwrap();
    let gen = mixprec::DropoutGenerator::new(5, dev).unwrap();
    let o = mixprec::tensor::SdpaOptions {
        causal: true,
        dropout_p: 0.1,
        generator: Some(&gen),
        ..Default::default()
    };
    let step = || {
        let qv = q.detach().to_variable();
        let y = qv.scaled_dot_product_attention(&k, &v, &o).unwrap();
        y.sum_all().unwrap().backward().unwrap();
    };
    step();
    let before = host_sync_count();
    step();
    assert_eq!(host_sync_count(), before, "attention read the device");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_attention_matches_the_cpu_reference_forward_and_backward() {
    let dev = gpu();
    // (B, T, H, D, causal): GPT-2's shape, an odd length, head size 128.
    for (b, t, h, hd, causal) in [
        (2usize, 1024usize, 12usize, 64usize, true),
        (2, 77, 3, 64, false),
        (1, 130, 2, 128, true),
    ] {
        for d in [DType::F16, DType::BF16] {
            // q, k, v as slices of one fused projection [B, T, 3, H, D], as GPT-2 makes them.
            let qkv = Tensor::randn([b, t, 3, h, hd], 0.0, 1.0, 21, DType::F32, Device::Cpu)
                .unwrap()
                .to_dtype(d)
                .unwrap();
            let g = Tensor::randn([b, h, t, hd], 0.0, 1.0, 22, DType::F32, Device::Cpu).unwrap();
            let run = |dev: Device, fused: bool| {
                let x = qkv.to_device(dev).unwrap().to_variable();
                let part = |i: usize| {
                    x.narrow(2, i, 1)
                        .unwrap()
                        .squeeze(2)
                        .unwrap()
                        .permute(&[0, 2, 1, 3])
                        .unwrap()
                };
                let o = mixprec::tensor::SdpaOptions {
                    causal,
                    ..Default::default()
                };
                let (q, k, v) = (part(0), part(1), part(2));
                if dev != Device::Cpu {
                    let path = q.attention_path(&k, &v, &o);
                    let on = mixprec::backend::cuda::flash_attention_available(0);
                    assert_eq!(path == mixprec::tensor::AttentionPath::Fused, on);
                }
                let y = if fused {
                    q.scaled_dot_product_attention_fused(&k, &v, &o).unwrap()
                } else {
                    q.scaled_dot_product_attention(&k, &v, &o).unwrap()
                };
                let gd = g.to_device(dev).unwrap().to_dtype(d).unwrap();
                y.mul(&gd).unwrap().sum_all().unwrap().backward().unwrap();
                let cpu = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
                (cpu(&y), cpu(&x.grad().unwrap()))
            };
            let (yc, dc) = run(Device::Cpu, true);
            let (yg, dg) = run(dev, true);
            let tag = format!("{b}x{t}x{h}x{hd} {d} causal {causal}");
            check_attn(&format!("{tag}: fused out"), &yg, &yc, d);
            check_attn(&format!("{tag}: fused dqkv"), &dg, &dc, d);
            // And the fused path against the GPU's math path.
            let (ym, dm) = run(dev, false);
            check_attn(&format!("{tag}: fused vs math out"), &yg, &ym, d);
            check_attn(&format!("{tag}: fused vs math dqkv"), &dg, &dm, d);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_qkv_attention_equals_the_three_slices() {
    let dev = gpu();
    let (b, t, h, d) = (2usize, 200usize, 4usize, 64usize);
    for dt in [DType::F16, DType::BF16] {
        let qkv = Tensor::randn([b, t, 3, h, d], 0.0, 1.0, 31, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .to_device(dev)
            .unwrap();
        let g = Tensor::randn([b, h, t, d], 0.0, 1.0, 32, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
            .to_device(dev)
            .unwrap();
        let o = mixprec::tensor::SdpaOptions {
            causal: true,
            ..Default::default()
        };
        let run = |packed: bool| {
            let x = qkv.detach().to_variable();
            let y = if packed {
                x.scaled_dot_product_attention_packed(&o).unwrap()
            } else {
                let part = |i: usize| {
                    x.narrow(2, i, 1)
                        .unwrap()
                        .squeeze(2)
                        .unwrap()
                        .permute(&[0, 2, 1, 3])
                        .unwrap()
                };
                part(0)
                    .scaled_dot_product_attention(&part(1), &part(2), &o)
                    .unwrap()
            };
            y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            (
                vals(&y.to_device(Device::Cpu).unwrap()),
                vals(&x.grad().unwrap().to_device(Device::Cpu).unwrap()),
            )
        };
        let (y1, g1) = run(true);
        let (y2, g2) = run(false);
        // The same kernels on the same values: equal bit for bit.
        assert_eq!(y1, y2, "{dt}: output");
        assert_eq!(g1, g2, "{dt}: the projection's gradient");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_with_bias_epilogues_matches_the_cpu_forward_and_backward() {
    // The bias (and GELU) in cuBLASLt's epilogue and the bias gradient in the weight-gradient
    // product (the plain and the GELU-fused linear): GPT-2's
    // shapes (rows a multiple of 8), odd ones (where the heuristic may refuse an epilogue and the
    // plain path runs), and an input read at an odd element offset (an unaligned pointer).
    let dev = gpu();
    let shapes = [(64, 96, 288), (33, 7, 13), (128, 3072, 768), (5, 1, 1)];
    for d in [DType::F32, DType::F16, DType::BF16] {
        for (i, &(rows, inf, outf)) in shapes.iter().enumerate() {
            let seed = 40 + i as u64;
            let x_all = Tensor::randn([rows + 1, inf], 0.0, 1.0, seed, d, Device::Cpu).unwrap();
            let x = x_all.narrow(0, 0, rows).unwrap();
            let w = Tensor::randn([outf, inf], 0.0, 0.2, seed + 100, d, Device::Cpu).unwrap();
            let b = Tensor::randn([outf], 0.0, 1.0, seed + 200, d, Device::Cpu).unwrap();
            let g = Tensor::randn([rows, outf], 0.0, 1.0, seed + 300, d, Device::Cpu).unwrap();
            let run = |dev: Device, gelu: bool| {
                let x = x.to_device(dev).unwrap().to_variable();
                let w = w.to_device(dev).unwrap().to_variable();
                let b = b.to_device(dev).unwrap().to_variable();
                let y = if gelu {
                    x.linear_gelu_tanh(&w, &b).unwrap()
                } else {
                    x.linear(&w, Some(&b)).unwrap()
                };
                let loss = y
                    .mul(&g.to_device(dev).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                loss.backward().unwrap();
                [y, x.grad().unwrap(), w.grad().unwrap(), b.grad().unwrap()]
            };
            for gelu in [false, true] {
                let (want, got) = (run(Device::Cpu, gelu), run(dev, gelu));
                let op = if gelu { "linear_gelu" } else { "linear" };
                for (name, (g, w)) in ["y", "dx", "dw", "db"].iter().zip(got.iter().zip(&want)) {
                    check(&format!("{op} {d} {rows}x{inf}->{outf} {name}"), g, w, d);
                }
            }
            // Rows 1.. of the wider tensor: a contiguous view at an element offset of `inf`,
            // an unaligned pointer when `inf` is odd.
            let shifted = |dev: Device| {
                let x = x_all.to_device(dev).unwrap().narrow(0, 1, rows).unwrap();
                let (w, b) = (w.to_device(dev).unwrap(), b.to_device(dev).unwrap());
                x.linear(&w, Some(&b)).unwrap()
            };
            let what = format!("linear {d} {rows}x{inf}->{outf} at an offset");
            check(&what, &shifted(dev), &shifted(Device::Cpu), d);
        }
    }
}
