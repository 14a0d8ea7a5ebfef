//! Eval mode under O1: batch norm with running statistics computes in f32 and rounds once to
//! the half input's type (PyTorch's eval batch norm), so its half output is within half an ulp
//! of the exact value; a ResNet's eval logits at O1 f16 stay as close to an f64 reference as its
//! training-mode forward does.

use mixprec::amp;
use mixprec::nn::{BlockKind, Module, ResNet, ResNetConfig, Stem};
use mixprec::{BatchNormConfig, DType, Device, Result, Tensor};

const EVAL: BatchNormConfig = BatchNormConfig {
    training: false,
    momentum: 0.1,
    eps: 1e-5,
};

fn rand(shape: Vec<usize>, low: f64, high: f64, seed: u64, dtype: DType) -> Result<Tensor> {
    Tensor::rand_uniform(shape, low, high, seed, dtype, Device::Cpu)
}

/// Half an f16 ulp at `v` (the subnormal spacing below 2^-14).
fn half_ulp_f16(v: f64) -> f64 {
    let a = v.abs();
    let e = if a < 2f64.powi(-14) {
        -14
    } else {
        a.log2().floor() as i32
    };
    0.5 * 2f64.powi(e - 10)
}

/// The per-channel operands of an eval batch norm over `c` channels: weight, bias, running
/// mean, running variance (f32), with means and biases large enough that a half shift rounds.
fn bn_operands(c: usize) -> Result<[Tensor; 4]> {
    Ok([
        rand(vec![c], 0.5, 1.5, 11, DType::F32)?,
        rand(vec![c], -2.0, 2.0, 12, DType::F32)?,
        rand(vec![c], -3.0, 3.0, 13, DType::F32)?,
        rand(vec![c], 0.3, 2.5, 14, DType::F32)?,
    ])
}

/// `relu?(bn(x) + residual?)` in f64 from the same values.
fn reference(
    x: &[f64],
    dims: &[usize],
    ops: &[Vec<f64>; 4],
    residual: Option<&[f64]>,
    relu: bool,
) -> Vec<f64> {
    let (c, s) = (dims[1], dims[2..].iter().product::<usize>());
    let [w, b, m, v] = ops;
    x.iter()
        .enumerate()
        .map(|(i, &xi)| {
            let ch = (i / s) % c;
            let mut y = (xi - m[ch]) / (v[ch] + EVAL.eps).sqrt() * w[ch] + b[ch];
            if let Some(r) = residual {
                y += r[i];
            }
            if relu {
                y.max(0.0)
            } else {
                y
            }
        })
        .collect()
}

/// Eval batch norm (plain, + ReLU, + residual + ReLU) of an f16 input inside an O1 f16 scope,
/// with and without a gradient recorded: every output value is the exact result rounded once.
#[test]
fn eval_batch_norm_of_half_input_rounds_once() -> Result<()> {
    let dims = vec![4, 6, 5, 7];
    let x = rand(dims.clone(), -4.0, 4.0, 10, DType::F16)?;
    let res = rand(dims.clone(), -2.0, 2.0, 15, DType::F16)?;
    let ops = bn_operands(dims[1])?;
    let opv: [Vec<f64>; 4] = [
        ops[0].to_vec_f64()?,
        ops[1].to_vec_f64()?,
        ops[2].to_vec_f64()?,
        ops[3].to_vec_f64()?,
    ];
    let (xv, rv) = (x.to_vec_f64()?, res.to_vec_f64()?);
    let _scope = amp::autocast(DType::F16)?;
    for with_grad in [false, true] {
        let x = if with_grad {
            x.to_variable()
        } else {
            x.clone()
        };
        let [w, b, m, v] = &ops;
        let cases = [
            ("batch_norm", x.batch_norm(w, b, m, v, EVAL)?, None, false),
            (
                "batch_norm_relu",
                x.batch_norm_relu(w, b, m, v, EVAL)?,
                None,
                true,
            ),
            (
                "batch_norm_add_relu",
                x.batch_norm_add_relu(&res, w, b, m, v, EVAL)?,
                Some(&rv[..]),
                true,
            ),
        ];
        for (name, y, r, relu) in cases {
            assert_eq!(y.dtype(), DType::F16, "{name}: the input's dtype");
            assert_eq!(y.requires_grad(), with_grad, "{name}");
            let want = reference(&xv, &dims, &opv, r, relu);
            let got = y.to_vec_f64()?;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let bound = half_ulp_f16(*w);
                assert!(
                    (g - w).abs() <= bound * 1.01,
                    "{name} (gradient recorded: {with_grad}) [{i}]: {g} against {w}, {:.3} half \
                     ulps",
                    (g - w).abs() / half_ulp_f16(*w)
                );
            }
        }
    }
    Ok(())
}

