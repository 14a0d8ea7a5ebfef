//! Layer norm and RMS norm over the last dim(s): forward against an f64 reference, gradients by
//! finite differences (f64), half inputs (with half or f32 parameters) against f64, autocast's
//! class, errors, and the nn layers' parameters.

mod common;

use common::*;
use mixprec::nn::{LayerNorm, Module, RMSNorm};
use mixprec::{amp, DType, Tensor};

/// The norm of each row of `cols` values of `x`, in f64: layer norm (`rms` false) or RMS norm.
fn norm_ref(
    x: &[f64],
    cols: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
    rms: bool,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        let n = cols as f64;
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f64>() / n
        };
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        for (j, v) in row.iter().enumerate() {
            let mut h = (v - mean) / (var + eps).sqrt();
            if let Some(w) = w {
                h *= w[j];
            }
            if let Some(b) = b {
                h += b[j];
            }
            out.push(h);
        }
    }
    out
}

#[test]
fn forward_matches_the_f64_reference() {
    let x = randn(&[2, 3, 4, 5], 1, DType::F64)
        .affine(2.0, 0.5)
        .unwrap();
    let xv = vals(&x);
    for ns in [&[5usize][..], &[4, 5], &[3, 4, 5]] {
        let cols: usize = ns.iter().product();
        let w = randn(ns, 2, DType::F64);
        let b = randn(ns, 3, DType::F64);
        let (wv, bv) = (vals(&w), vals(&b));
        let y = x.layer_norm(ns, Some(&w), Some(&b), 1e-5).unwrap();
        assert_eq!(y.dims(), x.dims());
        assert_close(
            &vals(&y),
            &norm_ref(&xv, cols, Some(&wv), Some(&bv), 1e-5, false),
            1e-12,
            1e-12,
        );
        let y = x.layer_norm(ns, None, None, 1e-3).unwrap();
        assert_close(
            &vals(&y),
            &norm_ref(&xv, cols, None, None, 1e-3, false),
            1e-12,
            1e-12,
        );
        let y = x.rms_norm(ns, Some(&w), 1e-6).unwrap();
        assert_close(
            &vals(&y),
            &norm_ref(&xv, cols, Some(&wv), None, 1e-6, true),
            1e-12,
            1e-12,
        );
        // f32 computes in f32.
        let y32 = x
            .to_dtype(DType::F32)
            .unwrap()
            .layer_norm(
                ns,
                Some(&w.to_dtype(DType::F32).unwrap()),
                Some(&b.to_dtype(DType::F32).unwrap()),
                1e-5,
            )
            .unwrap();
        assert_eq!(y32.dtype(), DType::F32);
        assert_close(
            &vals(&y32),
            &norm_ref(&xv, cols, Some(&wv), Some(&bv), 1e-5, false),
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn strided_inputs_normalise_their_logical_rows() {
    // A transposed view: rows of the logical [4, 6] tensor are columns in memory.
    let base = randn(&[6, 4], 4, DType::F64);
    let x = base.transpose(0, 1).unwrap();
    let w = randn(&[6], 5, DType::F64);
    let y = x.layer_norm(&[6], Some(&w), None, 1e-5).unwrap();
    let want = norm_ref(&vals(&x), 6, Some(&vals(&w)), None, 1e-5, false);
    assert_close(&vals(&y), &want, 1e-12, 1e-12);
}

#[test]
fn gradients_match_finite_differences() {
    check_gradients(
        &[
            randn(&[3, 2, 5], 6, DType::F64),
            randn(&[5], 7, DType::F64),
            randn(&[5], 8, DType::F64),
        ],
        |t| t[0].layer_norm(&[5], Some(&t[1]), Some(&t[2]), 1e-5),
    );
    check_gradients(
        &[
            randn(&[2, 3, 4], 9, DType::F64),
            randn(&[3, 4], 10, DType::F64),
        ],
        |t| t[0].layer_norm(&[3, 4], Some(&t[1]), None, 1e-5),
    );
    check_gradients(
        &[randn(&[4, 7], 11, DType::F64), randn(&[7], 12, DType::F64)],
        |t| t[0].rms_norm(&[7], Some(&t[1]), 1e-5),
    );
    check_gradients(
        &[randn(&[4, 7], 13, DType::F64), randn(&[7], 14, DType::F64)],
        |t| {
            // Only a bias.
            t[0].layer_norm(&[7], None, Some(&t[1]), 1e-5)
        },
    );
    check_gradients(&[randn(&[5, 3], 15, DType::F64)], |t| {
        t[0].rms_norm(&[3], None, 1e-5)
    });
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn half_inputs_with_half_or_f32_parameters_stay_near_f64() {
    let x64 = randn(&[8, 64], 16, DType::F64).affine(3.0, 1.0).unwrap();
    let w64 = randn(&[64], 17, DType::F64);
    let b64 = randn(&[64], 18, DType::F64);
    let g64 = randn(&[8, 64], 19, DType::F64);
    for (dt, bound) in [(DType::F16, 2e-3), (DType::BF16, 1.6e-2)] {
        for pdt in [dt, DType::F32] {
            // The reference sees the same rounded inputs.
            let round = |t: &Tensor, d: DType| t.to_dtype(d).unwrap().to_dtype(DType::F64).unwrap();
            let (xr, wr, br) = (round(&x64, dt), round(&w64, pdt), round(&b64, pdt));
            let gr = round(&g64, dt);
            let run = |x: &Tensor, w: &Tensor, b: &Tensor, g: &Tensor| {
                let (x, w, b) = (x.to_variable(), w.to_variable(), b.to_variable());
                let y = x.layer_norm(&[64], Some(&w), Some(&b), 1e-5).unwrap();
                y.mul(g).unwrap().sum_all().unwrap().backward().unwrap();
                (y, x.grad().unwrap(), w.grad().unwrap(), b.grad().unwrap())
            };
            let (y, dx, dw, db) = run(
                &x64.to_dtype(dt).unwrap(),
                &w64.to_dtype(pdt).unwrap(),
                &b64.to_dtype(pdt).unwrap(),
                &g64.to_dtype(dt).unwrap(),
            );
            assert_eq!(
                (y.dtype(), dx.dtype(), dw.dtype(), db.dtype()),
                (dt, dt, pdt, pdt)
            );
            let (yr, dxr, dwr, dbr) = run(&xr, &wr, &br, &gr);
            for (what, got, want) in [
                ("y", &y, &yr),
                ("dx", &dx, &dxr),
                ("dw", &dw, &dwr),
                ("db", &db, &dbr),
            ] {
                let e = rel(&vals(got), &vals(want));
                assert!(e < bound, "{dt} params {pdt} {what}: relative error {e}");
            }
        }
    }
}

#[test]
fn autocast_runs_norms_in_f32() {
    let x = randn(&[4, 16], 20, DType::F16);
    let w = randn(&[16], 21, DType::F32);
    let _s = amp::autocast::autocast(DType::F16).unwrap();
    let y = x.layer_norm(&[16], Some(&w), None, 1e-5).unwrap();
    assert_eq!(
        y.dtype(),
        DType::F32,
        "layer_norm is an f32-class op under autocast"
    );
    assert_eq!(x.rms_norm(&[16], None, 1e-5).unwrap().dtype(), DType::F32);
}

#[test]
fn bad_operands_are_errors() {
    let x = randn(&[2, 3, 4], 22, DType::F32);
    let w = randn(&[4], 23, DType::F32);
    for (ns, what) in [
        (&[3usize][..], "not the last dims"),
        (&[], "empty"),
        (&[1, 2, 3, 4], "longer than the input"),
    ] {
        let e = x.layer_norm(ns, None, None, 1e-5).unwrap_err().to_string();
        assert!(e.contains("normalized_shape"), "{what}: {e}");
    }
    let e = x
        .layer_norm(&[4], Some(&randn(&[3], 1, DType::F32)), None, 1e-5)
        .unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
    let e = x.layer_norm(&[4], Some(&w), None, -1.0).unwrap_err();
    assert!(e.to_string().contains("eps"), "{e}");
    // f16 parameters of an f32 input.
    let e = x
        .layer_norm(&[4], Some(&w.to_dtype(DType::F16).unwrap()), None, 1e-5)
        .unwrap_err();
    assert!(e.to_string().contains("f16"), "{e}");
    // Weight and bias of different dtypes.
    let xh = x.to_dtype(DType::BF16).unwrap();
    let e = xh
        .layer_norm(
            &[4],
            Some(&w),
            Some(&w.to_dtype(DType::BF16).unwrap()),
            1e-5,
        )
        .unwrap_err();
    assert!(e.to_string().contains("layer_norm"), "{e}");
    assert!(ti64(&[1, 2], &[2])
        .layer_norm(&[2], None, None, 1e-5)
        .is_err());
}

#[test]
fn modules_have_pytorchs_parameters() {
    let ln = LayerNorm::new(&[8], &CPU).unwrap();
    let names: Vec<String> = ln
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["weight", "bias"]);
    assert_eq!(vals(ln.weight.as_ref().unwrap()), vec![1.0; 8]);
    assert_eq!(vals(ln.bias.as_ref().unwrap()), vec![0.0; 8]);
    let x = randn(&[3, 8], 24, DType::F32);
    let want = x.layer_norm(&[8], None, None, 1e-5).unwrap();
    assert_close(&vals(&ln.forward(&x).unwrap()), &vals(&want), 1e-6, 1e-6);
    let rms = RMSNorm::new(&[8], &CPU).unwrap();
    let names: Vec<String> = rms
        .state_dict()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["weight"]);
    assert!(LayerNorm::with_config(&[8], 1e-5, false, true, &CPU)
        .unwrap()
        .state_dict()
        .unwrap()
        .is_empty());
    assert!(LayerNorm::new(&[], &CPU).is_err());
}
