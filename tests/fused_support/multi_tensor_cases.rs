//! Cases shared by tests/multi_tensor.rs (CPU) and tests/cuda.rs (GPU): each takes the device.
#![allow(dead_code)]

use super::fused_support::{round_to, tensor};
use mixprec::multi_tensor::{self, AxpbyCheck, ScaleRule, ScalerDeviceState};
use mixprec::{DType, Device, Tensor};

pub const CHUNK: usize = mixprec::backend::MT_CHUNK;
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Lists to fuzz: one tensor of each size around the chunk size, and 55 tensors of mixed sizes.
pub fn lists() -> Vec<Vec<usize>> {
    let mut v: Vec<Vec<usize>> = [CHUNK - 1, CHUNK, CHUNK + 1, 1, 2 * CHUNK + 3]
        .iter()
        .map(|&n| vec![n])
        .collect();
    v.push(
        (0..55)
            .map(|i| [1, 7, CHUNK - 1, 300, CHUNK + 1, 4096][i % 6] + i)
            .collect(),
    );
    v
}

fn make(sizes: &[usize], dt: DType, seed: u64, dev: Device) -> Vec<Tensor> {
    sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| tensor(seed + k as u64, &[n], dt, dev))
        .collect()
}

fn plant(ts: &mut [Tensor], at: usize, bad: f64) {
    let k = match at {
        0 => 0,
        1 => ts.len() / 2,
        _ => ts.len() - 1,
    };
    let mut v = ts[k].to_vec_f64().unwrap();
    let i = match at {
        0 => 0,
        1 => v.len() / 2,
        _ => v.len() - 1,
    };
    v[i] = bad;
    let dt = ts[k].dtype();
    ts[k] = Tensor::from_vec(v, ts[k].dims().to_vec(), ts[k].device())
        .unwrap()
        .to_dtype(dt)
        .unwrap();
}

pub fn scale_cases(dev: Device) {
    for sizes in lists() {
        for din in DTYPES {
            for dout in DTYPES {
                let x = make(&sizes, din, 1, dev);
                let out: Vec<Tensor> = sizes
                    .iter()
                    .map(|&n| Tensor::zeros([n], dout, dev).unwrap())
                    .collect();
                let s = Tensor::scalar(0.375, DType::F32, dev).unwrap();
                let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
                multi_tensor::scale(&x, &out, &s, &f).unwrap();
                assert_eq!(f.item().unwrap(), 0.0);
                for (a, b) in x.iter().zip(&out) {
                    let want: Vec<f64> = a
                        .to_vec_f64()
                        .unwrap()
                        .iter()
                        .map(|v| round_to(dout, (*v as f32 * 0.375) as f64))
                        .collect();
                    assert_eq!(
                        b.to_vec_f64().unwrap(),
                        want,
                        "scale {din}→{dout} sizes {}",
                        sizes.len()
                    );
                }
                // In place, with a planted Inf/NaN: flagged; the flag is never reset.
                for (at, bad) in [(0, f64::INFINITY), (1, f64::NAN), (2, f64::NEG_INFINITY)] {
                    let mut y = make(&sizes, din, 2, dev);
                    plant(&mut y, at, bad);
                    let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
                    multi_tensor::scale(&y, &y, &s, &f).unwrap();
                    assert_eq!(f.item().unwrap(), 1.0, "{bad} at {at} in {din}");
                    let clean = make(&sizes, din, 3, dev);
                    multi_tensor::scale(&clean, &clean, &s, &f).unwrap();
                    assert_eq!(f.item().unwrap(), 1.0, "found_inf is never reset");
                    let f2 = Tensor::scalar(0.0, DType::F32, dev).unwrap();
                    let mut z = make(&sizes, din, 4, dev);
                    plant(&mut z, at, bad);
                    multi_tensor::non_finite_check(&z, &f2).unwrap();
                    assert_eq!(f2.item().unwrap(), 1.0);
                }
            }
        }
    }
}

