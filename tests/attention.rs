//! Scaled-dot-product attention on the CPU: the math path against a naive f64 reference (causal
//! and not, additive masks, Tq ≠ Tk, strided q/k/v views of one fused QKV tensor), gradients by
//! finite differences (f64), dropout's reproducibility, the scaled masked softmax by itself, the
//! fused path's CPU reference against the math path, autocast's class, and errors.

mod common;

use common::*;
use mixprec::tensor::{AttentionPath, SdpaOptions};
use mixprec::{amp, DType, Device, DropoutGenerator, Error, Tensor};

/// Sizes of one attention call.
#[derive(Clone, Copy)]
struct Sizes {
    b: usize,
    h: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

/// `softmax(scale·QKᵀ + mask, causal)·V` in f64, from row-major q, k, v and a mask already
/// broadcast to `[B, H, Tq, Tk]`. A row with every key masked gives zeros.
fn sdpa_ref(
    s: Sizes,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&[f64]>,
    causal: bool,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; s.b * s.h * s.tq * s.dv];
    for bh in 0..s.b * s.h {
        for i in 0..s.tq {
            let mut sc = vec![f64::NEG_INFINITY; s.tk];
            for (j, sj) in sc.iter_mut().enumerate() {
                if causal && j > i {
                    continue;
                }
                let mut dot = 0.0;
                for c in 0..s.d {
                    dot += q[(bh * s.tq + i) * s.d + c] * k[(bh * s.tk + j) * s.d + c];
                }
                *sj = scale * dot + mask.map_or(0.0, |m| m[(bh * s.tq + i) * s.tk + j]);
            }
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..s.dv {
                let mut acc = 0.0;
                for j in 0..s.tk {
                    acc += e[j] / z * v[(bh * s.tk + j) * s.dv + c];
                }
                out[(bh * s.tq + i) * s.dv + c] = acc;
            }
        }
    }
    out
}

fn qkv(s: Sizes, seed: u64, dtype: DType) -> (Tensor, Tensor, Tensor) {
    (
        randn(&[s.b, s.h, s.tq, s.d], seed, dtype),
        randn(&[s.b, s.h, s.tk, s.d], seed + 1, dtype),
        randn(&[s.b, s.h, s.tk, s.dv], seed + 2, dtype),
    )
}

fn opts(causal: bool) -> SdpaOptions<'static> {
    SdpaOptions {
        causal,
        ..Default::default()
    }
}

const SIZES: [Sizes; 3] = [
    Sizes {
        b: 2,
        h: 3,
        tq: 5,
        tk: 5,
        d: 4,
        dv: 4,
    },
    Sizes {
        b: 1,
        h: 2,
        tq: 4,
        tk: 7,
        d: 3,
        dv: 5,
    },
    Sizes {
        b: 2,
        h: 1,
        tq: 9,
        tk: 3,
        d: 8,
        dv: 2,
    },
];

#[test]
fn math_path_matches_the_f64_reference() {
    for (n, s) in SIZES.into_iter().enumerate() {
        let (q, k, v) = qkv(s, 10 * n as u64, DType::F64);
        let (qv, kv, vv) = (vals(&q), vals(&k), vals(&v));
        for causal in [false, true] {
            let y = q
                .scaled_dot_product_attention(&k, &v, &opts(causal))
                .unwrap();
            assert_eq!(y.dims(), [s.b, s.h, s.tq, s.dv]);
            assert_eq!(y.dtype(), DType::F64);
            let scale = 1.0 / (s.d as f64).sqrt();
            let want = sdpa_ref(s, &qv, &kv, &vv, None, causal, scale);
            assert_close_named(
                &format!("{n} causal {causal}"),
                &vals(&y),
                &want,
                1e-12,
                1e-12,
            );
            // An explicit scale.
            let o = SdpaOptions {
                causal,
                scale: Some(0.3),
                ..Default::default()
            };
            let y = q.scaled_dot_product_attention(&k, &v, &o).unwrap();
            let want = sdpa_ref(s, &qv, &kv, &vv, None, causal, 0.3);
            assert_close(&vals(&y), &want, 1e-12, 1e-12);
            // f32 computes in f32.
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let y32 = f32_of(&q)
                .scaled_dot_product_attention(&f32_of(&k), &f32_of(&v), &opts(causal))
                .unwrap();
            assert_eq!(y32.dtype(), DType::F32);
            let want = sdpa_ref(s, &qv, &kv, &vv, None, causal, scale);
            assert_close(&vals(&y32), &want, 1e-5, 1e-5);
        }
    }
}

