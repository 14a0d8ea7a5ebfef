//! conv2d: forward against hand values and a direct f64 reference, gradients against finite
//! differences, half precision against f32, and errors on bad shapes.

mod common;

use common::{assert_close_named as assert_close, check_gradients, max_abs};
use mixprec::{Conv2dConfig, DType, Device, Result, Tensor};

#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    c_in: usize,
    hw: (usize, usize),
    c_out: usize,
    k: (usize, usize),
    cfg: Conv2dConfig,
}

fn cfg(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dConfig {
    Conv2dConfig {
        stride: (stride, stride),
        padding: (padding, padding),
        dilation: (dilation, dilation),
        groups,
    }
}

fn case(n: usize, c_in: usize, hw: (usize, usize), c_out: usize, k: (usize, usize)) -> Case {
    Case {
        n,
        c_in,
        hw,
        c_out,
        k,
        cfg: Conv2dConfig::default(),
    }
}

impl Case {
    fn with(mut self, cfg: Conv2dConfig) -> Self {
        self.cfg = cfg;
        self
    }

    fn tensors(&self, seed: u64, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
        let x = Tensor::randn(
            vec![self.n, self.c_in, self.hw.0, self.hw.1],
            0.0,
            1.0,
            seed,
            dtype,
            Device::Cpu,
        )?;
        let w = Tensor::randn(
            vec![self.c_out, self.c_in / self.cfg.groups, self.k.0, self.k.1],
            0.0,
            0.5,
            seed + 1,
            dtype,
            Device::Cpu,
        )?;
        let b = Tensor::randn(vec![self.c_out], 0.0, 1.0, seed + 2, dtype, Device::Cpu)?;
        Ok((x, w, b))
    }
}

/// Direct convolution, straight from the definition.
fn naive_conv(x: &[f64], w: &[f64], b: &[f64], c: &Case) -> (Vec<f64>, usize, usize) {
    let (h, wd) = c.hw;
    let Conv2dConfig {
        stride: (sh, sw),
        padding: (ph, pw),
        dilation: (dh, dw),
        groups,
    } = c.cfg;
    let oh = (h + 2 * ph - dh * (c.k.0 - 1) - 1) / sh + 1;
    let ow = (wd + 2 * pw - dw * (c.k.1 - 1) - 1) / sw + 1;
    let (cig, cog) = (c.c_in / groups, c.c_out / groups);
    let mut out = vec![0.0; c.n * c.c_out * oh * ow];
    for n in 0..c.n {
        for co in 0..c.c_out {
            let g = co / cog;
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut s = b[co];
                    for ci in 0..cig {
                        for ky in 0..c.k.0 {
                            for kx in 0..c.k.1 {
                                let iy = (oy * sh + ky * dh) as isize - ph as isize;
                                let ix = (ox * sw + kx * dw) as isize - pw as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xi = ((n * c.c_in + g * cig + ci) * h + iy as usize) * wd
                                    + ix as usize;
                                let wi = ((co * cig + ci) * c.k.0 + ky) * c.k.1 + kx;
                                s += x[xi] * w[wi];
                            }
                        }
                    }
                    out[((n * c.c_out + co) * oh + oy) * ow + ox] = s;
                }
            }
        }
    }
    (out, oh, ow)
}