/// `zero`: every element of every listed tensor becomes +0 (Inf and NaN too), lists of mixed
/// dtypes in one call, sizes around the chunk size; a dense view zeroes only its span.
pub fn zero_cases(dev: Device) {
    for sizes in lists() {
        let mut ts: Vec<Tensor> = DTYPES
            .iter()
            .enumerate()
            .flat_map(|(k, &dt)| make(&sizes, dt, 10 + k as u64, dev))
            .collect();
        plant(&mut ts, 0, f64::NAN);
        plant(&mut ts, 2, f64::INFINITY);
        multi_tensor::zero(&ts).unwrap();
        for t in &ts {
            let v = t.to_vec_f64().unwrap();
            assert!(
                v.iter().all(|&x| x == 0.0 && x.is_sign_positive()),
                "zero {} of {}",
                t.dtype(),
                v.len()
            );
        }
    }
    let flat = make(&[3 * CHUNK + 5], DType::F16, 20, dev).remove(0);
    let before = flat.to_vec_f64().unwrap();
    let (at, n) = (CHUNK - 3, CHUNK + 7);
    multi_tensor::zero(&[flat.narrow(0, at, n).unwrap()]).unwrap();
    let after = flat.to_vec_f64().unwrap();
    for (i, (&b, &a)) in before.iter().zip(&after).enumerate() {
        let want = if (at..at + n).contains(&i) { 0.0 } else { b };
        assert_eq!(a, want, "element {i} of the buffer a view of it was zeroed");
    }
}

pub fn axpby_cases(dev: Device) {
    for sizes in lists() {
        for (dx, dy, dout) in [
            (DType::F32, DType::F32, DType::F32),
            (DType::F16, DType::F32, DType::F16),
            (DType::BF16, DType::F16, DType::F32),
        ] {
            let x = make(&sizes, dx, 10, dev);
            let y = make(&sizes, dy, 20, dev);
            let out: Vec<Tensor> = sizes
                .iter()
                .map(|&n| Tensor::zeros([n], dout, dev).unwrap())
                .collect();
            let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
            multi_tensor::axpby(2.0, &x, -0.5, &y, &out, &f, AxpbyCheck::Both).unwrap();
            assert_eq!(f.item().unwrap(), 0.0);
            for k in 0..sizes.len() {
                let (a, b) = (x[k].to_vec_f64().unwrap(), y[k].to_vec_f64().unwrap());
                let want: Vec<f64> = a
                    .iter()
                    .zip(&b)
                    .map(|(p, q)| {
                        round_to(dout, (2.0f32 * *p as f32 + (-0.5f32) * *q as f32) as f64)
                    })
                    .collect();
                assert_eq!(out[k].to_vec_f64().unwrap(), want);
            }
            // A bad y is flagged by Y and Both, not by X.
            let mut yb = y.clone();
            plant(&mut yb, 1, f64::NAN);
            for (check, flagged) in [
                (AxpbyCheck::X, 0.0),
                (AxpbyCheck::Y, 1.0),
                (AxpbyCheck::Both, 1.0),
            ] {
                let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
                multi_tensor::axpby(1.0, &x, 1.0, &yb, &out, &f, check).unwrap();
                assert_eq!(f.item().unwrap(), flagged, "{check:?}");
            }
        }
    }
}

pub fn norm_cases(dev: Device) {
    for sizes in lists() {
        for dt in DTYPES {
            let x = make(&sizes, dt, 30, dev);
            let (total, per) = multi_tensor::l2norm(&x, true).unwrap();
            let per = per.unwrap().to_vec_f64().unwrap();
            let mut sum = 0.0;
            for (k, t) in x.iter().enumerate() {
                let s: f64 = t.to_vec_f64().unwrap().iter().map(|v| v * v).sum();
                sum += s;
                assert!(
                    (per[k] - s.sqrt()).abs() <= 1e-5 * s.sqrt(),
                    "per-tensor norm {k} {dt}"
                );
            }
            assert!((total.item().unwrap() - sum.sqrt()).abs() <= 1e-5 * sum.sqrt());
            let (t2, p2) = multi_tensor::l2norm(&x, false).unwrap();
            assert!(p2.is_none());
            assert_eq!(
                t2.item().unwrap(),
                total.item().unwrap(),
                "same order, same value"
            );
            // Unscaled: the norm of x·inv, and the overflow flag in the same pass.
            let inv = Tensor::scalar(0.25, DType::F32, dev).unwrap();
            let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
            let (u, _) = multi_tensor::unscale_l2norm(&x, &inv, &f, false).unwrap();
            assert!((u.item().unwrap() - 0.25 * sum.sqrt()).abs() <= 1e-5 * sum.sqrt());
            assert_eq!(f.item().unwrap(), 0.0);
            let mut xb = x.clone();
            plant(&mut xb, 2, f64::INFINITY);
            multi_tensor::unscale_l2norm(&xb, &inv, &f, true).unwrap();
            assert_eq!(f.item().unwrap(), 1.0);
        }
    }
    let (z, p) = multi_tensor::l2norm(&[], true).unwrap();
    assert_eq!(z.item().unwrap(), 0.0);
    assert_eq!(p.unwrap().elem_count(), 0);
}