/// `mask` (its shape `dims`) broadcast to `[B, H, Tq, Tk]`, row-major.
fn broadcast_mask(s: Sizes, mask: &Tensor) -> Vec<f64> {
    vals(
        &mask
            .broadcast_as(&[s.b, s.h, s.tq, s.tk].into())
            .unwrap()
            .contiguous()
            .unwrap(),
    )
}

#[test]
fn additive_masks_broadcast_to_the_scores() {
    let s = SIZES[1];
    let (q, k, v) = qkv(s, 40, DType::F64);
    let (qv, kv, vv) = (vals(&q), vals(&k), vals(&v));
    // A bias over [Tq, Tk]; a padding mask per batch over the keys [B, 1, 1, Tk]; a full one.
    let bias = randn(&[s.tq, s.tk], 41, DType::F64);
    let mut pad = vec![0.0; s.b * s.tk];
    pad[s.tk - 1] = f64::NEG_INFINITY;
    pad[s.tk - 3] = f64::NEG_INFINITY;
    let pad = t64(&pad, &[s.b, 1, 1, s.tk]);
    let full = randn(&[s.b, s.h, s.tq, s.tk], 42, DType::F64);
    for mask in [&bias, &pad, &full] {
        for causal in [false, true] {
            let o = SdpaOptions {
                causal,
                mask: Some(mask),
                ..Default::default()
            };
            let y = q.scaled_dot_product_attention(&k, &v, &o).unwrap();
            let m = broadcast_mask(s, mask);
            let want = sdpa_ref(s, &qv, &kv, &vv, Some(&m), causal, 1.0 / 3f64.sqrt());
            assert_close_named(
                &format!("mask {:?} causal {causal}", mask.dims()),
                &vals(&y),
                &want,
                1e-12,
                1e-12,
            );
        }
    }
    // An f32 mask on f64 inputs, and an f32 mask on f16 inputs (the sum in f32).
    let bias32 = bias.to_dtype(DType::F32).unwrap();
    let o = SdpaOptions {
        mask: Some(&bias32),
        ..Default::default()
    };
    let y = q.scaled_dot_product_attention(&k, &v, &o).unwrap();
    assert_eq!(y.dtype(), DType::F64);
    let m = broadcast_mask(s, &bias32);
    let want = sdpa_ref(s, &qv, &kv, &vv, Some(&m), false, 1.0 / 3f64.sqrt());
    assert_close(&vals(&y), &want, 1e-12, 1e-12);
    let h = |t: &Tensor| t.to_dtype(DType::F16).unwrap();
    let yh = h(&q)
        .scaled_dot_product_attention(&h(&k), &h(&v), &o)
        .unwrap();
    assert_eq!(yh.dtype(), DType::F16);
    assert_close(&vals(&yh), &want, 1e-2, 1e-2);
}

#[test]
fn a_row_with_every_key_masked_gives_zeros() {
    let s = Sizes {
        b: 1,
        h: 1,
        tq: 3,
        tk: 4,
        d: 2,
        dv: 2,
    };
    let (q, k, v) = qkv(s, 50, DType::F64);
    let mut m = vec![0.0; 12];
    for x in &mut m[4..8] {
        *x = f64::NEG_INFINITY;
    }
    let mask = t64(&m, &[3, 4]);
    let o = SdpaOptions {
        mask: Some(&mask),
        ..Default::default()
    };
    let qv = q.detach().to_variable();
    let y = qv.scaled_dot_product_attention(&k, &v, &o).unwrap();
    let yv = vals(&y);
    assert_eq!(&yv[2..4], &[0.0, 0.0]);
    assert!(yv.iter().all(|x| x.is_finite()));
    y.sum_all().unwrap().backward().unwrap();
    assert!(vals(&qv.grad().unwrap()).iter().all(|x| x.is_finite()));
}

