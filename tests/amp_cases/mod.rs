//! AMP test cases that run on a device: the CPU in tests/amp.rs (CI), CUDA in tests/cuda.rs
//! (section "amp", ignored without a GPU). Each binary provides `amp_device()` at its root.
//!
//! They mirror apex's own suite: per-op dtypes under O1 and the promotion rules, the cast cache
//! through train → no_grad eval → train, checkpoint/restore at every level (bitwise), loss-scale
//! decrease with three scalers, several models / optimizers / losses with planted Inf (skipped
//! steps change nothing), initialize twice, bf16 without scaling, gradient accumulation,
//! clipping, and a tiny ResNet on Fashion-MNIST at each level.
#![allow(dead_code)]

use std::sync::Arc;

use mixprec::amp::{self, autocast, OpClass, OptLevel, Policy};
use mixprec::nn::module::{TensorInfo, TensorKind, TrainingFlag};
use mixprec::nn::{
    mse_loss, BatchNorm2d, Conv2d, Flatten, Linear, Module, ReLU, Reduction, Sequential,
};
use mixprec::optim::{Optimizer, Sgd, SgdConfig};
use mixprec::{Conv2dConfig, DType, Device, Error, Result, Tensor};

/// The device of this test binary's cases.
fn dev() -> Device {
    crate::amp_device()
}

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Tensor::randn(shape, 0.0, 1.0, seed, dtype, dev()).unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn sgd(params: Vec<Tensor>, lr: f64, momentum: f64) -> Sgd {
    Sgd::new(
        params,
        SgdConfig {
            lr,
            momentum,
            ..Default::default()
        },
    )
    .unwrap()
}

// ---- autocast: per-op dtypes and promotion -----------------------------------------------------

pub fn o1_op_result_dtypes() {
    use DType::*;
    for half in [F16, BF16] {
        let _ac = amp::autocast(half).unwrap();
        let a32 = randn(&[4, 6], 1, F32);
        let b32 = randn(&[6, 3], 2, F32);
        let a16 = randn(&[4, 6], 3, half);
        let w = randn(&[3, 6], 4, F32).to_variable();
        let bias = randn(&[3], 5, F32).to_variable();
        // half ops
        assert_eq!(a32.matmul(&b32).unwrap().dtype(), half);
        assert_eq!(a16.matmul(&b32).unwrap().dtype(), half);
        assert_eq!(a32.linear(&w, Some(&bias)).unwrap().dtype(), half);
        let img = randn(&[2, 3, 5, 5], 6, F32);
        let k = randn(&[4, 3, 3, 3], 7, F32);
        let kb = randn(&[4], 8, F32);
        let conv = img.conv2d(&k, Some(&kb), Conv2dConfig::default()).unwrap();
        assert_eq!(conv.dtype(), half);
        // fp32 ops on half inputs
        assert_eq!(a16.softmax(1).unwrap().dtype(), F32);
        assert_eq!(a16.log_softmax(1).unwrap().dtype(), F32);
        assert_eq!(a16.exp().unwrap().dtype(), F32);
        assert_eq!(a16.abs().unwrap().log().unwrap().dtype(), F32);
        assert_eq!(a16.powf(2.0).unwrap().dtype(), F32);
        assert_eq!(a16.sum_all().unwrap().dtype(), F32);
        assert_eq!(a16.sum_dim(0, false).unwrap().dtype(), F32);
        assert_eq!(a16.mean_all().unwrap().dtype(), F32);
        assert_eq!(a16.mean_dim(1, true).unwrap().dtype(), F32);
        let labels = Tensor::from_vec(vec![0i64, 1, 2, 0], [4], dev()).unwrap();
        let logits = a16.narrow(1, 0, 3).unwrap();
        assert_eq!(
            mixprec::nn::cross_entropy(&logits, &labels)
                .unwrap()
                .dtype(),
            F32
        );
        let t16 = randn(&[4, 6], 9, half);
        assert_eq!(mse_loss(&a16, &t16, Reduction::Mean).unwrap().dtype(), F32);
        // F64 stays F64 in fp32 ops
        assert_eq!(randn(&[3], 1, F64).exp().unwrap().dtype(), F64);
        // promote: widest input type
        assert_eq!(a16.add(&a32).unwrap().dtype(), F32);
        assert_eq!(a16.mul(&a16).unwrap().dtype(), half);
        assert_eq!(a32.sub(&a16).unwrap().dtype(), F32);
        assert_eq!(a16.div(&a32).unwrap().dtype(), F32);
        assert_eq!(a16.maximum(&a32).unwrap().dtype(), F32);
        assert_eq!(Tensor::cat(&[&a16, &a32], 0).unwrap().dtype(), F32);
        assert_eq!(Tensor::cat(&[&a16, &a16], 0).unwrap().dtype(), half);
        let other = if half == F16 { BF16 } else { F16 };
        let ao = randn(&[4, 6], 10, other);
        assert_eq!(a16.add(&ao).unwrap().dtype(), F32);
        assert_eq!(Tensor::cat(&[&a16, &ao], 1).unwrap().dtype(), F32);
        // passthrough keeps the input type
        assert_eq!(a16.relu().unwrap().dtype(), half);
        assert_eq!(a32.relu().unwrap().dtype(), F32);
        let img16 = randn(&[2, 3, 4, 4], 11, half);
        assert_eq!(
            img16.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap().dtype(),
            half
        );
        assert_eq!(
            img16
                .avg_pool2d((2, 2), (2, 2), (0, 0), true)
                .unwrap()
                .dtype(),
            half
        );
        let bn = BatchNorm2d::new(3, &dev()).unwrap();
        assert_eq!(bn.forward(&img16).unwrap().dtype(), half);
        assert_eq!(bn.forward(&img).unwrap().dtype(), F32);
    }
    // Outside a scope nothing is cast.
    assert!(autocast::active().is_none());
    let a = randn(&[2, 2], 1, DType::F32);
    assert_eq!(a.matmul(&a).unwrap().dtype(), DType::F32);
    assert!(matches!(
        amp::autocast(DType::F32),
        Err(Error::UnsupportedDType { .. })
    ));
}