pub fn update_scale_cases(dev: Device) {
    let s = |v: f64| Tensor::scalar(v, DType::F32, dev).unwrap();
    let (scale, found, unsk, skipped) = (s(65536.0), s(0.0), s(0.0), s(0.0));
    let run = |f: f64| {
        found.set_data(&s(f)).unwrap();
        multi_tensor::amp_update_scale(
            ScalerDeviceState {
                scale: &scale,
                found_inf: &found,
                unskipped: &unsk,
                skipped_total: &skipped,
            },
            ScaleRule {
                growth: 2.0,
                backoff: 0.5,
                window: 3,
                min: 1.0,
                max: 2f64.powi(24),
            },
        )
        .unwrap();
        assert_eq!(found.item().unwrap(), 0.0, "found_inf is cleared");
        (
            scale.item().unwrap(),
            unsk.item().unwrap(),
            skipped.item().unwrap(),
        )
    };
    assert_eq!(run(0.0), (65536.0, 1.0, 0.0));
    assert_eq!(run(0.0), (65536.0, 2.0, 0.0));
    assert_eq!(
        run(0.0),
        (131072.0, 0.0, 0.0),
        "grows after `window` clean steps"
    );
    assert_eq!(run(1.0), (65536.0, 0.0, 1.0), "backs off on overflow");
    assert_eq!(run(0.0), (65536.0, 1.0, 1.0));
    assert_eq!(
        run(1.0),
        (32768.0, 0.0, 2.0),
        "an overflow resets the clean count"
    );
    for _ in 0..30 {
        run(1.0);
    }
    assert_eq!(scale.item().unwrap(), 1.0, "clamped to min");
    scale.set_data(&s(2f64.powi(24))).unwrap();
    for _ in 0..3 {
        run(0.0);
    }
    assert_eq!(scale.item().unwrap(), 2f64.powi(24), "clamped to max");
}

pub fn error_cases(dev: Device) {
    let x = make(&[10, 20], DType::F32, 1, dev);
    let s = Tensor::scalar(1.0, DType::F32, dev).unwrap();
    let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
    let e = multi_tensor::scale(&x, &x[..1], &s, &f)
        .unwrap_err()
        .to_string();
    assert!(e.contains("scale") && e.contains("outputs"), "{e}");
    let y = make(&[10, 21], DType::F32, 1, dev);
    let e = multi_tensor::scale(&x, &y, &s, &f).unwrap_err().to_string();
    assert!(e.contains("tensor 1"), "{e}");
    let bad = Tensor::zeros([2], DType::F32, dev).unwrap();
    let e = multi_tensor::scale(&x, &x, &bad, &f)
        .unwrap_err()
        .to_string();
    assert!(e.contains("scale") && e.contains("[2]"), "{e}");
    let i = vec![Tensor::zeros([3], DType::I64, dev).unwrap()];
    assert!(multi_tensor::non_finite_check(&i, &f).is_err());
    let rule = ScaleRule {
        growth: 2.0,
        backoff: 0.5,
        window: 10,
        min: 1.0,
        max: 10.0,
    };
    let shared = ScalerDeviceState {
        scale: &s,
        found_inf: &f,
        unskipped: &s,
        skipped_total: &f,
    };
    let e = multi_tensor::amp_update_scale(shared, rule)
        .unwrap_err()
        .to_string();
    assert!(e.contains("share"), "{e}");
    let t = |v| Tensor::scalar(v, DType::F32, dev).unwrap();
    let (a, b, c, d) = (t(1.0), t(0.0), t(0.0), t(0.0));
    let state = ScalerDeviceState {
        scale: &a,
        found_inf: &b,
        unskipped: &c,
        skipped_total: &d,
    };
    let e = multi_tensor::amp_update_scale(state, ScaleRule { window: 0, ..rule })
        .unwrap_err()
        .to_string();
    assert!(e.contains("window"), "{e}");
}