#[test]
fn strided_views_of_one_fused_qkv_tensor() {
    // [B, T, 3, H, D] as a fused QKV projection lays it out; q, k, v are permuted slices.
    let (b, t, h, d) = (2, 6, 3, 4);
    let qkv = randn(&[b, t, 3, h, d], 60, DType::F64);
    let part = |i: usize| {
        qkv.narrow(2, i, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .permute(&[0, 2, 1, 3])
            .unwrap()
    };
    let (q, k, v) = (part(0), part(1), part(2));
    assert!(!q.layout().is_contiguous());
    let s = Sizes {
        b,
        h,
        tq: t,
        tk: t,
        d,
        dv: d,
    };
    for causal in [false, true] {
        let y = q
            .scaled_dot_product_attention(&k, &v, &opts(causal))
            .unwrap();
        let want = sdpa_ref(s, &vals(&q), &vals(&k), &vals(&v), None, causal, 0.5);
        assert_close(&vals(&y), &want, 1e-12, 1e-12);
    }
    // Gradients flow back into the one fused tensor.
    check_gradients(&[qkv.narrow(1, 0, 3).unwrap()], |x| {
        let p = |i: usize| x[0].narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3]);
        p(0)?.scaled_dot_product_attention(&p(1)?, &p(2)?, &opts(true))
    });
}

#[test]
fn gradients_match_finite_differences() {
    for s in SIZES {
        for causal in [false, true] {
            let (q, k, v) = qkv(s, 70, DType::F64);
            check_gradients(&[q, k, v], |x| {
                x[0].scaled_dot_product_attention(&x[1], &x[2], &opts(causal))
            });
        }
    }
    // With a mask that requires a gradient too.
    let s = SIZES[1];
    let (q, k, v) = qkv(s, 80, DType::F64);
    let bias = randn(&[s.h, s.tq, s.tk], 81, DType::F64);
    check_gradients(&[q, k, v, bias], |x| {
        let o = SdpaOptions {
            causal: true,
            mask: Some(&x[3]),
            scale: Some(0.7),
            ..Default::default()
        };
        x[0].scaled_dot_product_attention(&x[1], &x[2], &o)
    });
}

#[test]
fn dropout_repeats_with_the_same_seed_and_p_zero_is_no_dropout() {
    let s = SIZES[0];
    let (q, k, v) = qkv(s, 90, DType::F32);
    let run = |p: f64, seed: u64| {
        let g = DropoutGenerator::new(seed, Device::Cpu).unwrap();
        let o = SdpaOptions {
            causal: true,
            dropout_p: p,
            generator: Some(&g),
            ..Default::default()
        };
        vals(&q.scaled_dot_product_attention(&k, &v, &o).unwrap())
    };
    let plain = vals(&q.scaled_dot_product_attention(&k, &v, &opts(true)).unwrap());
    assert_eq!(run(0.0, 1), plain, "p = 0 is exactly no dropout");
    let a = run(0.3, 5);
    assert_eq!(a, run(0.3, 5), "the same seed draws the same masks");
    assert_ne!(a, run(0.3, 6), "another seed draws other masks");
    assert_ne!(a, plain);
    // p = 0 needs no generator.
    let y = q.scaled_dot_product_attention(&k, &v, &SdpaOptions::default());
    assert!(y.is_ok());
    // The gradient applies the forward's mask: a dropped probability passes nothing back.
    let g = DropoutGenerator::new(3, Device::Cpu).unwrap();
    let (q, k, v) = qkv(s, 91, DType::F64);
    let vv = v.detach().to_variable();
    let o = SdpaOptions {
        dropout_p: 1.0,
        generator: Some(&g),
        ..Default::default()
    };
    let y = q.scaled_dot_product_attention(&k, &vv, &o).unwrap();
    assert!(vals(&y).iter().all(|&x| x == 0.0));
    y.sum_all().unwrap().backward().unwrap();
    assert!(vals(&vv.grad().unwrap()).iter().all(|&x| x == 0.0));
}

#[test]
fn half_inputs_keep_their_dtype() {
    let s = SIZES[1];
    let (q, k, v) = qkv(s, 100, DType::F32);
    // The scores and probabilities are rounded to the half type between the products, as on
    // the GPU: errors of a few half ulps of the output's size.
    for (dt, tol) in [(DType::F16, 1e-2), (DType::BF16, 6e-2)] {
        let xs: Vec<Tensor> = [&q, &k, &v]
            .iter()
            .map(|t| t.to_dtype(dt).unwrap())
            .collect();
        let x32: Vec<Tensor> = xs.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
        let half = xs[0]
            .scaled_dot_product_attention(&xs[1], &xs[2], &opts(true))
            .unwrap();
        let full = x32[0]
            .scaled_dot_product_attention(&x32[1], &x32[2], &opts(true))
            .unwrap();
        assert_eq!(half.dtype(), dt);
        assert_close_named(&format!("{dt}"), &vals(&half), &vals(&full), tol, tol);
    }
}

