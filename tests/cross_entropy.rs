//! The fused cross-entropy (`Tensor::cross_entropy_rows`, `nn::cross_entropy_with`) on the CPU:
//! values against a naive f64 reference (label smoothing, ignore_index, every reduction), f64
//! finite-difference gradients, half logits read without an f32 copy (under autocast too), and
//! bad input.

use mixprec::amp::autocast;
use mixprec::nn::{cross_entropy_with, CrossEntropyConfig, Reduction};
use mixprec::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;
const IGNORE: i64 = -100;

fn targets(v: &[i64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), [v.len()], CPU).unwrap()
}

fn cfg(reduction: Reduction, eps: f64, ignore_index: Option<i64>) -> CrossEntropyConfig {
    CrossEntropyConfig {
        reduction,
        label_smoothing: eps,
        ignore_index,
    }
}

/// The naive f64 loss of one row: −Σ_j q_j·log softmax(x)_j with q = (1−ε)·onehot + ε/V.
fn naive_row(x: &[f64], t: usize, eps: f64) -> f64 {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    let v = x.len() as f64;
    x.iter()
        .enumerate()
        .map(|(j, xj)| {
            let q = if j == t { 1.0 - eps } else { 0.0 } + eps / v;
            -q * (xj - lse)
        })
        .sum()
}

/// The naive per-row losses (0 for an ignored row) and the number of rows kept.
fn naive(x: &[f64], c: usize, t: &[i64], eps: f64, ignore: Option<i64>) -> (Vec<f64>, usize) {
    let mut kept = 0;
    let rows = x
        .chunks(c)
        .zip(t)
        .map(|(row, &ti)| {
            if Some(ti) == ignore {
                0.0
            } else {
                kept += 1;
                naive_row(row, ti as usize, eps)
            }
        })
        .collect();
    (rows, kept)
}

fn close(a: f64, b: f64, tol: f64, what: &str) {
    assert!(
        (a - b).abs() <= tol * (1.0 + b.abs()),
        "{what}: {a} vs {b} (tol {tol})"
    );
}

/// Logits `[n, c]` (f64, seeded) and targets with rows 1 and 4 set to IGNORE.
fn case(n: usize, c: usize, seed: u64) -> (Tensor, Vec<i64>) {
    let x = Tensor::randn([n, c], 0.0, 2.0, seed, DType::F64, CPU).unwrap();
    let t = (0..n)
        .map(|i| {
            if i == 1 || i == 4 {
                IGNORE
            } else {
                ((i * 7 + 3) % c) as i64
            }
        })
        .collect();
    (x, t)
}

#[test]
fn values_match_a_naive_f64_reference() {
    let (n, c) = (7, 13);
    let (x, t) = case(n, c, 3);
    let xv = x.to_vec::<f64>().unwrap();
    for eps in [0.0, 0.1, 1.0] {
        for ignore in [Some(IGNORE), Some(3), None] {
            // The -100 rows get the ignore_index in force (class 0 without one; with 3, the
            // rows whose class is 3 are ignored too).
            let tt: Vec<i64> = t
                .iter()
                .map(|&v| if v == IGNORE { ignore.unwrap_or(0) } else { v })
                .collect();
            let y = targets(&tt);
            let (rows, kept) = naive(&xv, c, &tt, eps, ignore);
            let what = format!("eps {eps} ignore {ignore:?}");
            let none = cross_entropy_with(&x, &y, cfg(Reduction::None, eps, ignore)).unwrap();
            assert_eq!(none.dtype(), DType::F64);
            assert_eq!(none.dims(), &[n]);
            for (i, (g, w)) in none.to_vec::<f64>().unwrap().iter().zip(&rows).enumerate() {
                close(*g, *w, 1e-13, &format!("{what} row {i}"));
            }
            let sum = cross_entropy_with(&x, &y, cfg(Reduction::Sum, eps, ignore)).unwrap();
            assert_eq!(sum.rank(), 0);
            close(
                sum.item().unwrap(),
                rows.iter().sum::<f64>(),
                1e-13,
                &format!("{what} sum"),
            );
            let mean = cross_entropy_with(&x, &y, cfg(Reduction::Mean, eps, ignore)).unwrap();
            assert_eq!(mean.rank(), 0);
            close(
                mean.item().unwrap(),
                rows.iter().sum::<f64>() / kept as f64,
                1e-13,
                &format!("{what} mean over {kept} kept rows"),
            );
        }
    }
}