/// Dense views of one buffer (parts of a flat bucket, at unaligned offsets) as outputs and as
/// inputs: each part gets exactly its tensor's values, the gaps between parts stay untouched;
/// strided views and partly overlapping views are refused.
pub fn view_cases(dev: Device) {
    for sizes in lists() {
        for (din, dout) in [
            (DType::F16, DType::F16),
            (DType::F16, DType::F32),
            (DType::F32, DType::BF16),
        ] {
            let x = make(&sizes, din, 5, dev);
            // Part k starts 3 elements after part k-1 ends.
            let mut starts = Vec::new();
            let mut len = 1;
            for &n in &sizes {
                starts.push(len);
                len += n + 3;
            }
            let flat = Tensor::zeros([len], dout, dev).unwrap();
            let parts: Vec<Tensor> = starts
                .iter()
                .zip(&sizes)
                .map(|(&at, &n)| flat.narrow(0, at, n).unwrap())
                .collect();
            let s = Tensor::scalar(0.5, DType::F32, dev).unwrap();
            let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
            multi_tensor::scale(&x, &parts, &s, &f).unwrap();
            let got = flat.to_vec_f64().unwrap();
            let mut want = vec![0.0; len];
            for ((a, &at), &n) in x.iter().zip(&starts).zip(&sizes) {
                let v = a.to_vec_f64().unwrap();
                for i in 0..n {
                    want[at + i] = round_to(dout, (v[i] as f32 * 0.5) as f64);
                }
            }
            assert_eq!(got, want, "{din}→{dout}, {} parts", sizes.len());
            // Back out of the views into whole buffers.
            let back: Vec<Tensor> = sizes
                .iter()
                .map(|&n| Tensor::zeros([n], din, dev).unwrap())
                .collect();
            let two = Tensor::scalar(2.0, DType::F32, dev).unwrap();
            multi_tensor::scale(&parts, &back, &two, &f).unwrap();
            for ((b, p), &n) in back.iter().zip(&parts).zip(&sizes) {
                let want: Vec<f64> = p
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .map(|v| round_to(din, (*v as f32 * 2.0) as f64))
                    .collect();
                assert_eq!(b.to_vec_f64().unwrap(), want, "{din}←{dout}, part of {n}");
            }
            assert_eq!(f.item().unwrap(), 0.0);
        }
    }
    let f = Tensor::scalar(0.0, DType::F32, dev).unwrap();
    let s = Tensor::scalar(1.0, DType::F32, dev).unwrap();
    let grid = Tensor::zeros([4, 6], DType::F32, dev).unwrap();
    let column = grid.narrow(1, 2, 1).unwrap();
    let x = make(&[4], DType::F32, 6, dev);
    let e = multi_tensor::scale(&x, &[column.reshape(vec![4]).unwrap()], &s, &f);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("strided view") && e.contains("dense"), "{e}");
    let flat = Tensor::zeros([30], DType::F32, dev).unwrap();
    let (a, b) = (
        flat.narrow(0, 0, 10).unwrap(),
        flat.narrow(0, 5, 10).unwrap(),
    );
    let x = make(&[10, 10], DType::F32, 7, dev);
    let e = multi_tensor::scale(&x, &[a, b], &s, &f)
        .unwrap_err()
        .to_string();
    assert!(e.contains("0..10") && e.contains("5..15"), "{e}");
}
