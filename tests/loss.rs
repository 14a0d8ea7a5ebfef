//! Losses: values against hand computations, reductions, label smoothing, an F64
//! finite-difference gradient check, FP32 computation for half inputs, and bad input.

use mixprec::nn::{cross_entropy, cross_entropy_with, mse_loss, CrossEntropyConfig, Reduction};
use mixprec::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn logits() -> Tensor {
    Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 1.0, 1.0, 1.0], [2, 3], CPU).unwrap()
}

fn targets(v: &[i64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), [v.len()], CPU).unwrap()
}

/// Per-sample loss by hand: (1−ε)(lse − x_t) + ε(lse − mean(x)).
fn by_hand(x: &[f64], t: usize, eps: f64) -> f64 {
    let lse = x.iter().map(|v| v.exp()).sum::<f64>().ln();
    let mean = x.iter().sum::<f64>() / x.len() as f64;
    (1.0 - eps) * (lse - x[t]) + eps * (lse - mean)
}

fn close(a: f64, b: f64, tol: f64) {
    assert!((a - b).abs() <= tol, "{a} vs {b}");
}

#[test]
fn cross_entropy_values_and_reductions() {
    let x = logits();
    let y = targets(&[2, 0]);
    let rows = [[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]];
    // −log softmax: row 0 → log(1 + e⁻¹ + e⁻²), row 1 → log 3.
    let l0 = (1.0 + (-1.0f64).exp() + (-2.0f64).exp()).ln();
    let l1 = 3.0f64.ln();
    close(by_hand(&rows[0], 2, 0.0), l0, 1e-15);
    close(by_hand(&rows[1], 0, 0.0), l1, 1e-15);

    let mean = cross_entropy(&x, &y).unwrap();
    assert_eq!(mean.dtype(), DType::F64);
    assert_eq!(mean.rank(), 0);
    close(mean.item().unwrap(), (l0 + l1) / 2.0, 1e-12);

    for eps in [0.0, 0.1, 0.5] {
        let want = [by_hand(&rows[0], 2, eps), by_hand(&rows[1], 0, eps)];
        let cfg = |reduction| CrossEntropyConfig {
            reduction,
            label_smoothing: eps,
            ..Default::default()
        };
        let none = cross_entropy_with(&x, &y, cfg(Reduction::None)).unwrap();
        assert_eq!(none.dims(), &[2]);
        let v = none.to_vec::<f64>().unwrap();
        close(v[0], want[0], 1e-12);
        close(v[1], want[1], 1e-12);
        let sum = cross_entropy_with(&x, &y, cfg(Reduction::Sum)).unwrap();
        close(sum.item().unwrap(), want[0] + want[1], 1e-12);
        let mean = cross_entropy_with(&x, &y, cfg(Reduction::Mean)).unwrap();
        close(mean.item().unwrap(), (want[0] + want[1]) / 2.0, 1e-12);
    }
    // ε = 0.1 on row 0 by hand: nll + ε·(x_t − mean) = l0 + 0.1.
    let v = cross_entropy_with(
        &x,
        &y,
        CrossEntropyConfig {
            reduction: Reduction::None,
            label_smoothing: 0.1,
            ..Default::default()
        },
    )
    .unwrap()
    .to_vec::<f64>()
    .unwrap();
    close(v[0], l0 + 0.1, 1e-12);
    close(v[1], l1, 1e-12);
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let (n, c) = (3, 5);
    let base = Tensor::randn([n, c], 0.0, 2.0, 42, DType::F64, CPU).unwrap();
    let y = targets(&[4, 0, 2]);
    for (eps, reduction) in [
        (0.0, Reduction::Mean),
        (0.2, Reduction::Mean),
        (0.3, Reduction::Sum),
    ] {
        let cfg = CrossEntropyConfig {
            reduction,
            label_smoothing: eps,
            ..Default::default()
        };
        let x = base.detach().to_variable();
        cross_entropy_with(&x, &y, cfg).unwrap().backward().unwrap();
        let grad = x.grad().unwrap().to_vec::<f64>().unwrap();
        let vals = base.to_vec::<f64>().unwrap();
        let h = 1e-6;
        for i in 0..n * c {
            let f = |d: f64| {
                let mut v = vals.clone();
                v[i] += d;
                let t = Tensor::from_vec(v, [n, c], CPU).unwrap();
                cross_entropy_with(&t, &y, cfg).unwrap().item().unwrap()
            };
            let fd = (f(h) - f(-h)) / (2.0 * h);
            assert!(
                (fd - grad[i]).abs() < 1e-7,
                "eps {eps} element {i}: autograd {} vs finite difference {fd}",
                grad[i]
            );
        }
    }
}

