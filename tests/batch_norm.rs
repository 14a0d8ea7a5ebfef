//! Batch norm: training forward and running statistics against hand values and a direct f64
//! reference, eval mode, gradients against finite differences, half inputs against f32, the
//! numerics of f32 statistics, and errors on bad arguments.

mod common;

use common::{assert_close_named as assert_close, check_gradients, max_abs};
use mixprec::{BatchNormConfig, DType, Device, Result, Tensor};

fn vec1(v: Vec<f64>) -> Result<Tensor> {
    let n = v.len();
    Tensor::from_vec(v, vec![n], Device::Cpu)
}

fn randn(shape: Vec<usize>, mean: f64, std: f64, seed: u64, dtype: DType) -> Result<Tensor> {
    Tensor::randn(shape, mean, std, seed, dtype, Device::Cpu)
}

const TRAIN: BatchNormConfig = BatchNormConfig {
    training: true,
    momentum: 0.1,
    eps: 1e-5,
};

/// Training-mode batch norm from the definition: `(y, new running mean, new running var)`.
fn naive_bn(
    x: &[f64],
    dims: &[usize],
    (w, b, rm, rv): (&[f64], &[f64], &[f64], &[f64]),
    cfg: BatchNormConfig,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (n, c) = (dims[0], dims[1]);
    let s: usize = dims[2..].iter().product();
    let count = (n * s) as f64;
    let at = |i: usize, ch: usize, j: usize| (i * c + ch) * s + j;
    let mut y = vec![0.0; x.len()];
    let (mut new_rm, mut new_rv) = (vec![0.0; c], vec![0.0; c]);
    for ch in 0..c {
        let vals: Vec<f64> = (0..n)
            .flat_map(|i| (0..s).map(move |j| at(i, ch, j)))
            .map(|k| x[k])
            .collect();
        let mean = vals.iter().sum::<f64>() / count;
        let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count;
        for i in 0..n {
            for j in 0..s {
                let k = at(i, ch, j);
                y[k] = (x[k] - mean) / (var + cfg.eps).sqrt() * w[ch] + b[ch];
            }
        }
        let m = cfg.momentum;
        new_rm[ch] = (1.0 - m) * rm[ch] + m * mean;
        new_rv[ch] = (1.0 - m) * rv[ch] + m * var * count / (count - 1.0);
    }
    (y, new_rm, new_rv)
}

#[test]
fn batch_norm_training_hand_values() -> Result<()> {
    // [n=2, c=2, spatial=2]: channel 0 holds 1, 2, 3, 4; channel 1 holds 10, 20, 30, 40.
    let x = Tensor::from_vec(
        vec![1.0, 2.0, 10.0, 20.0, 3.0, 4.0, 30.0, 40.0],
        vec![2, 2, 2],
        Device::Cpu,
    )?;
    let (w, b) = (vec1(vec![2.0, 0.5])?, vec1(vec![1.0, -1.0])?);
    let (rm, rv) = (vec1(vec![1.0, 2.0])?, vec1(vec![1.0, 3.0])?);
    let y = x.batch_norm(&w, &b, &rm, &rv, TRAIN)?;

    // Means 2.5 and 25, biased variances 1.25 and 125 (unbiased: ×4/3).
    let (s0, s1) = ((1.25f64 + 1e-5).sqrt(), (125f64 + 1e-5).sqrt());
    let c0 = |v: f64| (v - 2.5) / s0 * 2.0 + 1.0;
    let c1 = |v: f64| (v - 25.0) / s1 * 0.5 - 1.0;
    let expected = [
        c0(1.0),
        c0(2.0),
        c1(10.0),
        c1(20.0),
        c0(3.0),
        c0(4.0),
        c1(30.0),
        c1(40.0),
    ];
    assert_close("y", &y.to_vec_f64()?, &expected, 1e-14, 1e-14);
    // running = 0.9·old + 0.1·batch, with the unbiased variance.
    assert_close("running_mean", &rm.to_vec_f64()?, &[1.15, 4.3], 1e-14, 0.0);
    let rv_expected = [0.9 + 0.1 * 5.0 / 3.0, 2.7 + 0.1 * 500.0 / 3.0];
    assert_close("running_var", &rv.to_vec_f64()?, &rv_expected, 1e-14, 0.0);
    Ok(())
}