#[test]
fn autocast_runs_attention_in_half_and_the_cpu_takes_the_math_path() {
    let s = SIZES[0];
    let (q, k, v) = qkv(s, 110, DType::F32);
    assert_eq!(q.attention_path(&k, &v, &opts(true)), AttentionPath::Math);
    let _ac = amp::autocast(DType::BF16).unwrap();
    let y = q.scaled_dot_product_attention(&k, &v, &opts(true)).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(q.attention_path(&k, &v, &opts(true)), AttentionPath::Math);
    assert_eq!(
        mixprec::amp::autocast::class_of(mixprec::tensor::autocast::OpKind::Attention),
        mixprec::amp::autocast::OpClass::Half
    );
}

#[test]
fn fused_path_is_refused_where_unsupported() {
    use mixprec::tensor::fused_supported;
    let cuda = Device::Cuda(0);
    let o = SdpaOptions::default();
    assert!(!fused_supported(Device::Cpu, DType::F16, 64, &o));
    assert!(!fused_supported(cuda, DType::F32, 64, &o));
    assert!(!fused_supported(cuda, DType::F16, 80, &o));
    let mask = t32(&[0.0], &[1]);
    let with_mask = SdpaOptions {
        mask: Some(&mask),
        ..o
    };
    assert!(!fused_supported(cuda, DType::F16, 64, &with_mask));
    let with_dropout = SdpaOptions {
        dropout_p: 0.1,
        ..o
    };
    assert!(!fused_supported(cuda, DType::BF16, 128, &with_dropout));
    // Where the kernels run (a CUDA device of compute capability 8.0+), the fused path.
    assert_eq!(
        fused_supported(cuda, DType::BF16, 128, &o),
        mixprec::backend::cuda::flash_attention_available(0)
    );
}

#[test]
fn bad_inputs_are_errors() {
    let s = SIZES[0];
    let (q, k, v) = qkv(s, 120, DType::F32);
    let o = opts(false);
    let is_err = |r: mixprec::Result<Tensor>| assert!(r.is_err(), "{r:?}");
    // Ranks.
    is_err(
        q.reshape(vec![6, 5, 4])
            .unwrap()
            .scaled_dot_product_attention(&k, &v, &o),
    );
    // Mismatched batch, heads, head_dim, Tk.
    is_err(q.scaled_dot_product_attention(&randn(&[1, 3, 5, 4], 1, DType::F32), &v, &o));
    is_err(q.scaled_dot_product_attention(&randn(&[2, 2, 5, 4], 1, DType::F32), &v, &o));
    is_err(q.scaled_dot_product_attention(&randn(&[2, 3, 5, 3], 1, DType::F32), &v, &o));
    is_err(q.scaled_dot_product_attention(&k, &randn(&[2, 3, 6, 4], 1, DType::F32), &o));
    // Dtypes.
    let k64 = k.to_dtype(DType::F64).unwrap();
    assert!(matches!(
        q.scaled_dot_product_attention(&k64, &v, &o),
        Err(Error::DTypeMismatch { .. })
    ));
    let qi = Tensor::zeros([2, 3, 5, 4], DType::I64, Device::Cpu).unwrap();
    let ki = Tensor::zeros([2, 3, 5, 4], DType::I64, Device::Cpu).unwrap();
    is_err(qi.scaled_dot_product_attention(&ki, &ki, &o));
    // head_dim 0, a non-finite scale, a bad dropout probability, dropout without a generator.
    let z = Tensor::zeros([1, 1, 2, 0], DType::F32, Device::Cpu).unwrap();
    is_err(z.scaled_dot_product_attention(&z, &z, &o));
    for scale in [f64::NAN, f64::INFINITY] {
        let bad = SdpaOptions {
            scale: Some(scale),
            ..o
        };
        is_err(q.scaled_dot_product_attention(&k, &v, &bad));
    }
    for p in [-0.1, 1.5, f64::NAN] {
        let g = DropoutGenerator::new(1, Device::Cpu).unwrap();
        let bad = SdpaOptions {
            dropout_p: p,
            generator: Some(&g),
            ..o
        };
        is_err(q.scaled_dot_product_attention(&k, &v, &bad));
    }
    let bad = SdpaOptions {
        dropout_p: 0.5,
        ..o
    };
    is_err(q.scaled_dot_product_attention(&k, &v, &bad));
    // Masks: not broadcastable, too many dims, an i64 or f16 mask on f32 inputs.
    for m in [
        randn(&[5, 4], 1, DType::F32),
        randn(&[1, 2, 3, 5, 5], 1, DType::F32),
        randn(&[5, 5], 1, DType::F16),
        Tensor::zeros([5, 5], DType::I64, Device::Cpu).unwrap(),
    ] {
        let bad = SdpaOptions {
            mask: Some(&m),
            ..o
        };
        is_err(q.scaled_dot_product_attention(&k, &v, &bad));
    }
    // The masked softmax by itself.
    is_err(randn(&[4], 1, DType::F32).scaled_masked_softmax(1.0, true));
    is_err(randn(&[4, 4], 1, DType::F32).scaled_masked_softmax(f64::NAN, true));
}