#[test]
fn every_row_ignored_gives_nan_mean_zero_sum_and_zero_gradient() {
    let x = Tensor::randn([3, 5], 0.0, 1.0, 9, DType::F32, CPU)
        .unwrap()
        .to_variable();
    let y = targets(&[IGNORE; 3]);
    let mean = cross_entropy_with(&x, &y, cfg(Reduction::Mean, 0.1, Some(IGNORE))).unwrap();
    assert!(mean.item().unwrap().is_nan(), "PyTorch gives NaN");
    let sum = cross_entropy_with(&x, &y, cfg(Reduction::Sum, 0.1, Some(IGNORE))).unwrap();
    assert_eq!(sum.item().unwrap(), 0.0);
    sum.backward().unwrap();
    assert!(x
        .grad()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&g| g == 0.0));
}

#[test]
fn f64_gradients_match_finite_differences() {
    let (n, c) = (6, 5);
    let (base, t) = case(n, c, 42);
    let y = targets(&t);
    let vals = base.to_vec::<f64>().unwrap();
    // Per-row weights so that Reduction::None's rows get different gradients.
    let w = Tensor::from_vec((0..n).map(|i| 0.5 + i as f64).collect::<Vec<_>>(), [n], CPU).unwrap();
    let loss_of = |x: &Tensor, eps: f64, red: Reduction| {
        let l = cross_entropy_with(x, &y, cfg(red, eps, Some(IGNORE))).unwrap();
        match red {
            Reduction::None => l.mul(&w).unwrap().sum_all().unwrap(),
            _ => l,
        }
    };
    for (eps, red) in [
        (0.0, Reduction::Mean),
        (0.2, Reduction::Mean),
        (0.3, Reduction::Sum),
        (0.1, Reduction::None),
    ] {
        let x = base.detach().to_variable();
        loss_of(&x, eps, red).backward().unwrap();
        let grad = x.grad().unwrap();
        assert_eq!(grad.dtype(), DType::F64);
        let grad = grad.to_vec::<f64>().unwrap();
        let h = 1e-6;
        for i in 0..n * c {
            let f = |d: f64| {
                let mut v = vals.clone();
                v[i] += d;
                let t = Tensor::from_vec(v, [n, c], CPU).unwrap();
                loss_of(&t, eps, red).item().unwrap()
            };
            let fd = (f(h) - f(-h)) / (2.0 * h);
            assert!(
                (fd - grad[i]).abs() < 1e-7,
                "eps {eps} {red:?} element {i}: autograd {} vs finite difference {fd}",
                grad[i]
            );
            if i / c == 1 || i / c == 4 {
                assert_eq!(grad[i], 0.0, "an ignored row has no gradient");
            }
        }
    }
}

/// The f64 gradient of the mean loss by formula: (softmax − (1−ε)·onehot − ε/V)/kept.
fn naive_grad(x: &[f64], c: usize, t: &[i64], eps: f64, kept: usize) -> Vec<f64> {
    let mut g = vec![0.0; x.len()];
    for (r, row) in x.chunks(c).enumerate() {
        if t[r] == IGNORE {
            continue;
        }
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        for (j, xj) in row.iter().enumerate() {
            let hot = if j as i64 == t[r] { 1.0 - eps } else { 0.0 };
            g[r * c + j] = ((xj - lse).exp() - hot - eps / c as f64) / kept as f64;
        }
    }
    g
}