#[test]
fn batch_norm_matches_direct_reference() -> Result<()> {
    for (i, dims) in [
        vec![4, 3, 5, 6],
        vec![8, 5],
        vec![2, 4, 7],
        vec![3, 2, 1, 1],
    ]
    .into_iter()
    .enumerate()
    {
        let c = dims[1];
        let seed = 10 * i as u64;
        let x = randn(dims.clone(), 0.5, 2.0, seed, DType::F64)?;
        let w = randn(vec![c], 1.0, 0.3, seed + 1, DType::F64)?;
        let b = randn(vec![c], 0.0, 1.0, seed + 2, DType::F64)?;
        let rm = randn(vec![c], 0.0, 1.0, seed + 3, DType::F64)?;
        let rv = Tensor::rand_uniform(vec![c], 0.5, 2.0, seed + 4, DType::F64, Device::Cpu)?;
        let cfg = BatchNormConfig {
            momentum: 0.3,
            eps: 1e-3,
            ..TRAIN
        };
        let v = |t: &Tensor| t.to_vec_f64();
        let (ey, erm, erv) = naive_bn(&v(&x)?, &dims, (&v(&w)?, &v(&b)?, &v(&rm)?, &v(&rv)?), cfg);
        let y = x.batch_norm(&w, &b, &rm, &rv, cfg)?;
        assert_eq!(y.dims(), &dims[..]);
        assert_close(&format!("y {dims:?}"), &v(&y)?, &ey, 1e-12, 1e-12);
        assert_close(&format!("rm {dims:?}"), &v(&rm)?, &erm, 1e-12, 1e-14);
        assert_close(&format!("rv {dims:?}"), &v(&rv)?, &erv, 1e-12, 1e-14);
    }
    Ok(())
}

#[test]
fn batch_norm_eval_uses_running_statistics() -> Result<()> {
    let x = randn(vec![3, 2, 4], 0.0, 1.0, 1, DType::F64)?;
    let (w, b) = (vec1(vec![2.0, -1.0])?, vec1(vec![0.5, 3.0])?);
    let (rm, rv) = (vec1(vec![0.25, -1.0])?, vec1(vec![4.0, 0.5])?);
    let cfg = BatchNormConfig {
        training: false,
        ..TRAIN
    };
    let y = x.batch_norm(&w, &b, &rm, &rv, cfg)?.to_vec_f64()?;
    let xv = x.to_vec_f64()?;
    let (wv, bv, mv, vv) = ([2.0, -1.0], [0.5, 3.0], [0.25, -1.0], [4.0, 0.5]);
    let expected: Vec<f64> = (0..xv.len())
        .map(|k| {
            let c = (k / 4) % 2;
            (xv[k] - mv[c]) / (vv[c] + 1e-5f64).sqrt() * wv[c] + bv[c]
        })
        .collect();
    assert_close("eval y", &y, &expected, 1e-13, 1e-13);
    // Eval mode leaves the running statistics alone.
    assert_eq!(rm.to_vec_f64()?, [0.25, -1.0]);
    assert_eq!(rv.to_vec_f64()?, [4.0, 0.5]);
    Ok(())
}

#[test]
fn batch_norm_gradients_match_finite_differences() -> Result<()> {
    for (i, dims) in [vec![3, 2, 2, 3], vec![6, 3], vec![2, 3, 5]]
        .into_iter()
        .enumerate()
    {
        let c = dims[1];
        let seed = 50 + 10 * i as u64;
        let x = randn(dims.clone(), 1.0, 2.0, seed, DType::F64)?;
        let w = randn(vec![c], 1.0, 0.5, seed + 1, DType::F64)?;
        let b = randn(vec![c], 0.0, 1.0, seed + 2, DType::F64)?;
        let rm = Tensor::zeros(vec![c], DType::F64, Device::Cpu)?;
        let rv = Tensor::ones(vec![c], DType::F64, Device::Cpu)?;
        check_gradients(&[x, w, b], |t| {
            t[0].batch_norm(&t[1], &t[2], &rm, &rv, TRAIN)
        });
    }
    Ok(())
}