/// Output and the gradients of q, k, v of `f` (Σ f(q, k, v)·w with fixed weights w).
fn with_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> mixprec::Result<Tensor>,
) -> [Vec<f64>; 4] {
    let (q, k, v) = (
        q.detach().to_variable(),
        k.detach().to_variable(),
        v.detach().to_variable(),
    );
    let y = f(&q, &k, &v).unwrap();
    let w = Tensor::randn(y.shape(), 0.0, 1.0, 7, y.dtype(), Device::Cpu).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    [
        vals(&y),
        vals(&q.grad().unwrap()),
        vals(&k.grad().unwrap()),
        vals(&v.grad().unwrap()),
    ]
}

#[test]
fn fused_reference_on_the_cpu_equals_the_math_path() {
    for (n, s) in SIZES.into_iter().enumerate() {
        for causal in [false, true] {
            for dt in [DType::F64, DType::F32] {
                let (q, k, v) = qkv(s, 130 + n as u64, dt);
                let o = SdpaOptions {
                    causal,
                    scale: Some(0.45),
                    ..Default::default()
                };
                let math = with_grads(&q, &k, &v, |q, k, v| {
                    q.scaled_dot_product_attention(k, v, &o)
                });
                let fused = with_grads(&q, &k, &v, |q, k, v| {
                    q.scaled_dot_product_attention_fused(k, v, &o)
                });
                let tol = if dt == DType::F64 { 1e-12 } else { 2e-5 };
                for (what, (a, b)) in ["out", "dq", "dk", "dv"]
                    .iter()
                    .zip(fused.iter().zip(&math))
                {
                    assert_close_named(
                        &format!("{n} {dt} causal {causal}: {what}"),
                        a,
                        b,
                        tol,
                        tol,
                    );
                }
            }
        }
    }
    // Half inputs: the fused reference keeps the probabilities in f32, the math path rounds
    // them to the half type.
    let s = SIZES[0];
    let (q, k, v) = qkv(s, 140, DType::BF16);
    let math = with_grads(&q, &k, &v, |q, k, v| {
        q.scaled_dot_product_attention(k, v, &opts(true))
    });
    let fused = with_grads(&q, &k, &v, |q, k, v| {
        q.scaled_dot_product_attention_fused(k, v, &opts(true))
    });
    for (a, b) in fused.iter().zip(&math) {
        assert_close(a, b, 6e-2, 6e-2);
    }
}

#[test]
fn fused_reference_reads_strided_views_and_its_gradients_match_finite_differences() {
    let (b, t, h, d) = (1, 5, 2, 3);
    let fused_qkv = randn(&[b, t, 3, h, d], 150, DType::F64);
    let part = |x: &Tensor, i: usize| -> mixprec::Result<Tensor> {
        x.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])
    };
    let f = |x: &Tensor, fused: bool| -> mixprec::Result<Tensor> {
        let (q, k, v) = (part(x, 0)?, part(x, 1)?, part(x, 2)?);
        if fused {
            q.scaled_dot_product_attention_fused(&k, &v, &opts(true))
        } else {
            q.scaled_dot_product_attention(&k, &v, &opts(true))
        }
    };
    assert_close(
        &vals(&f(&fused_qkv, true).unwrap()),
        &vals(&f(&fused_qkv, false).unwrap()),
        1e-12,
        1e-12,
    );
    check_gradients(&[fused_qkv], |x| f(&x[0], true));
    let s = SIZES[1];
    let (q, k, v) = qkv(s, 151, DType::F64);
    check_gradients(&[q, k, v], |x| {
        x[0].scaled_dot_product_attention_fused(&x[1], &x[2], &opts(false))
    });
    // Masks and dropout are the math path's.
    let (q, k, v) = qkv(s, 152, DType::F64);
    let m = randn(&[s.tq, s.tk], 1, DType::F64);
    let o = SdpaOptions {
        mask: Some(&m),
        ..Default::default()
    };
    assert!(q.scaled_dot_product_attention_fused(&k, &v, &o).is_err());
}

