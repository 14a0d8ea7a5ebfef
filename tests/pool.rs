//! Max, average and adaptive average pooling: hand values, a direct f64 reference, gradients
//! against finite differences, half precision against f32, and errors on bad arguments.

mod common;

use common::{assert_close_named as assert_close, check_gradients};
use mixprec::{DType, Device, Result, Tensor};

fn grid(values: Vec<f64>, shape: Vec<usize>) -> Result<Tensor> {
    Tensor::from_vec(values, shape, Device::Cpu)
}

fn randn(shape: Vec<usize>, seed: u64) -> Result<Tensor> {
    Tensor::randn(shape, 0.0, 1.0, seed, DType::F64, Device::Cpu)
}

/// `(kernel, stride, padding)` of the random cases.
type Geometry = ((usize, usize), (usize, usize), (usize, usize));

const GEOMETRIES: [Geometry; 6] = [
    ((2, 2), (2, 2), (0, 0)),
    ((3, 3), (2, 2), (1, 1)),
    ((3, 3), (1, 1), (1, 1)),
    ((3, 2), (2, 1), (1, 0)),
    ((2, 3), (1, 3), (0, 1)),
    ((4, 4), (3, 3), (2, 2)),
];

enum Kind {
    Max,
    Avg { count_include_pad: bool },
}

/// Pooling straight from the definition (PyTorch's floor mode and divisors).
fn naive_pool(x: &[f64], dims: [usize; 4], g: Geometry, kind: &Kind) -> Vec<f64> {
    let [n, c, h, w] = dims;
    let ((kh, kw), (sh, sw), (ph, pw)) = g;
    let (oh, ow) = ((h + 2 * ph - kh) / sh + 1, (w + 2 * pw - kw) / sw + 1);
    let mut out = Vec::new();
    for plane in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let (mut best, mut sum, mut real, mut padded) = (f64::NEG_INFINITY, 0.0, 0, 0);
                for ky in 0..kh {
                    for kx in 0..kw {
                        let iy = (oy * sh + ky) as isize - ph as isize;
                        let ix = (ox * sw + kx) as isize - pw as isize;
                        // Cells of the padded input count for the padded divisor.
                        if iy < (h + ph) as isize && ix < (w + pw) as isize {
                            padded += 1;
                        }
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let v = x[(plane * h + iy as usize) * w + ix as usize];
                        best = best.max(v);
                        sum += v;
                        real += 1;
                    }
                }
                out.push(match kind {
                    Kind::Max => best,
                    Kind::Avg {
                        count_include_pad: true,
                    } => sum / padded as f64,
                    Kind::Avg {
                        count_include_pad: false,
                    } => sum / real as f64,
                });
            }
        }
    }
    out
}

#[test]
fn max_pool_hand_values() -> Result<()> {
    let x = grid(
        vec![
            1.0, 5.0, 2.0, 0.0, //
            3.0, 4.0, 8.0, 8.0, //
            -1.0, -2.0, 7.0, 6.0, //
            -3.0, -4.0, 6.0, 7.0,
        ],
        vec![1, 1, 4, 4],
    )?
    .to_variable();
    let y = x.max_pool2d((2, 2), (2, 2), (0, 0))?;
    assert_eq!(y.dims(), [1, 1, 2, 2]);
    assert_eq!(y.to_vec_f64()?, [5.0, 8.0, -1.0, 7.0]);
    // The gradient lands on each window's first maximum (the tie 8, 8 picks the left one).
    y.sum_all()?.backward()?;
    let g = x.grad().expect("grad").to_vec_f64()?;
    let mut expected = vec![0.0; 16];
    for i in [1, 6, 8, 10] {
        expected[i] = 1.0;
    }
    assert_eq!(g, expected);

    // Padding never wins, even over negative values.
    let neg = grid(vec![-5.0, -6.0, -7.0, -8.0], vec![1, 1, 2, 2])?;
    let y = neg.max_pool2d((2, 2), (1, 1), (1, 1))?;
    assert_eq!(
        y.to_vec_f64()?,
        [-5.0, -5.0, -6.0, -5.0, -5.0, -6.0, -7.0, -7.0, -8.0]
    );
    Ok(())
}