/// Half inputs (with f32 parameters, as AMP keeps them) give the f32 result of the same rounded
/// values up to the rounding of each output.
#[test]
fn batch_norm_half_inputs_match_f32() -> Result<()> {
    let dims = vec![8, 6, 7, 7];
    for (dtype, rtol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        let x = randn(dims.clone(), 0.5, 2.0, 3, dtype)?;
        let r = randn(dims.clone(), 0.0, 1.0, 4, dtype)?;
        let run = |dt: DType| -> Result<Vec<Vec<f64>>> {
            let x = x.to_dtype(dt)?.to_variable();
            let w = randn(vec![6], 1.0, 0.5, 5, DType::F32)?.to_variable();
            let b = randn(vec![6], 0.0, 1.0, 6, DType::F32)?.to_variable();
            let rm = Tensor::zeros(vec![6], DType::F32, Device::Cpu)?;
            let rv = Tensor::ones(vec![6], DType::F32, Device::Cpu)?;
            let y = x.batch_norm(&w, &b, &rm, &rv, TRAIN)?;
            assert_eq!(y.dtype(), dt);
            y.mul(&r.to_dtype(dt)?)?.sum_all()?.backward()?;
            let grads = [&x, &w, &b].map(|t| t.grad().expect("grad").to_vec_f64());
            let [gx, gw, gb] = grads;
            Ok(vec![
                y.to_vec_f64()?,
                gx?,
                gw?,
                gb?,
                rm.to_vec_f64()?,
                rv.to_vec_f64()?,
            ])
        };
        let (half, full) = (run(dtype)?, run(DType::F32)?);
        let names = ["y", "dx", "dw", "db", "running_mean", "running_var"];
        for (name, (h, f)) in names.iter().zip(half.iter().zip(&full)) {
            // Parameter gradients and statistics stay f32: identical up to summation order.
            let tol = match *name {
                "y" | "dx" => rtol,
                _ => 1e-5,
            };
            assert_close(&format!("{dtype:?} {name}"), h, f, tol, 1e-5 * max_abs(f));
        }
    }
    Ok(())
}