/// The masked softmax of `x` ([rows/tq][tq][tk] row-major) in f64.
fn masked_softmax_ref(x: &[f64], tq: usize, tk: usize, scale: f64, causal: bool) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (r, (xr, yr)) in x.chunks(tk).zip(y.chunks_mut(tk)).enumerate() {
        let n = if causal { (r % tq + 1).min(tk) } else { tk };
        let mx = xr[..n]
            .iter()
            .map(|v| v * scale)
            .fold(f64::NEG_INFINITY, f64::max);
        if mx == f64::NEG_INFINITY {
            continue;
        }
        let z: f64 = xr[..n].iter().map(|v| (v * scale - mx).exp()).sum();
        for j in 0..n {
            yr[j] = (xr[j] * scale - mx).exp() / z;
        }
    }
    y
}

#[test]
fn scaled_masked_softmax_matches_the_reference_and_finite_differences() {
    for (tq, tk) in [(4, 4), (3, 6), (6, 2), (1, 1)] {
        for causal in [false, true] {
            let x = randn(&[2, 3, tq, tk], 160, DType::F64);
            let y = x.scaled_masked_softmax(0.7, causal).unwrap();
            let want = masked_softmax_ref(&vals(&x), tq, tk, 0.7, causal);
            assert_close(&vals(&y), &want, 1e-13, 1e-14);
            let yh = x
                .to_dtype(DType::F16)
                .unwrap()
                .scaled_masked_softmax(0.7, causal)
                .unwrap();
            assert_eq!(yh.dtype(), DType::F16);
            assert_close(&vals(&yh), &want, 2e-3, 1e-3);
            check_gradients(&[x], |t| t[0].scaled_masked_softmax(0.7, causal));
        }
    }
    // Masked entries are exactly 0, in the output and in the gradient, whatever the input there.
    let x = t64(&[1.0, f64::NAN, 2.0, 3.0], &[2, 2]).to_variable();
    let y = x.scaled_masked_softmax(1.0, true).unwrap();
    let yv = vals(&y);
    assert_eq!(yv[0], 1.0);
    assert_eq!(yv[1], 0.0);
    let g = t64(&[1.0, f64::INFINITY, 0.5, 0.25], &[2, 2]);
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let gx = vals(&x.grad().unwrap());
    assert_eq!(gx[1], 0.0);
    assert!(gx.iter().all(|v| v.is_finite()));
}

#[test]
fn packed_projection_is_the_three_slices() {
    let (b, t, h, d) = (2usize, 9usize, 3usize, 4usize);
    let qkv = Tensor::randn([b, t, 3, h, d], 0.0, 1.0, 5, DType::F64, Device::Cpu)
        .unwrap()
        .to_variable();
    let o = SdpaOptions {
        causal: true,
        ..Default::default()
    };
    let y = qkv.scaled_dot_product_attention_packed(&o).unwrap();
    let part = |i: usize| {
        qkv.narrow(2, i, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .permute(&[0, 2, 1, 3])
            .unwrap()
    };
    let want = part(0)
        .scaled_dot_product_attention(&part(1), &part(2), &o)
        .unwrap();
    assert_eq!(y.dims(), [b, h, t, d]);
    assert_eq!(y.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    // Not a packed projection: an error, not a panic.
    let flat = Tensor::zeros([b, t, 2, h, d], DType::F64, Device::Cpu).unwrap();
    assert!(flat.scaled_dot_product_attention_packed(&o).is_err());
    assert!(Tensor::zeros([b, t, 3], DType::F64, Device::Cpu)
        .unwrap()
        .scaled_dot_product_attention_packed(&o)
        .is_err());
}