pub fn o1_gradients_have_the_parameters_dtype_and_scopes_nest() {
    let w = randn(&[3, 4], 1, DType::F32).to_variable();
    let x = randn(&[5, 4], 2, DType::F32);
    {
        let _a = amp::autocast(DType::F16).unwrap();
        {
            let _b = amp::autocast(DType::BF16).unwrap();
            assert_eq!(autocast::active(), Some(DType::BF16));
        }
        assert_eq!(autocast::active(), Some(DType::F16));
        let y = x.linear(&w, None).unwrap();
        assert_eq!(y.dtype(), DType::F16);
        y.sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(autocast::active(), None);
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}

pub fn user_ops_register_a_class() {
    assert!(autocast::register_op("matmul", OpClass::Fp32).is_err());
    assert!(autocast::register_op("", OpClass::Fp32).is_err());
    autocast::register_op("my_gelu", OpClass::Fp32).unwrap();
    autocast::register_op("my_proj", OpClass::Half).unwrap();
    let x16 = randn(&[3], 1, DType::F16);
    let x32 = randn(&[3], 2, DType::F32);
    assert_eq!(
        autocast::cast_inputs("my_gelu", &[&x16]).unwrap()[0].dtype(),
        DType::F16
    );
    let _ac = amp::autocast(DType::F16).unwrap();
    assert_eq!(
        autocast::cast_inputs("my_gelu", &[&x16]).unwrap()[0].dtype(),
        DType::F32
    );
    let v = autocast::cast_inputs("my_proj", &[&x32, &x16]).unwrap();
    assert_eq!((v[0].dtype(), v[1].dtype()), (DType::F16, DType::F16));
    // Unknown ops pass through.
    assert_eq!(
        autocast::cast_inputs("unknown", &[&x32]).unwrap()[0].dtype(),
        DType::F32
    );
}

// ---- the cast cache ----------------------------------------------------------------------------

pub fn cache_holds_parameter_casts_per_grad_mode_until_backward() {
    let w = randn(&[3, 4], 1, DType::F32).to_variable();
    let x = randn(&[2, 4], 2, DType::F32);
    let _ac = amp::autocast(DType::F16).unwrap();
    autocast::clear_cache();
    let y1 = x.linear(&w, None).unwrap();
    let y2 = x.linear(&w, None).unwrap();
    // One cached cast of the parameter (the input is not a variable: cast fresh each time).
    assert_eq!(autocast::cache_len(), 1);
    {
        let _ng = mixprec::no_grad();
        x.linear(&w, None).unwrap();
        assert_eq!(autocast::cache_len(), 2, "a no_grad cast is cached apart");
    }
    y1.add(&y2).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(autocast::cache_len(), 0, "backward clears the cache");
    // Both uses of the cached cast sent their gradient back.
    let g = w.grad().unwrap().to_vec_f64().unwrap();
    let xs = x.to_vec_f64().unwrap();
    for o in 0..3 {
        for i in 0..4 {
            let want = 2.0 * (xs[i] + xs[4 + i]);
            let got = g[o * 4 + i];
            assert!(
                (got - want).abs() < 2e-2 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }
}

fn mlp(seed: u64) -> Sequential {
    Sequential::new()
        .with(Linear::new(8, 16, true, &dev(), seed).unwrap())
        .with(ReLU::new())
        .with(Linear::new(16, 4, true, &dev(), seed + 1).unwrap())
}

/// apex's test_cache: train → eval under no_grad → train, against an FP32 model; a no_grad
/// cast reused in training would leave the weights without gradients, a stale one would use
/// pre-step values.
pub fn cache_never_goes_stale_across_train_eval_train() {
    let reference = mlp(10);
    let model = mlp(10);
    let mut ref_opt = sgd(reference.parameters(), 0.5, 0.0);
    let opt = sgd(model.parameters(), 0.5, 0.0);
    let (model, mut opt) = amp::initialize(model, opt, Policy::opt_level(OptLevel::O1)).unwrap();
    let x = randn(&[6, 8], 3, DType::F32);
    let t = randn(&[6, 4], 4, DType::F32);
    for phase in ["train", "eval", "train", "eval", "train"] {
        if phase == "eval" {
            let _ng = mixprec::no_grad();
            model.eval();
            reference.eval();
            let a = model.forward(&x).unwrap().to_vec_f64().unwrap();
            let b = reference.forward(&x).unwrap().to_vec_f64().unwrap();
            for (a, b) in a.iter().zip(&b) {
                assert!((a - b).abs() < 2e-2 * b.abs().max(1.0), "eval: {a} vs {b}");
            }
            model.set_training(true);
            reference.set_training(true);
            continue;
        }
        opt.zero_grad().unwrap();
        ref_opt.zero_grad();
        let loss = mse_loss(&model.forward(&x).unwrap(), &t, Reduction::Mean).unwrap();
        opt.backward(&loss).unwrap();
        let rl = mse_loss(&reference.forward(&x).unwrap(), &t, Reduction::Mean).unwrap();
        rl.backward().unwrap();
        for (p, r) in model.parameters().iter().zip(reference.parameters()) {
            let g = p
                .grad()
                .expect("a training forward after eval must reach the weights");
            let s = opt.stats().unwrap()[0].scale;
            let (g, r) = (
                g.to_vec_f64().unwrap(),
                r.grad().unwrap().to_vec_f64().unwrap(),
            );
            for (g, r) in g.iter().zip(&r) {
                let g = g / s;
                assert!(
                    (g - r).abs() < 1e-2 + 2e-2 * r.abs(),
                    "{phase}: grad {g} vs {r}"
                );
            }
        }
        opt.step().unwrap();
        ref_opt.step().unwrap();
    }
}

// ---- checkpoint and restore --------------------------------------------------------------------

fn convnet(seed: u64) -> Sequential {
    let cfg = Conv2dConfig {
        padding: (1, 1),
        ..Default::default()
    };
    Sequential::new()
        .with(Conv2d::new(2, 4, (3, 3), cfg, false, &dev(), seed).unwrap())
        .with(BatchNorm2d::new(4, &dev()).unwrap())
        .with(ReLU::new())
        .with(Flatten::new(1, -1))
        .with(Linear::new(4 * 5 * 5, 3, true, &dev(), seed + 1).unwrap())
}

fn batch(i: usize) -> (Tensor, Tensor) {
    let x = randn(&[4, 2, 5, 5], 100 + i as u64, DType::F32);
    let y = Tensor::from_vec(
        (0..4).map(|k| ((i + k) % 3) as i64).collect::<Vec<_>>(),
        [4],
        dev(),
    )
    .unwrap();
    (x, y)
}

fn policies() -> Vec<(&'static str, Policy)> {
    let small_window = |p: Policy| {
        p.with_scale_window(3)
            .with_init_scale(256.0)
            .with_report_interval(0)
    };
    vec![
        ("O0", small_window(Policy::opt_level(OptLevel::O0))),
        ("O1", small_window(Policy::opt_level(OptLevel::O1))),
        ("O2", small_window(Policy::opt_level(OptLevel::O2))),
        ("O3", small_window(Policy::opt_level(OptLevel::O3))),
        (
            "O2 bf16",
            small_window(Policy::opt_level(OptLevel::O2).with_half_dtype(DType::BF16)),
        ),
    ]
}

fn train_steps(
    model: &amp::AmpModel<Sequential>,
    opt: &mut amp::AmpOptimizer<Sgd>,
    steps: std::ops::Range<usize>,
) {
    for i in steps {
        let (x, y) = batch(i);
        let loss = mixprec::nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        opt.zero_grad().unwrap();
        amp::scale_loss(&loss, opt, |s| s.backward()).unwrap();
        opt.step().unwrap();
    }
}

fn fresh(policy: &Policy) -> (amp::AmpModel<Sequential>, amp::AmpOptimizer<Sgd>) {
    let m = convnet(7);
    let o = sgd(m.parameters(), 0.05, 0.9);
    amp::initialize(m, o, policy.clone()).unwrap()
}

pub fn checkpoint_at_step_5_of_10_restores_bitwise_at_every_level() {
    // Bitwise equality across runs needs deterministic convolutions on a GPU (a timed choice
    // may pick an engine that reduces with atomics; seen at O0 on an H200). No effect on the CPU.
    mixprec::backend::cuda::set_deterministic(true);
    for (name, policy) in policies() {
        let (m_a, mut o_a) = fresh(&policy);
        train_steps(&m_a, &mut o_a, 0..10);

        let (m_b, mut o_b) = fresh(&policy);
        train_steps(&m_b, &mut o_b, 0..5);
        let model_state = m_b.state_dict().unwrap();
        let opt_state = o_b.state_dict().unwrap();
        for (n, t) in &model_state {
            assert!(
                t.dtype() == DType::F32 || t.dtype() == DType::I64,
                "{name}: state_dict entry {n} is {}",
                t.dtype()
            );
        }
        drop((m_b, o_b));

        let (m_c, mut o_c) = fresh(&policy);
        m_c.load_state_dict(&model_state).unwrap();
        o_c.load_state_dict(&opt_state).unwrap();
        assert_eq!(
            o_c.stats().unwrap()[0].scale,
            opt_state.scalers[0].loss_scale
        );
        train_steps(&m_c, &mut o_c, 5..10);

        let (a, c) = (m_a.state_dict().unwrap(), m_c.state_dict().unwrap());
        for ((na, ta), (_, tc)) in a.iter().zip(&c) {
            assert_eq!(bits(ta), bits(tc), "{name}: {na} differs after restore");
        }
        for (pa, pc) in m_a.parameters().iter().zip(m_c.parameters()) {
            assert_eq!(pa.dtype(), pc.dtype());
            assert_eq!(bits(pa), bits(&pc), "{name}: model weights differ");
        }
        let (sa, sc) = (o_a.stats().unwrap()[0], o_c.stats().unwrap()[0]);
        assert_eq!((sa.scale, sa.unskipped), (sc.scale, sc.unskipped), "{name}");
        if name == "O2" || name == "O1" {
            // The window of 3 made the dynamic scale grow across the checkpoint.
            assert!(sa.scale > 256.0, "{name}: scale {}", sa.scale);
        }
    }
}

pub fn casts_per_level() {
    for (name, policy) in policies() {
        let (m, o) = fresh(&policy);
        let props = *m.properties();
        let seq = m.inner();
        let conv_w = seq.get(0).unwrap().parameters()[0].dtype();
        let bn_w = seq.get(1).unwrap().parameters()[0].dtype();
        let want_conv = props.cast_model_type.unwrap_or(DType::F32);
        assert_eq!(conv_w, want_conv, "{name}");
        let want_bn = if props.keep_batchnorm_fp32 {
            DType::F32
        } else {
            want_conv
        };
        assert_eq!(bn_w, want_bn, "{name}");
        let masters = o.master_params();
        assert!(masters.iter().all(|t| t.dtype() == DType::F32) || name.starts_with("O3"));
        assert_eq!(props.master_weights, name.starts_with("O2"));
        // Outputs are FP32 at O2/O3, inputs cast to the model's type.
        let (x, _) = batch(0);
        let y = m.forward(&x).unwrap();
        let want = if name == "O1" { DType::F16 } else { DType::F32 };
        assert_eq!(y.dtype(), want, "{name}");
    }
}

// ---- loss scaling ------------------------------------------------------------------------------

/// apex's test_loss_scale_decrease: three losses with their own scalers; losses blown up to
/// force overflows on a schedule. Each scaler ends at init/2^k (k its overflows) with unskipped 0.
pub fn three_scalers_decrease_independently() {
    for level in [OptLevel::O1, OptLevel::O2] {
        let m = mlp(3);
        let o = sgd(m.parameters(), 0.01, 0.0);
        let policy = Policy::opt_level(level)
            .with_num_losses(3)
            .with_report_interval(0);
        let (m, mut o) = amp::initialize(m, o, policy).unwrap();
        let x = randn(&[4, 8], 1, DType::F32);
        let t = randn(&[4, 4], 2, DType::F32);
        // overflow[i][j]: whether loss j overflows at iteration i; the last iteration overflows
        // for all three, so unskipped ends at 0.
        let overflow = [
            [true, false, true],
            [false, false, true],
            [false, true, true],
            [true, true, true],
        ];
        let mut before = Vec::new();
        for (i, row) in overflow.iter().enumerate() {
            o.zero_grad().unwrap();
            before.push(m.state_dict().unwrap());
            for (j, &blow) in row.iter().enumerate() {
                let mut loss = mse_loss(&m.forward(&x).unwrap(), &t, Reduction::Mean).unwrap();
                if blow {
                    loss = loss.mul_scalar(1e36).unwrap();
                }
                amp::scale_loss_id(&loss, j, &mut o, |s| s.backward()).unwrap();
            }
            o.step().unwrap();
            // every iteration overflows for some loss: the step is skipped, nothing moves.
            let after = m.state_dict().unwrap();
            for ((n, a), (_, b)) in before[i].iter().zip(&after) {
                assert_eq!(bits(a), bits(b), "{level} iteration {i}: {n} changed");
            }
        }
        let stats = o.stats().unwrap();
        for (j, s) in stats.iter().enumerate() {
            let k = overflow.iter().filter(|r| r[j]).count() as i32;
            assert_eq!(s.scale, 65536.0 / 2f64.powi(k), "{level}: scaler {j}");
            assert_eq!(s.unskipped, 0, "{level}: scaler {j}");
            assert_eq!(s.skipped_total, k as u64, "{level}: scaler {j}");
            assert_eq!(s.steps, 4);
        }
    }
}

pub fn dynamic_scale_grows_after_the_window_and_clamps() {
    let m = mlp(5);
    let o = sgd(m.parameters(), 0.0, 0.0);
    let policy = Policy::opt_level(OptLevel::O1)
        .with_scale_window(2)
        .with_init_scale(4.0)
        .with_max_loss_scale(16.0)
        .with_report_interval(1);
    let (m, mut o) = amp::initialize(m, o, policy).unwrap();
    let x = randn(&[2, 8], 1, DType::F32);
    let mut scales = Vec::new();
    for _ in 0..8 {
        let loss = m.forward(&x).unwrap().sum_all().unwrap();
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
        scales.push(o.stats().unwrap()[0].scale);
    }
    assert_eq!(scales, [4.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0, 16.0]);
}

pub fn bf16_policy_runs_unscaled_and_trains() {
    let p = Policy::from_toml_file(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/O2_bf16.toml"))
        .unwrap()
        .with_report_interval(0);
    let m = convnet(1);
    let o = sgd(m.parameters(), 0.1, 0.9);
    let (m, mut o) = amp::initialize(m, o, p).unwrap();
    assert_eq!(
        m.inner().get(0).unwrap().parameters()[0].dtype(),
        DType::BF16
    );
    let mut first = None;
    let mut last = 0.0;
    for i in 0..12 {
        let (x, y) = batch(i % 2);
        let loss = mixprec::nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
        let l = loss.item().unwrap();
        first.get_or_insert(l);
        last = l;
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
    }
    let s = o.stats().unwrap()[0];
    assert!(!o.scalers().get(0).unwrap().is_dynamic());
    assert_eq!((s.scale, s.skipped_total), (1.0, 0));
    assert!(last < first.unwrap(), "{last} vs {first:?}");
}

// ---- several models, optimizers and losses with planted Inf -----------------------------------

/// apex's MyModel: two parameters, one reported as batch norm (kept FP32 at O2), one not.
struct TwoWeights {
    w_half: Tensor,
    w_fp32: Tensor,
    training: TrainingFlag,
}

impl TwoWeights {
    fn new(seed: u64) -> TwoWeights {
        let v = |s| {
            Tensor::from_vec(
                (0..4)
                    .map(|i| 0.25 * ((s + i) % 5) as f32 + 0.5)
                    .collect::<Vec<_>>(),
                [4],
                dev(),
            )
            .unwrap()
            .to_variable()
        };
        TwoWeights {
            w_half: v(seed),
            w_fp32: v(seed + 2),
            training: TrainingFlag::default(),
        }
    }
}

impl Module for TwoWeights {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.mul(&self.w_half)?.add(&x.mul(&self.w_fp32)?)
    }
    fn visit_own(&self, f: &mut dyn FnMut(&TensorInfo)) {
        f(&TensorInfo {
            name: "weight0",
            tensor: &self.w_half,
            kind: TensorKind::Parameter,
            batch_norm: false,
        });
        f(&TensorInfo {
            name: "weight1",
            tensor: &self.w_fp32,
            kind: TensorKind::Parameter,
            batch_norm: true,
        });
    }
    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}

/// What carries the planted Inf.
#[derive(Clone, Copy, Debug)]
enum Plant {
    /// The gradient of a parameter that is half at O2 (`weight0`).
    HalfGrad,
    /// The gradient of a parameter that stays FP32 at O2 (`weight1`).
    Fp32Grad,
}

fn plant_inf(p: &Tensor) {
    let g = p.grad().unwrap();
    let mut v = g.to_vec_f64().unwrap();
    v[0] = f64::INFINITY;
    let t = Tensor::from_vec(v, g.dims().to_vec(), dev())
        .unwrap()
        .to_dtype(g.dtype())
        .unwrap();
    p.set_grad(Some(t));
}

/// A layout of the multi-model test: which models each optimizer owns, which models each
/// loss reaches.
struct Layout {
    models: usize,
    opt_of_model: Vec<usize>,
    loss_models: Vec<Vec<usize>>,
}

/// One run: returns every model's weights after each iteration (from the state dict: FP32).
fn run_multi(
    layout: &Layout,
    policy: Option<Policy>,
    inject: Option<(usize, usize, Plant)>,
    iters: usize,
) -> Vec<Vec<Vec<u64>>> {
    let nopt = layout.opt_of_model.iter().max().unwrap() + 1;
    let models: Vec<TwoWeights> = (0..layout.models)
        .map(|i| TwoWeights::new(i as u64))
        .collect();
    let mut groups = vec![Vec::new(); nopt];
    for (mi, &oi) in layout.opt_of_model.iter().enumerate() {
        groups[oi].extend(models[mi].parameters());
    }
    let opts: Vec<Sgd> = groups.into_iter().map(|g| sgd(g, 0.125, 0.5)).collect();
    let x = Tensor::from_vec(vec![0.5f32, 1.0, 1.5, 2.0], [4], dev()).unwrap();
    let snapshot = |ms: &[&dyn Module]| -> Vec<Vec<u64>> {
        ms.iter()
            .flat_map(|m| m.state_dict().unwrap())
            .map(|(_, t)| bits(&t))
            .collect()
    };
    let mut out = Vec::new();
    match policy {
        None => {
            // The FP32 reference: plain optimizers; an injected iteration is skipped whole.
            let mut opts = opts;
            for it in 0..iters {
                for o in opts.iter_mut() {
                    o.zero_grad();
                }
                if inject.is_some_and(|(i, ..)| i == it) {
                    let ms: Vec<&dyn Module> = models.iter().map(|m| m as &dyn Module).collect();
                    out.push(snapshot(&ms));
                    continue;
                }
                for (li, ms) in layout.loss_models.iter().enumerate() {
                    let mut loss = Tensor::scalar(0.0, DType::F32, dev()).unwrap();
                    for &mi in ms {
                        let y = models[mi].forward(&x).unwrap().sum_all().unwrap();
                        loss = loss.add(&y.mul_scalar(li as f64 + 1.0).unwrap()).unwrap();
                    }
                    loss.backward().unwrap();
                }
                for o in opts.iter_mut() {
                    o.step().unwrap();
                }
                let ms: Vec<&dyn Module> = models.iter().map(|m| m as &dyn Module).collect();
                out.push(snapshot(&ms));
            }
        }
        Some(policy) => {
            // A scale at which the clean gradients (up to 2·2 per element) fit in f16.
            let policy = policy
                .with_init_scale(1024.0)
                .with_num_losses(layout.loss_models.len())
                .with_report_interval(0);
            let (models, mut opts) = amp::initialize_many(models, opts, policy).unwrap();
            for it in 0..iters {
                for o in opts.iter_mut() {
                    o.zero_grad().unwrap();
                }
                for (li, ms) in layout.loss_models.iter().enumerate() {
                    let mut loss = Tensor::scalar(0.0, DType::F32, dev()).unwrap();
                    for &mi in ms {
                        let y = models[mi].forward(&x).unwrap().sum_all().unwrap();
                        loss = loss.add(&y.mul_scalar(li as f64 + 1.0).unwrap()).unwrap();
                    }
                    // The optimizers whose parameters this loss reaches.
                    let mut which: Vec<usize> =
                        ms.iter().map(|&mi| layout.opt_of_model[mi]).collect();
                    which.sort_unstable();
                    which.dedup();
                    let mut refs: Vec<&mut dyn amp::ScaledBackward> = opts
                        .iter_mut()
                        .enumerate()
                        .filter(|(k, _)| which.contains(k))
                        .map(|(_, o)| o as &mut dyn amp::ScaledBackward)
                        .collect();
                    amp::scale_loss_many(&loss, li, &mut refs, |s| {
                        s.backward()?;
                        if let Some((i, l, plant)) = inject {
                            if i == it && l == li {
                                let m = &models[ms[0]].inner();
                                match plant {
                                    Plant::HalfGrad => plant_inf(&m.w_half),
                                    Plant::Fp32Grad => plant_inf(&m.w_fp32),
                                }
                            }
                        }
                        Ok(())
                    })
                    .unwrap();
                }
                for o in opts.iter_mut() {
                    o.step().unwrap();
                }
                let ms: Vec<&dyn Module> = models.iter().map(|m| m as &dyn Module).collect();
                out.push(snapshot(&ms));
            }
        }
    }
    out
}

fn as_f64(b: &[u64]) -> Vec<f64> {
    b.iter().map(|&x| f64::from_bits(x)).collect()
}

pub fn multiple_models_optimizers_losses_with_planted_inf() {
    let layouts = [
        // two models, one optimizer, two losses
        Layout {
            models: 2,
            opt_of_model: vec![0, 0],
            loss_models: vec![vec![0, 1], vec![1]],
        },
        // two models, two optimizers, two losses
        Layout {
            models: 2,
            opt_of_model: vec![0, 1],
            loss_models: vec![vec![0], vec![0, 1]],
        },
        // three models, two optimizers, two losses
        Layout {
            models: 3,
            opt_of_model: vec![0, 1, 1],
            loss_models: vec![vec![0, 1], vec![2]],
        },
    ];
    let iters = 3;
    for (k, layout) in layouts.iter().enumerate() {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for inject_it in [0, 1] {
                for inject_loss in 0..2 {
                    for plant in [Plant::HalfGrad, Plant::Fp32Grad] {
                        let inject = Some((inject_it, inject_loss, plant));
                        let amp_run =
                            run_multi(layout, Some(Policy::opt_level(level)), inject, iters);
                        // The reference skips the injected iteration for every optimizer that
                        // the overflowing loss reaches... which in these layouts is the
                        // optimizers of that loss's models; the others step. Compare per model.
                        let reach: Vec<usize> = layout.loss_models[inject_loss]
                            .iter()
                            .map(|&m| layout.opt_of_model[m])
                            .collect();
                        let reference = run_multi_partial(layout, inject_it, &reach, iters);
                        let what = format!("layout {k} {level} inf at iteration {inject_it} loss {inject_loss} {plant:?}");
                        // Skipped iteration: the optimizers reached changed nothing.
                        let before = if inject_it == 0 {
                            run_multi(layout, None, Some((0, 0, plant)), 1)[0].clone()
                        } else {
                            amp_run[inject_it - 1].clone()
                        };
                        let tol = if level == OptLevel::O3 { 2e-2 } else { 1e-5 };
                        for (t, (a, r)) in amp_run.iter().zip(&reference).enumerate() {
                            for (i, (a, r)) in a.iter().zip(r).enumerate() {
                                let (a, r) = (as_f64(a), as_f64(r));
                                for (x, y) in a.iter().zip(&r) {
                                    assert!(
                                        (x - y).abs() <= tol * y.abs().max(1.0),
                                        "{what}: iteration {t} tensor {i}: {a:?} vs reference {r:?}"
                                    );
                                }
                            }
                        }
                        // Models of reached optimizers are bitwise unchanged at the skip.
                        let mut ti = 0;
                        for (mi, &oi) in layout.opt_of_model.iter().enumerate() {
                            for _ in 0..2 {
                                if reach.contains(&oi) {
                                    assert_eq!(
                                        amp_run[inject_it][ti], before[ti],
                                        "{what}: model {mi} moved on a skipped step"
                                    );
                                }
                                ti += 1;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The FP32 reference where, at iteration `skip_it`, the optimizers in `skipped` do not step.
fn run_multi_partial(
    layout: &Layout,
    skip_it: usize,
    skipped: &[usize],
    iters: usize,
) -> Vec<Vec<Vec<u64>>> {
    let nopt = layout.opt_of_model.iter().max().unwrap() + 1;
    let models: Vec<TwoWeights> = (0..layout.models)
        .map(|i| TwoWeights::new(i as u64))
        .collect();
    let mut groups = vec![Vec::new(); nopt];
    for (mi, &oi) in layout.opt_of_model.iter().enumerate() {
        groups[oi].extend(models[mi].parameters());
    }
    let mut opts: Vec<Sgd> = groups.into_iter().map(|g| sgd(g, 0.125, 0.5)).collect();
    let x = Tensor::from_vec(vec![0.5f32, 1.0, 1.5, 2.0], [4], dev()).unwrap();
    let mut out = Vec::new();
    for it in 0..iters {
        for o in opts.iter_mut() {
            o.zero_grad();
        }
        for (li, ms) in layout.loss_models.iter().enumerate() {
            let mut loss = Tensor::scalar(0.0, DType::F32, dev()).unwrap();
            for &mi in ms {
                let y = models[mi].forward(&x).unwrap().sum_all().unwrap();
                loss = loss.add(&y.mul_scalar(li as f64 + 1.0).unwrap()).unwrap();
            }
            loss.backward().unwrap();
        }
        for (k, o) in opts.iter_mut().enumerate() {
            if !(it == skip_it && skipped.contains(&k)) {
                o.step().unwrap();
            }
        }
        out.push(
            models
                .iter()
                .flat_map(|m| m.state_dict().unwrap())
                .map(|(_, t)| bits(&t))
                .collect(),
        );
    }
    out
}

// ---- gradient accumulation, clipping, master params -----------------------------------------

pub fn accumulation_unscales_once_and_matches_fp32() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
        let reference = mlp(20);
        let mut ref_opt = sgd(reference.parameters(), 0.1, 0.9);
        let m = mlp(20);
        let o = sgd(m.parameters(), 0.1, 0.9);
        let (m, mut o) =
            amp::initialize(m, o, Policy::opt_level(level).with_report_interval(0)).unwrap();
        for step in 0..3u64 {
            o.zero_grad().unwrap();
            ref_opt.zero_grad();
            for micro in 0..3u64 {
                let x = randn(&[4, 8], 50 + 10 * step + micro, DType::F32);
                let t = randn(&[4, 4], 90 + 10 * step + micro, DType::F32);
                let loss = mse_loss(&m.forward(&x).unwrap(), &t, Reduction::Mean).unwrap();
                o.backward(&loss).unwrap();
                mse_loss(&reference.forward(&x).unwrap(), &t, Reduction::Mean)
                    .unwrap()
                    .backward()
                    .unwrap();
            }
            o.step().unwrap();
            ref_opt.step().unwrap();
        }
        let tol = if level == OptLevel::O0 { 1e-6 } else { 2e-2 };
        for (a, r) in m
            .state_dict()
            .unwrap()
            .iter()
            .zip(reference.state_dict().unwrap())
        {
            let (a, r) = (a.1.to_vec_f64().unwrap(), r.1.to_vec_f64().unwrap());
            for (x, y) in a.iter().zip(&r) {
                assert!(
                    (x - y).abs() <= tol * y.abs().max(1.0),
                    "{level}: {x} vs {y}"
                );
            }
        }
        assert_eq!(o.stats().unwrap()[0].steps, 3);
    }
}

pub fn clipping_uses_the_unscaled_norm() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2] {
        let reference = mlp(30);
        let mut ref_opt = sgd(reference.parameters(), 0.1, 0.0);
        let m = mlp(30);
        let o = sgd(m.parameters(), 0.1, 0.0);
        let (m, mut o) =
            amp::initialize(m, o, Policy::opt_level(level).with_report_interval(0)).unwrap();
        assert!(o.clip_grad_norm(Some(-1.0)).is_err());
        o.clip_grad_norm(Some(0.05)).unwrap();
        let x = randn(&[4, 8], 1, DType::F32);
        let t = randn(&[4, 4], 2, DType::F32);
        o.zero_grad().unwrap();
        o.backward(&mse_loss(&m.forward(&x).unwrap(), &t, Reduction::Mean).unwrap())
            .unwrap();
        o.step().unwrap();
        // The reference clips by hand (torch's clip_grad_norm_).
        mse_loss(&reference.forward(&x).unwrap(), &t, Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        let ps = reference.parameters();
        let norm: f64 = ps
            .iter()
            .flat_map(|p| p.grad().unwrap().to_vec_f64().unwrap())
            .map(|v| v * v)
            .sum::<f64>()
            .sqrt();
        assert!(norm > 0.05, "the test needs clipping to act");
        let coef = (0.05 / (norm + 1e-6)).min(1.0);
        for p in &ps {
            let g = p.grad().unwrap().mul_scalar(coef).unwrap();
            p.set_grad(Some(g));
        }
        ref_opt.step().unwrap();
        for (a, r) in m
            .state_dict()
            .unwrap()
            .iter()
            .zip(reference.state_dict().unwrap())
        {
            let (a, r) = (a.1.to_vec_f64().unwrap(), r.1.to_vec_f64().unwrap());
            for (x, y) in a.iter().zip(&r) {
                assert!(
                    (x - y).abs() <= 2e-3 * y.abs().max(1.0),
                    "{level}: {x} vs {y}"
                );
            }
        }
    }
}

pub fn o2_master_params_are_fp32_and_model_weights_follow_them() {
    let m = mlp(40);
    let o = sgd(m.parameters(), 0.1, 0.0);
    let policy = Policy::opt_level(OptLevel::O2)
        .with_init_scale(256.0)
        .with_report_interval(0);
    let (m, mut o) = amp::initialize(m, o, policy).unwrap();
    let start = o.master_params()[0].to_vec_f64().unwrap();
    let x = randn(&[4, 8], 1, DType::F32);
    for _ in 0..2 {
        o.zero_grad().unwrap();
        o.backward(&m.forward(&x).unwrap().sum_all().unwrap())
            .unwrap();
        o.step().unwrap();
    }
    for (p, master) in m.parameters().iter().zip(o.master_params()) {
        assert_eq!(p.dtype(), DType::F16);
        assert_eq!(master.dtype(), DType::F32);
        let want = master.to_dtype(DType::F16).unwrap();
        assert_eq!(bits(p), bits(&want));
    }
    assert_eq!(o.stats().unwrap()[0].skipped_total, 0);
    assert_ne!(
        o.master_params()[0].to_vec_f64().unwrap(),
        start,
        "the masters moved"
    );
    // The state dict holds the FP32 masters, also through an Arc.
    let masters = o.master_params();
    let shared: Arc<dyn Module> = Arc::new(m);
    let sd = shared.state_dict().unwrap();
    assert_eq!(sd.len(), masters.len());
    for ((n, t), m) in sd.iter().zip(&masters) {
        assert_eq!(bits(t), bits(m), "{n}");
    }
}

// ---- initialize's own errors -------------------------------------------------------------------

pub fn initialize_twice_is_an_error() {
    let model = Arc::new(mlp(60));
    let opt = sgd(model.parameters(), 0.1, 0.0);
    let (wrapped, wrapped_opt) =
        amp::initialize(model.clone(), opt, Policy::opt_level(OptLevel::O1)).unwrap();
    let opt2 = sgd(model.parameters(), 0.1, 0.0);
    let r = amp::initialize(model.clone(), opt2, Policy::opt_level(OptLevel::O1));
    assert!(
        matches!(r, Err(Error::InvalidArgument { .. })),
        "{:?}",
        r.err()
    );
    // The failed call changed nothing; after the wrappers are gone the parameters are free.
    drop((wrapped, wrapped_opt));
    let opt3 = sgd(model.parameters(), 0.1, 0.0);
    assert!(amp::initialize(model, opt3, Policy::opt_level(OptLevel::O1)).is_ok());
}

pub fn initialize_checks_its_inputs() {
    // An optimizer over parameters the model does not have.
    let m = mlp(70);
    let stranger = randn(&[2], 1, DType::F32).to_variable();
    let o = sgd(vec![stranger], 0.1, 0.0);
    assert!(amp::initialize(m, o, Policy::opt_level(OptLevel::O2)).is_err());
    // O2 needs an FP32 model to start from.
    let m = mlp(71);
    m.cast(DType::F16, false).unwrap();
    let o = sgd(m.parameters(), 0.1, 0.0);
    assert!(matches!(
        amp::initialize(m, o, Policy::opt_level(OptLevel::O2)),
        Err(Error::UnsupportedDType { .. })
    ));
    // One parameter in two optimizers.
    let m = mlp(73);
    let (o1, o2) = (sgd(m.parameters(), 0.1, 0.0), sgd(m.parameters(), 0.1, 0.0));
    assert!(amp::initialize_many(vec![m], vec![o1, o2], Policy::opt_level(OptLevel::O2)).is_err());
    // A loss id past num_losses.
    let m = mlp(72);
    let o = sgd(m.parameters(), 0.1, 0.0);
    let (m, mut o) = amp::initialize(m, o, Policy::opt_level(OptLevel::O1)).unwrap();
    let loss = m
        .forward(&randn(&[1, 8], 1, DType::F32))
        .unwrap()
        .sum_all()
        .unwrap();
    assert!(o.backward_with(1, &loss).is_err());
    // A loss that is not a single value.
    let y = m.forward(&randn(&[2, 8], 1, DType::F32)).unwrap();
    assert!(o.backward(&y).is_err());
}

// ---- the ResNet on Fashion-MNIST at every level -----------------------------------------------

pub fn tiny_resnet_trains_on_fashion_mnist_at_every_level() {
    use mixprec::data::{fashion_mnist, Dataset, FashionMnist, Split};
    use mixprec::nn::resnet::{ResNet, ResNetConfig, Stem};
    use mixprec::nn::BlockKind;
    let ds = FashionMnist::load_dir(fashion_mnist::bundled_dir(), Split::Train).unwrap();
    let (n, bs) = (256, 32);
    let mut batches = Vec::new();
    for b in 0..n / bs {
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for i in b * bs..(b + 1) * bs {
            let (img, label) = ds.get(i).unwrap();
            // 28x28 → 14x14 by 2x2 averages: a smaller, faster problem.
            for r in 0..14 {
                for c in 0..14 {
                    let at = |dr: usize, dc: usize| img[(2 * r + dr) * 28 + 2 * c + dc];
                    xs.push((at(0, 0) + at(0, 1) + at(1, 0) + at(1, 1)) / 4.0);
                }
            }
            ys.push(label);
        }
        batches.push((
            Tensor::from_vec(xs, [bs, 1, 14, 14], dev()).unwrap(),
            Tensor::from_vec(ys, [bs], dev()).unwrap(),
        ));
    }
    let config = ResNetConfig {
        block: BlockKind::Basic,
        blocks: vec![1, 1],
        widths: vec![8, 16],
        in_channels: 1,
        num_classes: 10,
        stem: Stem::Small,
        zero_init_residual: false,
        seed: 3,
    };
    let levels = [
        ("O0", Policy::opt_level(OptLevel::O0)),
        ("O1", Policy::opt_level(OptLevel::O1)),
        ("O2", Policy::opt_level(OptLevel::O2)),
        ("O3", Policy::opt_level(OptLevel::O3)),
        (
            "O2 bf16",
            Policy::opt_level(OptLevel::O2).with_half_dtype(DType::BF16),
        ),
    ];
    for (name, policy) in levels {
        let model = ResNet::new(&config, &dev()).unwrap();
        let opt = sgd(model.parameters(), 0.05, 0.9);
        let (model, mut opt) = amp::initialize(model, opt, policy.with_report_interval(0)).unwrap();
        let mut epoch_loss = Vec::new();
        for _epoch in 0..3 {
            let mut sum = 0.0;
            for (x, y) in &batches {
                let loss = mixprec::nn::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
                sum += loss.item().unwrap();
                opt.zero_grad().unwrap();
                amp::scale_loss(&loss, &mut opt, |s| s.backward()).unwrap();
                opt.step().unwrap();
            }
            epoch_loss.push(sum / batches.len() as f64);
        }
        eprintln!("{name}: mean loss per epoch {epoch_loss:?}");
        assert!(
            epoch_loss.iter().all(|l| l.is_finite()),
            "{name}: {epoch_loss:?}"
        );
        assert!(
            epoch_loss[2] < epoch_loss[0] * 0.9,
            "{name}: the loss did not decrease: {epoch_loss:?}"
        );
    }
}