/// f32 statistics of values far from zero: a one-pass E[x²] − E[x]² would lose the variance.
#[test]
fn batch_norm_f32_statistics_are_numerically_sound() -> Result<()> {
    let dims = vec![16, 2, 32, 32];
    let x = randn(dims.clone(), 1000.0, 1.0, 8, DType::F32)?;
    let w = Tensor::ones(vec![2], DType::F32, Device::Cpu)?;
    let b = Tensor::zeros(vec![2], DType::F32, Device::Cpu)?;
    let (rm, rv) = (
        Tensor::zeros(vec![2], DType::F32, Device::Cpu)?,
        Tensor::ones(vec![2], DType::F32, Device::Cpu)?,
    );
    let y = x.batch_norm(&w, &b, &rm, &rv, TRAIN)?.to_vec_f64()?;
    // The same f32 values, normalised in f64.
    let (w64, b64) = (w.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let (rm64, rv64) = (
        Tensor::zeros(vec![2], DType::F64, Device::Cpu)?,
        Tensor::ones(vec![2], DType::F64, Device::Cpu)?,
    );
    let y64 = x
        .to_dtype(DType::F64)?
        .batch_norm(&w64, &b64, &rm64, &rv64, TRAIN)?
        .to_vec_f64()?;
    assert_close("f32 y", &y, &y64, 0.0, 2e-3);
    assert_close(
        "f32 running_var",
        &rv.to_vec_f64()?,
        &rv64.to_vec_f64()?,
        1e-4,
        0.0,
    );
    assert_close(
        "f32 running_mean",
        &rm.to_vec_f64()?,
        &rm64.to_vec_f64()?,
        1e-6,
        0.0,
    );
    Ok(())
}

/// f32 statistics over long rows (2 × 2.5M values per channel): summed value by value in f32 the
/// variance drifts by 2e-3; the GPU tests take these statistics as their reference.
#[test]
fn batch_norm_f32_statistics_of_long_rows() -> Result<()> {
    let dims = vec![2, 1, 2_500_000];
    let x = randn(dims.clone(), 0.5, 2.0, 9, DType::F32)?;
    let run = |dtype: DType| -> Result<(Vec<f64>, Vec<f64>)> {
        let w = Tensor::ones(vec![1], dtype, Device::Cpu)?;
        let b = Tensor::zeros(vec![1], dtype, Device::Cpu)?;
        let rm = Tensor::zeros(vec![1], dtype, Device::Cpu)?;
        let rv = Tensor::ones(vec![1], dtype, Device::Cpu)?;
        x.to_dtype(dtype)?.batch_norm(&w, &b, &rm, &rv, TRAIN)?;
        Ok((rm.to_vec_f64()?, rv.to_vec_f64()?))
    };
    let ((rm, rv), (rm64, rv64)) = (run(DType::F32)?, run(DType::F64)?);
    // running = 0.9·init + 0.1·batch: the batch statistics to ~1e-6.
    assert_close("f32 running_var", &rv, &rv64, 2e-7, 0.0);
    assert_close("f32 running_mean", &rm, &rm64, 0.0, 1e-6);
    Ok(())
}

#[test]
fn batch_norm_rejects_bad_arguments() -> Result<()> {
    let p = |c: usize| Tensor::ones(vec![c], DType::F32, Device::Cpu);
    let x = Tensor::zeros(vec![4, 3, 2, 2], DType::F32, Device::Cpu)?;
    let (w, b, rm, rv) = (p(3)?, p(3)?, p(3)?, p(3)?);
    assert!(x.batch_norm(&w, &b, &rm, &rv, TRAIN).is_ok());
    // Rank below 2.
    let flat = Tensor::zeros(vec![3], DType::F32, Device::Cpu)?;
    assert!(flat.batch_norm(&w, &b, &rm, &rv, TRAIN).is_err());
    // Parameters or statistics of the wrong length.
    let four = p(4)?;
    assert!(x.batch_norm(&four, &b, &rm, &rv, TRAIN).is_err());
    assert!(x.batch_norm(&w, &four, &rm, &rv, TRAIN).is_err());
    assert!(x.batch_norm(&w, &b, &four, &rv, TRAIN).is_err());
    assert!(x.batch_norm(&w, &b, &rm, &four, TRAIN).is_err());
    // Input channels do not match the parameters.
    let x4 = Tensor::zeros(vec![4, 4, 2, 2], DType::F32, Device::Cpu)?;
    assert!(x4.batch_norm(&w, &b, &rm, &rv, TRAIN).is_err());
    // One value per channel cannot be normalised in training (it can in eval).
    let one = Tensor::zeros(vec![1, 3], DType::F32, Device::Cpu)?;
    assert!(one.batch_norm(&w, &b, &rm, &rv, TRAIN).is_err());
    let eval = BatchNormConfig {
        training: false,
        ..TRAIN
    };
    assert!(one.batch_norm(&w, &b, &rm, &rv, eval).is_ok());
    // eps and momentum out of range; integer input.
    assert!(x
        .batch_norm(&w, &b, &rm, &rv, BatchNormConfig { eps: 0.0, ..TRAIN })
        .is_err());
    assert!(x
        .batch_norm(
            &w,
            &b,
            &rm,
            &rv,
            BatchNormConfig {
                momentum: 1.5,
                ..TRAIN
            }
        )
        .is_err());
    let ints = Tensor::zeros(vec![4, 3], DType::I64, Device::Cpu)?;
    assert!(ints.batch_norm(&w, &b, &rm, &rv, TRAIN).is_err());
    Ok(())
}