/// Shapes covering every parameter: strides, padding, dilation, groups, depthwise, non-square
/// inputs and kernels, a kernel as large as the input, and one image big enough for the
/// kernel to parallelise inside the product.
fn cases() -> Vec<Case> {
    vec![
        case(2, 3, (5, 7), 4, (3, 2)),
        case(3, 3, (7, 6), 5, (3, 3)).with(cfg(2, 1, 1, 1)),
        case(2, 2, (8, 9), 3, (3, 3)).with(Conv2dConfig {
            stride: (1, 2),
            padding: (2, 1),
            dilation: (2, 2),
            groups: 1,
        }),
        case(2, 4, (6, 5), 6, (3, 3)).with(cfg(1, 1, 1, 2)),
        case(2, 4, (7, 7), 4, (3, 3)).with(cfg(2, 1, 1, 4)),
        case(1, 3, (6, 6), 6, (3, 3)).with(cfg(1, 1, 2, 3)),
        case(2, 6, (8, 8), 4, (1, 1)).with(cfg(2, 0, 1, 1)),
        case(2, 2, (5, 5), 3, (5, 5)),
        case(2, 3, (9, 5), 2, (1, 4)).with(Conv2dConfig {
            stride: (3, 1),
            padding: (0, 2),
            dilation: (1, 1),
            groups: 1,
        }),
        case(1, 16, (16, 16), 32, (3, 3)).with(cfg(1, 1, 1, 1)),
        // Kernel columns and rows that see only padding (PyTorch gives a 1x1 output); the
        // first panicked in forward and backward before the fix.
        case(1, 1, (1, 1), 1, (3, 3)).with(cfg(1, 2, 2, 1)),
        case(2, 2, (2, 3), 2, (3, 3)).with(cfg(2, 3, 3, 1)),
        case(1, 2, (1, 4), 2, (2, 3)).with(Conv2dConfig {
            stride: (1, 1),
            padding: (1, 3),
            dilation: (2, 3),
            groups: 2,
        }),
    ]
}

#[test]
fn conv_forward_hand_values() -> Result<()> {
    let x = Tensor::from_vec(
        (1..=16).map(f64::from).collect(),
        vec![1, 1, 4, 4],
        Device::Cpu,
    )?;
    let diag = Tensor::from_vec(vec![1.0, 0.0, 0.0, -1.0], vec![1, 1, 2, 2], Device::Cpu)?;
    let ones = Tensor::ones(vec![1, 1, 2, 2], DType::F64, Device::Cpu)?;
    let bias = Tensor::from_vec(vec![0.5], vec![1], Device::Cpu)?;

    // x[i][j] − x[i+1][j+1] = −5 everywhere, plus the bias.
    let y = x.conv2d(&diag, Some(&bias), Conv2dConfig::default())?;
    assert_eq!(y.dims(), [1, 1, 3, 3]);
    assert_eq!(y.to_vec_f64()?, vec![-4.5; 9]);

    // Stride 2 over a zero-padded input: windows rows/cols -1..1, 1..3, 3..5.
    let y = x.conv2d(&ones, None, cfg(2, 1, 1, 1))?;
    assert_eq!(y.dims(), [1, 1, 3, 3]);
    let expected = [1.0, 5.0, 4.0, 14.0, 34.0, 20.0, 13.0, 29.0, 16.0];
    assert_eq!(y.to_vec_f64()?, expected);

    // Dilation 2: the four corners of each 3x3 window.
    let y = x.conv2d(&ones, None, cfg(1, 0, 2, 1))?;
    assert_eq!(y.to_vec_f64()?, vec![24.0, 28.0, 40.0, 44.0]);

    // Two groups of one channel each: each output sees only its own input channel.
    let x = Tensor::from_vec(vec![2.0, 3.0], vec![1, 2, 1, 1], Device::Cpu)?;
    let w = Tensor::from_vec(vec![10.0, 100.0], vec![2, 1, 1, 1], Device::Cpu)?;
    let y = x.conv2d(&w, None, cfg(1, 0, 1, 2))?;
    assert_eq!(y.to_vec_f64()?, vec![20.0, 300.0]);
    Ok(())
}

#[test]
fn conv_forward_matches_direct_reference() -> Result<()> {
    for (i, c) in cases().iter().enumerate() {
        let (x, w, b) = c.tensors(100 + 10 * i as u64, DType::F64)?;
        let (expected, oh, ow) =
            naive_conv(&x.to_vec_f64()?, &w.to_vec_f64()?, &b.to_vec_f64()?, c);
        let y = x.conv2d(&w, Some(&b), c.cfg)?;
        assert_eq!(y.dims(), [c.n, c.c_out, oh, ow], "{c:?}");
        assert_close(
            &format!("f64 {c:?}"),
            &y.to_vec_f64()?,
            &expected,
            1e-12,
            1e-12,
        );

        // The f32 path (f32 GEMM) agrees to f32 precision.
        let y32 = x.to_dtype(DType::F32)?.conv2d(
            &w.to_dtype(DType::F32)?,
            Some(&b.to_dtype(DType::F32)?),
            c.cfg,
        )?;
        let atol = 1e-5 * max_abs(&expected);
        assert_close(
            &format!("f32 {c:?}"),
            &y32.to_vec_f64()?,
            &expected,
            1e-5,
            atol,
        );
    }
    Ok(())
}