#[test]
fn half_inputs_give_an_f32_loss() {
    let x32 = Tensor::randn([4, 10], 0.0, 3.0, 1, DType::F32, CPU).unwrap();
    let y = targets(&[0, 9, 3, 3]);
    let want = cross_entropy(&x32.to_dtype(DType::F64).unwrap(), &y)
        .unwrap()
        .item()
        .unwrap();
    for half in [DType::F16, DType::BF16] {
        let x = x32.to_dtype(half).unwrap().to_variable();
        let loss = cross_entropy(&x, &y).unwrap();
        assert_eq!(loss.dtype(), DType::F32, "{half}");
        // Only the rounding of the logits to half remains.
        let tol = if half == DType::F16 { 1e-2 } else { 5e-2 };
        close(loss.item().unwrap(), want, tol);
        loss.backward().unwrap();
        assert_eq!(
            x.grad().unwrap().dtype(),
            half,
            "a grad has its variable's dtype"
        );
        let mse = mse_loss(&x, &x32, Reduction::Mean).unwrap();
        assert_eq!(mse.dtype(), DType::F32);
    }
    assert_eq!(
        cross_entropy(&x32, &y).unwrap().dtype(),
        DType::F32,
        "F32 stays F32"
    );
}

#[test]
fn cross_entropy_rejects_bad_input() {
    let x = logits();
    for bad in [[2i64, 3], [-1, 0]] {
        let e = cross_entropy(&x, &targets(&bad)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { name: "target", .. }),
            "{e}"
        );
        assert!(e.to_string().contains("0..3"), "{e}");
    }
    let float_targets = Tensor::from_vec(vec![2.0f32, 0.0], [2], CPU).unwrap();
    assert!(matches!(
        cross_entropy(&x, &float_targets),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        cross_entropy(&x, &targets(&[0, 1, 2])),
        Err(Error::ShapeMismatch { .. })
    ));
    let flat = Tensor::zeros([6], DType::F32, CPU).unwrap();
    assert!(cross_entropy(&flat, &targets(&[0])).is_err());
    let e = cross_entropy_with(
        &x,
        &targets(&[0, 0]),
        CrossEntropyConfig {
            reduction: Reduction::Mean,
            label_smoothing: 1.5,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("label_smoothing"), "{e}");
}

#[test]
fn mse_values_and_errors() {
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], CPU).unwrap();
    let b = Tensor::from_vec(vec![0.0f32, 2.0, 5.0, 3.0], [2, 2], CPU).unwrap();
    // squared errors: 1, 0, 4, 1
    close(
        mse_loss(&a, &b, Reduction::Mean).unwrap().item().unwrap(),
        1.5,
        1e-7,
    );
    close(
        mse_loss(&a, &b, Reduction::Sum).unwrap().item().unwrap(),
        6.0,
        1e-7,
    );
    assert_eq!(
        mse_loss(&a, &b, Reduction::None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0, 0.0, 4.0, 1.0]
    );
    let av = a.to_variable();
    mse_loss(&av, &b, Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    // d/da mean((a−b)²) = 2(a−b)/4
    assert_eq!(
        av.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.5, 0.0, -1.0, 0.5]
    );
    let c = Tensor::zeros([4], DType::F32, CPU).unwrap();
    assert!(matches!(
        mse_loss(&a, &c, Reduction::Mean),
        Err(Error::ShapeMismatch { .. })
    ));
}