#[test]
fn max_pool_backward_accumulates_overlapping_windows() -> Result<()> {
    // One dominant cell in the middle of a 3x3 input: every 2x2 window (stride 1) picks it.
    let mut v = vec![0.0; 9];
    v[4] = 10.0;
    let x = grid(v, vec![1, 1, 3, 3])?.to_variable();
    x.max_pool2d((2, 2), (1, 1), (0, 0))?
        .sum_all()?
        .backward()?;
    let g = x.grad().expect("grad").to_vec_f64()?;
    assert_eq!(g, [0.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
    Ok(())
}

#[test]
fn avg_pool_hand_values() -> Result<()> {
    let x = grid((1..=9).map(f64::from).collect(), vec![1, 1, 3, 3])?;
    // 3x3 windows at stride 2 over a 1-padded input: each covers a 2x2 corner of real cells.
    let incl = x.avg_pool2d((3, 3), (2, 2), (1, 1), true)?;
    let corners = [12.0, 16.0, 24.0, 28.0];
    assert_close(
        "count_include_pad",
        &incl.to_vec_f64()?,
        &corners.map(|s| s / 9.0),
        1e-15,
        0.0,
    );
    let excl = x.avg_pool2d((3, 3), (2, 2), (1, 1), false)?;
    assert_close(
        "exclude pad",
        &excl.to_vec_f64()?,
        &corners.map(|s| s / 4.0),
        1e-15,
        0.0,
    );
    // No padding: a plain mean.
    let y = x.avg_pool2d((2, 2), (1, 1), (0, 0), true)?;
    assert_eq!(y.to_vec_f64()?, [3.0, 4.0, 6.0, 7.0]);
    Ok(())
}

#[test]
fn adaptive_avg_pool_hand_values() -> Result<()> {
    // Width 5 to 3: columns 0..2, 1..4, 3..5 (they overlap).
    let x = grid(vec![1.0, 2.0, 3.0, 4.0, 5.0], vec![1, 1, 1, 5])?;
    assert_eq!(x.adaptive_avg_pool2d(1, 3)?.to_vec_f64()?, [1.5, 3.0, 4.5]);
    // Global average pooling, per plane.
    let x = grid((0..8).map(f64::from).collect(), vec![1, 2, 2, 2])?;
    assert_eq!(x.adaptive_avg_pool2d(1, 1)?.to_vec_f64()?, [1.5, 5.5]);
    // Output larger than the input repeats cells.
    let x = grid(vec![1.0, 2.0], vec![1, 1, 1, 2])?;
    assert_eq!(
        x.adaptive_avg_pool2d(1, 4)?.to_vec_f64()?,
        [1.0, 1.0, 2.0, 2.0]
    );
    Ok(())
}

#[test]
fn pools_match_direct_reference() -> Result<()> {
    for (i, &g) in GEOMETRIES.iter().enumerate() {
        let dims = [2, 3, 7 + i % 2, 8 - i % 3];
        let x = randn(dims.to_vec(), 40 + i as u64)?;
        let xv = x.to_vec_f64()?;
        let (k, s, p) = g;
        let y = x.max_pool2d(k, s, p)?.to_vec_f64()?;
        assert_eq!(y, naive_pool(&xv, dims, g, &Kind::Max), "max {g:?}");
        for count_include_pad in [true, false] {
            let y = x.avg_pool2d(k, s, p, count_include_pad)?.to_vec_f64()?;
            let expected = naive_pool(&xv, dims, g, &Kind::Avg { count_include_pad });
            assert_close(
                &format!("avg {g:?} {count_include_pad}"),
                &y,
                &expected,
                1e-14,
                1e-15,
            );
        }
    }
    // Adaptive pooling is an average over its (possibly overlapping) windows.
    let x = randn(vec![2, 3, 7, 10], 5)?;
    let xv = x.to_vec_f64()?;
    for (oh, ow) in [(3, 4), (7, 10), (1, 1), (2, 3), (9, 12)] {
        let y = x.adaptive_avg_pool2d(oh, ow)?.to_vec_f64()?;
        let mut expected = Vec::new();
        for plane in 0..6 {
            for i in 0..oh {
                for j in 0..ow {
                    let (y0, y1) = (i * 7 / oh, ((i + 1) * 7).div_ceil(oh));
                    let (x0, x1) = (j * 10 / ow, ((j + 1) * 10).div_ceil(ow));
                    let mut s = 0.0;
                    for r in y0..y1 {
                        for c in x0..x1 {
                            s += xv[plane * 70 + r * 10 + c];
                        }
                    }
                    expected.push(s / ((y1 - y0) * (x1 - x0)) as f64);
                }
            }
        }
        assert_close(&format!("adaptive {oh}x{ow}"), &y, &expected, 1e-14, 1e-15);
    }
    Ok(())
}

#[test]
fn pool_gradients_match_finite_differences() -> Result<()> {
    for (i, &(k, s, p)) in GEOMETRIES.iter().enumerate() {
        let x = randn(vec![2, 2, 6, 7], 70 + i as u64)?;
        // Random inputs have no ties, so max pooling is differentiable at them.
        check_gradients(std::slice::from_ref(&x), |t| t[0].max_pool2d(k, s, p));
        for cip in [true, false] {
            check_gradients(std::slice::from_ref(&x), |t| t[0].avg_pool2d(k, s, p, cip));
        }
    }
    let x = randn(vec![2, 2, 5, 7], 3)?;
    for (oh, ow) in [(2, 3), (5, 7), (1, 1), (4, 9)] {
        check_gradients(std::slice::from_ref(&x), |t| {
            t[0].adaptive_avg_pool2d(oh, ow)
        });
    }
    Ok(())
}

/// Half inputs give the f32 result of the same rounded values up to the rounding of the output
/// (max pooling exactly; the gradients too, as each is one rounded sum of half values).
#[test]
fn pools_in_half_precision_match_f32() -> Result<()> {
    for (dtype, rtol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        let x = Tensor::randn(vec![4, 8, 12, 12], 0.0, 1.0, 17, dtype, Device::Cpu)?;
        type PoolFn = fn(&Tensor) -> Result<Tensor>;
        let ops: [(&str, PoolFn); 4] = [
            ("max", |x| x.max_pool2d((3, 3), (2, 2), (1, 1))),
            ("avg", |x| x.avg_pool2d((3, 3), (2, 2), (1, 1), true)),
            ("avg_excl", |x| x.avg_pool2d((3, 3), (2, 2), (1, 1), false)),
            ("adaptive", |x| x.adaptive_avg_pool2d(5, 5)),
        ];
        for (name, op) in ops {
            let shape = op(&x)?.dims().to_vec();
            let r = Tensor::randn(shape, 0.0, 1.0, 23, dtype, Device::Cpu)?;
            let run = |dt: DType| -> Result<(Vec<f64>, Vec<f64>)> {
                let xv = x.to_dtype(dt)?.to_variable();
                let y = op(&xv)?;
                assert_eq!(y.dtype(), dt);
                y.mul(&r.to_dtype(dt)?)?.sum_all()?.backward()?;
                Ok((y.to_vec_f64()?, xv.grad().expect("grad").to_vec_f64()?))
            };
            let ((yh, gh), (yf, gf)) = (run(dtype)?, run(DType::F32)?);
            let what = format!("{dtype:?} {name}");
            assert_close(&format!("{what} y"), &yh, &yf, rtol, 1e-6);
            assert_close(&format!("{what} dx"), &gh, &gf, rtol, 1e-6);
        }
    }
    Ok(())
}

#[test]
fn pools_reject_bad_arguments() -> Result<()> {
    let x = Tensor::zeros(vec![2, 3, 5, 5], DType::F32, Device::Cpu)?;
    let rank3 = Tensor::zeros(vec![3, 5, 5], DType::F32, Device::Cpu)?;
    assert!(x.max_pool2d((2, 2), (2, 2), (0, 0)).is_ok());
    // Wrong rank.
    assert!(rank3.max_pool2d((2, 2), (2, 2), (0, 0)).is_err());
    assert!(rank3.avg_pool2d((2, 2), (2, 2), (0, 0), true).is_err());
    assert!(rank3.adaptive_avg_pool2d(1, 1).is_err());
    // Kernel larger than the (padded) input.
    assert!(x.max_pool2d((6, 6), (1, 1), (0, 0)).is_err());
    assert!(x.avg_pool2d((2, 7), (1, 1), (0, 0), false).is_err());
    // Zero kernel or stride; padding over half the kernel.
    assert!(x.max_pool2d((0, 2), (1, 1), (0, 0)).is_err());
    assert!(x.max_pool2d((2, 2), (0, 1), (0, 0)).is_err());
    assert!(x.avg_pool2d((2, 2), (1, 1), (2, 0), true).is_err());
    // Empty adaptive output; integer input.
    assert!(x.adaptive_avg_pool2d(0, 3).is_err());
    let ints = Tensor::zeros(vec![1, 1, 4, 4], DType::I64, Device::Cpu)?;
    assert!(ints.max_pool2d((2, 2), (2, 2), (0, 0)).is_err());
    Ok(())
}