#[test]
fn conv_gradients_match_finite_differences() -> Result<()> {
    let cases = [
        case(2, 2, (5, 6), 3, (3, 2)).with(cfg(2, 1, 1, 1)),
        case(2, 4, (6, 5), 4, (3, 3)).with(Conv2dConfig {
            stride: (1, 2),
            padding: (2, 1),
            dilation: (2, 1),
            groups: 2,
        }),
        case(1, 3, (5, 5), 3, (3, 3)).with(cfg(2, 1, 1, 3)),
        case(2, 3, (4, 4), 2, (1, 1)),
        case(1, 1, (1, 1), 1, (3, 3)).with(cfg(1, 2, 2, 1)),
        case(2, 2, (2, 3), 2, (3, 3)).with(cfg(2, 3, 3, 1)),
    ];
    for (i, c) in cases.iter().enumerate() {
        let (x, w, b) = c.tensors(7 + 10 * i as u64, DType::F64)?;
        check_gradients(&[x, w, b], |t| t[0].conv2d(&t[1], Some(&t[2]), c.cfg));
    }
    Ok(())
}

/// Half inputs give the f32 result computed from the same rounded values, up to the one
/// rounding of each output: f16 keeps 11 significant bits, bf16 8.
#[test]
fn conv_half_precision_matches_f32() -> Result<()> {
    let cases = [
        case(4, 8, (10, 10), 16, (3, 3)).with(cfg(1, 1, 1, 1)),
        case(2, 8, (9, 9), 8, (3, 3)).with(cfg(2, 1, 1, 2)),
    ];
    for (dtype, rtol) in [(DType::F16, 2e-3), (DType::BF16, 1e-2)] {
        for c in &cases {
            let (x, w, _) = c.tensors(3, dtype)?;
            let y_shape = x.conv2d(&w, None, c.cfg)?.dims().to_vec();
            // The output gradient: random, exactly representable in `dtype`.
            let r = Tensor::randn(y_shape, 0.0, 1.0, 9, dtype, Device::Cpu)?;
            let run = |dt: DType| -> Result<Vec<Vec<f64>>> {
                let (x, w) = (x.to_dtype(dt)?.to_variable(), w.to_dtype(dt)?.to_variable());
                let y = x.conv2d(&w, None, c.cfg)?;
                y.mul(&r.to_dtype(dt)?)?.sum_all()?.backward()?;
                let (gx, gw) = (x.grad().expect("x grad"), w.grad().expect("w grad"));
                assert_eq!((y.dtype(), gx.dtype(), gw.dtype()), (dt, dt, dt));
                Ok(vec![y.to_vec_f64()?, gx.to_vec_f64()?, gw.to_vec_f64()?])
            };
            let (half, full) = (run(dtype)?, run(DType::F32)?);
            for (name, (h, f)) in ["y", "dx", "dw"].iter().zip(half.iter().zip(&full)) {
                let what = format!("{dtype:?} {name} {c:?}");
                assert_close(&what, h, f, rtol, 1e-6 * max_abs(f));
            }
        }
    }
    Ok(())
}