/// The gradients of an eval batch norm still reach the input, the weight and the bias.
#[test]
fn eval_batch_norm_gradients_flow() -> Result<()> {
    let x = rand(vec![2, 3, 4, 4], -1.0, 1.0, 20, DType::F32)?.to_variable();
    let [w, b, m, v] = bn_operands(3)?;
    let (w, b) = (w.to_variable(), b.to_variable());
    let y = x.batch_norm(&w, &b, &m, &v, EVAL)?;
    y.sqr()?.sum_all()?.backward()?;
    let (mv, vv, wv) = (m.to_vec_f64()?, v.to_vec_f64()?, w.to_vec_f64()?);
    let (xs, ys) = (x.to_vec_f64()?, y.to_vec_f64()?);
    let gx = x.grad().expect("x has a gradient").to_vec_f64()?;
    let gw = w.grad().expect("weight has a gradient").to_vec_f64()?;
    let mut want_gw = [0.0; 3];
    for i in 0..xs.len() {
        let ch = (i / 16) % 3;
        let inv = 1.0 / (vv[ch] + EVAL.eps).sqrt();
        let want = 2.0 * ys[i] * wv[ch] * inv;
        assert!((gx[i] - want).abs() < 1e-4, "dx[{i}] {} vs {want}", gx[i]);
        want_gw[ch] += 2.0 * ys[i] * (xs[i] - mv[ch]) * inv;
    }
    for ch in 0..3 {
        assert!((gw[ch] - want_gw[ch]).abs() < 1e-3, "dw[{ch}]");
    }
    Ok(())
}

/// A small ImageNet-stem ResNet with random batch-norm affine parameters and running
/// statistics (as benches/torchvision_interop.py sets them).
fn small_resnet() -> Result<ResNet> {
    let cfg = ResNetConfig {
        block: BlockKind::Basic,
        blocks: vec![1, 1],
        widths: vec![16, 32],
        in_channels: 3,
        num_classes: 10,
        stem: Stem::ImageNet,
        zero_init_residual: false,
        seed: 3,
    };
    let model = ResNet::new(&cfg, &Device::Cpu)?;
    let mut seed = 100;
    let mut fill = |t: &Tensor, low: f64, high: f64| -> Result<()> {
        seed += 1;
        let _g = mixprec::no_grad();
        t.copy_in_place(&rand(t.dims().to_vec(), low, high, seed, DType::F32)?)
    };
    for (name, t) in model.named_parameters() {
        if name.contains("bn") || name.contains("downsample.1") {
            if name.ends_with("weight") {
                fill(&t, 0.5, 1.0)?;
            } else {
                fill(&t, -0.2, 0.2)?;
            }
        }
    }
    for (name, t) in model.named_buffers() {
        if name.ends_with("running_mean") {
            fill(&t, -0.2, 0.2)?;
        } else if name.ends_with("running_var") {
            fill(&t, 0.5, 2.0)?;
        }
    }
    Ok(model)
}

fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// A ResNet in eval mode under O1 f16: its logits are no further from the f64 model's than a
/// forward whose every batch norm rounds once allows. This model's error is 3.9e-4 with batch
/// norm in f32 math and 5.5e-4 with the scale and shift folded into half (the old eval path).
#[test]
fn resnet_eval_logits_at_o1_f16_near_f64() -> Result<()> {
    let model = small_resnet()?;
    model.eval();
    let x = Tensor::randn(vec![2, 3, 64, 64], 0.0, 1.0, 7, DType::F32, Device::Cpu)?;
    let y = Tensor::from_vec(vec![3i64, 7], vec![2], Device::Cpu)?;
    let (half, half_loss) = {
        let _g = mixprec::no_grad();
        let _scope = amp::autocast(DType::F16)?;
        let logits = model.forward(&x)?;
        assert_eq!(logits.dtype(), DType::F16, "linear is a half op under O1");
        let loss = mixprec::nn::cross_entropy(&logits, &y)?;
        (logits.to_vec_f64()?, loss.item()?)
    };
    model.cast(DType::F64, false)?;
    let (exact, exact_loss) = {
        let _g = mixprec::no_grad();
        let logits = model.forward(&x.to_dtype(DType::F64)?)?;
        let loss = mixprec::nn::cross_entropy(&logits, &y)?;
        (logits.to_vec_f64()?, loss.item()?)
    };
    let err = rel_l2(&half, &exact);
    eprintln!(
        "eval at O1 f16 against f64: logits relative L2 error {err:.3e}, loss error {:.3e}",
        (half_loss - exact_loss).abs()
    );
    assert!(err < ERR_BOUND, "relative L2 error {err:.3e}");
    Ok(())
}

/// Between the two errors of the test's doc.
const ERR_BOUND: f64 = 4.6e-4;