#[test]
fn half_logits_compute_in_f32_and_get_gradients_of_their_dtype() {
    let (n, c) = (9, 300);
    let (x64, t) = case(n, c, 5);
    let y = targets(&t);
    for d in [DType::F16, DType::BF16, DType::F32] {
        let x = x64.to_dtype(d).unwrap().to_variable();
        // The reference sees the logits as rounded to `d`.
        let xv = x.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        for eps in [0.0, 0.1] {
            let (rows, kept) = naive(&xv, c, &t, eps, Some(IGNORE));
            let want = rows.iter().sum::<f64>() / kept as f64;
            x.zero_grad();
            let loss = cross_entropy_with(&x, &y, cfg(Reduction::Mean, eps, Some(IGNORE))).unwrap();
            assert_eq!(loss.dtype(), DType::F32, "{d}: f32 math, an f32 loss");
            close(loss.item().unwrap(), want, 1e-6, &format!("{d} eps {eps}"));
            loss.backward().unwrap();
            let g = x.grad().unwrap();
            assert_eq!(g.dtype(), d, "a grad has its variable's dtype");
            let want_g = naive_grad(&xv, c, &t, eps, kept);
            let got_g = g.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
            // One rounding to d of each gradient value (f32 math): a relative bound per value
            // plus a floor for values near 0.
            let rel = match d {
                DType::F16 => 1e-3,
                DType::BF16 => 8e-3,
                _ => 1e-5,
            };
            let scale = 1.0 / (kept as f64 * c as f64);
            for (i, (a, b)) in got_g.iter().zip(&want_g).enumerate() {
                assert!(
                    (a - b).abs() <= rel * (b.abs() + scale),
                    "{d} eps {eps} element {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn half_logits_are_saved_as_they_are_not_copied_to_f32() {
    let (x64, t) = case(8, 50, 11);
    let y = targets(&t);
    for d in [DType::F16, DType::BF16] {
        let x = x64.to_dtype(d).unwrap().to_variable();
        assert_eq!(x.storage_handle_count(), 1);
        for under_autocast in [false, true] {
            let _scope = under_autocast.then(|| autocast::autocast(d).unwrap());
            let rows = x.cross_entropy_rows(&y, 0.1, Some(IGNORE)).unwrap();
            assert_eq!(rows.loss.dtype(), DType::F32, "{d}");
            let kept = rows.kept.as_ref().expect("an ignore_index gives the count");
            assert_eq!(kept.rank(), 0);
            assert_eq!(kept.item().unwrap(), 6.0);
            // The graph node keeps the caller's own half buffer (one more handle on it): an f32
            // copy of the logits, had one been made, would be what it kept instead.
            assert_eq!(
                x.storage_handle_count(),
                2,
                "{d}, autocast {under_autocast}: the node saves the half logits themselves"
            );
            let loss = cross_entropy_with(&x, &y, CrossEntropyConfig::default());
            // Without an ignore_index, -100 is out of range.
            assert!(loss.is_err());
            drop(rows);
            assert_eq!(x.storage_handle_count(), 1, "{d}: the node let go of them");
        }
    }
}

#[test]
fn a_strided_view_of_logits_gives_its_logical_rows() {
    let (x64, t) = case(6, 4, 21);
    let y = targets(&t);
    // [c, n] transposed to a non-contiguous [n, c] view of the same values.
    let xt = x64.transpose(0, 1).unwrap().contiguous().unwrap();
    let view = xt.transpose(0, 1).unwrap();
    let c = cfg(Reduction::None, 0.2, Some(IGNORE));
    let a = cross_entropy_with(&x64, &y, c)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let b = cross_entropy_with(&view, &y, c)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_input_is_an_error_naming_the_operands() {
    let x = Tensor::zeros([2, 3], DType::F32, CPU).unwrap();
    let c = cfg(Reduction::Mean, 0.0, None);
    // Out of range, with and without an ignore_index.
    let e = cross_entropy_with(&x, &targets(&[0, 3]), c).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { name: "target", .. }),
        "{e}"
    );
    assert!(e.to_string().contains("0..3"), "{e}");
    let e = cross_entropy_with(
        &x,
        &targets(&[-1, 0]),
        cfg(Reduction::Sum, 0.0, Some(IGNORE)),
    )
    .unwrap_err();
    assert!(e.to_string().contains("ignore_index -100"), "{e}");
    // The ignore_index itself may lie outside the classes.
    cross_entropy_with(
        &x,
        &targets(&[IGNORE, 2]),
        cfg(Reduction::Sum, 0.0, Some(IGNORE)),
    )
    .unwrap();
    // Shapes and dtypes.
    let flat = Tensor::zeros([6], DType::F32, CPU).unwrap();
    assert!(matches!(
        cross_entropy_with(&flat, &targets(&[0]), c),
        Err(Error::InvalidShape { .. })
    ));
    let cube = Tensor::zeros([2, 3, 1], DType::F32, CPU).unwrap();
    assert!(cross_entropy_with(&cube, &targets(&[0, 0]), c).is_err());
    let no_classes = Tensor::zeros([2, 0], DType::F32, CPU).unwrap();
    assert!(cross_entropy_with(&no_classes, &targets(&[0, 0]), c).is_err());
    assert!(matches!(
        cross_entropy_with(&x, &targets(&[0, 1, 2]), c),
        Err(Error::ShapeMismatch { .. })
    ));
    let float_targets = Tensor::from_vec(vec![2.0f32, 0.0], [2], CPU).unwrap();
    assert!(matches!(
        cross_entropy_with(&x, &float_targets, c),
        Err(Error::UnsupportedDType { .. })
    ));
    let int_logits = Tensor::from_vec(vec![0i64; 6], [2, 3], CPU).unwrap();
    assert!(matches!(
        cross_entropy_with(&int_logits, &targets(&[0, 0]), c),
        Err(Error::UnsupportedDType { .. })
    ));
    for eps in [-0.1, 1.5, f64::NAN] {
        let e =
            cross_entropy_with(&x, &targets(&[0, 0]), cfg(Reduction::Mean, eps, None)).unwrap_err();
        assert!(e.to_string().contains("label_smoothing"), "{e}");
    }
}