#[test]
fn conv_rejects_bad_shapes() -> Result<()> {
    let t = |shape: Vec<usize>| Tensor::zeros(shape, DType::F32, Device::Cpu);
    let x = t(vec![2, 4, 5, 5])?;
    let w = t(vec![6, 4, 3, 3])?;
    let ok = Conv2dConfig::default();
    assert!(x.conv2d(&w, None, ok).is_ok());
    // Wrong rank of input or weight.
    assert!(t(vec![4, 5, 5])?.conv2d(&w, None, ok).is_err());
    assert!(x.conv2d(&t(vec![6, 4, 3])?, None, ok).is_err());
    // Input channels do not match the weight.
    assert!(t(vec![2, 3, 5, 5])?.conv2d(&w, None, ok).is_err());
    // Kernel larger than the input, unless padding makes room.
    let big = t(vec![6, 4, 7, 7])?;
    assert!(x.conv2d(&big, None, ok).is_err());
    assert!(x.conv2d(&big, None, cfg(1, 1, 1, 1)).is_ok());
    // Dilation makes the kernel larger than the input.
    assert!(x.conv2d(&w, None, cfg(1, 0, 3, 1)).is_err());
    // Groups that do not divide the channels, or zero.
    assert!(x
        .conv2d(&t(vec![6, 2, 3, 3])?, None, cfg(1, 0, 1, 3))
        .is_err());
    assert!(x.conv2d(&w, None, cfg(1, 0, 1, 0)).is_err());
    assert!(x
        .conv2d(&t(vec![5, 2, 3, 3])?, None, cfg(1, 0, 1, 2))
        .is_err());
    // Zero stride or dilation.
    assert!(x.conv2d(&w, None, cfg(0, 0, 1, 1)).is_err());
    assert!(x.conv2d(&w, None, cfg(1, 0, 0, 1)).is_err());
    // Bias of the wrong length; operands of different dtypes.
    assert!(x.conv2d(&w, Some(&t(vec![4])?), ok).is_err());
    assert!(x.conv2d(&w.to_dtype(DType::F64)?, None, ok).is_err());
    Ok(())
}

/// Empty batches and channel counts give empty (or zero) results, never a panic.
#[test]
fn conv_handles_empty_dimensions() -> Result<()> {
    for (xd, wd) in [
        (vec![0, 3, 5, 5], vec![4, 3, 3, 3]),
        (vec![2, 3, 5, 5], vec![0, 3, 3, 3]),
        (vec![2, 0, 5, 5], vec![4, 0, 3, 3]),
    ] {
        let x = Tensor::randn(xd.clone(), 0.0, 1.0, 1, DType::F32, Device::Cpu)?.to_variable();
        let w = Tensor::randn(wd.clone(), 0.0, 1.0, 2, DType::F32, Device::Cpu)?.to_variable();
        let y = x.conv2d(&w, None, cfg(1, 1, 1, 1))?;
        assert_eq!(y.dims(), [xd[0], wd[0], 5, 5]);
        assert!(y.to_vec_f64()?.iter().all(|&v| v == 0.0));
        y.sum_all()?.backward()?;
        for t in [&x, &w] {
            let g = t.grad().expect("grad");
            assert_eq!(g.dims(), t.dims());
            assert!(g.to_vec_f64()?.iter().all(|&v| v == 0.0));
        }
    }
    Ok(())
}

/// An input read by two convolutions (a residual network's downsampling block) gets its
/// gradient as the sum of both data gradients: the second is added into the first as it is
/// computed (the engine's offer, cuDNN's beta = 1 on a GPU), and the sum is still right.
#[test]
fn conv_data_gradient_added_into_the_other_consumers() -> Result<()> {
    let c1 = case(2, 3, (5, 5), 4, (3, 3)).with(cfg(1, 1, 1, 1));
    let (x, w1, _) = c1.tensors(41, DType::F64)?;
    let (_, w2, _) = case(2, 3, (5, 5), 4, (1, 1)).tensors(43, DType::F64)?;
    let f = |t: &[Tensor]| -> Result<Tensor> {
        // A node, not the variable itself: the engine sums a node's gradients.
        let a = t[0].affine(1.5, 0.25)?;
        a.conv2d(&t[1], None, c1.cfg)?
            .add(&a.conv2d(&t[2], None, Conv2dConfig::default())?)
    };
    let before = mixprec::autograd::gradients_added_in_place();
    check_gradients(&[x, w1, w2], f);
    assert!(
        mixprec::autograd::gradients_added_in_place() > before,
        "the second data gradient was added by a separate add, not into the first"
    );
    Ok(())
}
