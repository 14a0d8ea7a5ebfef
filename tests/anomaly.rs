//! Anomaly mode (`mixprec::anomaly`): a planted non-finite value is named by its op, its module
//! path, dtype and shape, in the forward pass and in the backward pass, with the loss scale; with
//! the mode off nothing changes. The mode is process-wide: the tests take one lock.

use std::sync::{Mutex, MutexGuard};

use mixprec::amp::{self, LossScale, OptLevel, Policy};
use mixprec::anomaly::{self, Phase};
use mixprec::nn::{BlockKind, Linear, Module, ReLU, ResNet, ResNetConfig, Sequential, Stem};
use mixprec::optim::{Sgd, SgdConfig};
use mixprec::{DType, Device, Error, Result, Tensor};

const CPU: Device = Device::Cpu;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The lock, the mode on and no earlier finding. The mode guard comes first in the pair so that
/// it drops (restoring the mode) while the lock is still held: the other way round, the next
/// test could take the lock and turn the mode on just before this one's guard turned it off.
fn on() -> (anomaly::DetectGuard, MutexGuard<'static, ()>) {
    let lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let g = anomaly::detect_scope(true);
    anomaly::clear();
    (g, lock)
}

fn vec1(v: Vec<f32>) -> Result<Tensor> {
    let n = v.len();
    Tensor::from_vec(v, vec![n], CPU)
}

fn expect_anomaly<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Err(e @ Error::NonFinite { .. }) => e.to_string(),
        other => panic!("expected the anomaly error, got {other:?}"),
    }
}

/// Sets one value of a parameter (under no_grad).
fn plant(t: &Tensor, index: usize, v: f32) -> Result<()> {
    let mut vals = t.to_vec::<f32>()?;
    vals[index] = v;
    let _g = mixprec::no_grad();
    t.copy_in_place(&Tensor::from_vec(vals, t.dims().to_vec(), CPU)?)
}

#[test]
fn forward_names_the_op_that_made_the_nan() -> Result<()> {
    let _on = on();
    let x = vec1(vec![1.0, -1.0, 4.0])?;
    let y = x.mul_scalar(2.0)?.log()?; // log(-2): NaN
                                       // The finding is returned by the next op on this thread.
    let msg = expect_anomaly(y.sum_all());
    let r = anomaly::last_report().expect("a report");
    assert_eq!(r.phase, Phase::Forward);
    assert_eq!(r.op, "log", "{msg}");
    assert_eq!((r.nan, r.inf), (1, 0));
    assert_eq!(r.dtype, DType::F32);
    assert_eq!(r.shape, vec![3]);
    assert!(r.inputs.is_empty(), "the inputs were finite: {r:?}");
    assert!(msg.contains("`log`") && msg.contains("1 NaN"), "{msg}");
    // Once returned, the next ops run.
    y.sum_all()?;
    Ok(())
}

#[test]
fn forward_division_by_zero_in_a_custom_chain_and_check() -> Result<()> {
    let _on = on();
    let a = vec1(vec![1.0, 2.0])?;
    let b = vec1(vec![1.0, 0.0])?;
    let _scope = anomaly::module_scope("head");
    let q = a.add_scalar(1.0)?.div(&b)?;
    // Nothing follows: `check` returns it.
    let msg = expect_anomaly(anomaly::check());
    let r = anomaly::last_report().expect("a report");
    assert_eq!(
        (r.op, r.module.as_str(), r.inf),
        ("div", "head", 1),
        "{msg}"
    );
    assert!(msg.contains("in module `head`"), "{msg}");
    anomaly::check()?;
    drop(q);
    Ok(())
}

fn mlp() -> Result<Sequential> {
    Ok(Sequential::new()
        .with(Linear::new(4, 8, true, &CPU, 1)?)
        .with(ReLU::new())
        .with(Linear::new(8, 3, true, &CPU, 2)?))
}

#[test]
fn forward_names_the_module_of_a_weight_set_to_inf() -> Result<()> {
    let _on = on();
    let model = mlp()?;
    let (name, w) = model.named_parameters()[2].clone();
    assert_eq!(name, "2.weight");
    plant(&w, 5, f32::INFINITY)?;
    let x = Tensor::randn(vec![2, 4], 0.0, 1.0, 3, DType::F32, CPU)?;
    // The model's last op: the finding comes with the next operation (here the loss's).
    let msg = expect_anomaly(model.forward(&x).and_then(|y| y.sum_all()));
    let r = anomaly::last_report().expect("a report");
    assert_eq!(r.phase, Phase::Forward);
    assert_eq!(r.module, "2", "{msg}");
    assert_eq!(r.op, "linear", "{msg}");
    assert_eq!(
        r.inputs,
        vec![1],
        "the weight is the linear's input 1: {msg}"
    );
    assert!(msg.contains("already held non-finite"), "{msg}");
    Ok(())
}

/// `sqrt(|x|)`: finite at 0 forward, an infinite derivative there.
struct SqrtAbs;

impl Module for SqrtAbs {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.abs()?.sqrt()
    }
}

#[test]
fn backward_names_the_op_and_module_whose_gradient_is_inf() -> Result<()> {
    let _on = on();
    let model = Sequential::new()
        .with(Linear::new(4, 4, true, &CPU, 1)?)
        .with(SqrtAbs)
        .with(Linear::new(4, 2, true, &CPU, 2)?);
    // The first layer's output is exactly 0: sqrt is finite, its derivative is not.
    for p in &model.parameters()[..2] {
        let _g = mixprec::no_grad();
        p.copy_in_place(&p.zeros_like()?)?;
    }
    let x = Tensor::randn(vec![3, 4], 0.0, 1.0, 5, DType::F32, CPU)?;
    let loss = model.forward(&x)?.sum_all()?;
    anomaly::check()?;
    let msg = expect_anomaly(loss.backward());
    let r = anomaly::last_report().expect("a report");
    assert_eq!(r.phase, Phase::Backward, "{msg}");
    assert_eq!(r.op, "sqrt", "{msg}");
    assert_eq!(r.module, "1", "{msg}");
    assert_eq!(r.inputs, vec![0]);
    assert_eq!(r.shape, vec![3, 4]);
    assert!(msg.contains("backward") && msg.contains("`sqrt`"), "{msg}");
    Ok(())
}

#[test]
fn resnet_paths_name_the_block_and_layer() -> Result<()> {
    let _on = on();
    let cfg = ResNetConfig {
        block: BlockKind::Basic,
        blocks: vec![1, 1],
        widths: vec![4, 8],
        in_channels: 3,
        num_classes: 5,
        stem: Stem::Small,
        zero_init_residual: false,
        seed: 0,
    };
    let model = ResNet::new(&cfg, &CPU)?;
    let w = model
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n == "layer2.0.conv2.weight")
        .expect("the parameter")
        .1;
    plant(&w, 0, f32::NAN)?;
    let x = Tensor::randn(vec![2, 3, 8, 8], 0.0, 1.0, 1, DType::F32, CPU)?;
    let msg = expect_anomaly(model.forward(&x));
    let r = anomaly::last_report().expect("a report");
    assert_eq!(
        (r.op, r.module.as_str()),
        ("conv2d", "layer2.0.conv2"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn the_report_gives_the_loss_scale_of_the_step() -> Result<()> {
    let _on = on();
    let m = Linear::new(4, 2, true, &CPU, 0)?;
    let o = Sgd::new(
        m.parameters(),
        SgdConfig {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let policy = Policy::opt_level(OptLevel::O1).with_loss_scale(LossScale::Static(128.0));
    let (m, mut o) = amp::initialize(m, o, policy)?;
    let x = Tensor::ones([3, 4], DType::F32, CPU)?;
    // Backward of sqrt at 0 under the scaled loss.
    let loss = m.forward(&x)?.mul_scalar(0.0)?.sqrt()?.sum_all()?;
    o.zero_grad()?;
    let msg = expect_anomaly(o.backward(&loss));
    let r = anomaly::last_report().expect("a report");
    assert_eq!(r.loss_scale, Some(128.0), "{msg}");
    assert!(msg.contains("loss scale 128"), "{msg}");
    Ok(())
}

#[test]
fn off_nothing_is_checked_and_results_are_the_same() -> Result<()> {
    let lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let run = |on: bool| -> Result<(Vec<f32>, Vec<f32>)> {
        let _g = anomaly::detect_scope(on);
        let model = mlp()?;
        let x = Tensor::randn(vec![5, 4], 0.0, 1.0, 9, DType::F32, CPU)?;
        let y = model.forward(&x)?;
        y.sqr()?.sum_all()?.backward()?;
        let g = model.parameters()[0].grad().expect("a gradient");
        Ok((y.to_vec::<f32>()?, g.to_vec::<f32>()?))
    };
    assert_eq!(run(true)?, run(false)?, "anomaly mode changes no value");
    // Off: a NaN goes through unreported.
    let off = anomaly::detect_scope(false);
    anomaly::clear();
    let y = vec1(vec![-1.0])?.log()?.sum_all()?;
    assert!(y.item()?.is_nan());
    anomaly::check()?;
    assert!(anomaly::last_report().is_none());
    assert_eq!(anomaly::module_path(), "", "no scopes kept when off");
    // The mode is restored before the lock is released (see `on`).
    drop(off);
    drop(lock);
    Ok(())
}

#[test]
fn detect_scope_restores_the_mode() {
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    anomaly::detect(false);
    {
        let _g = anomaly::detect_scope(true);
        assert!(anomaly::is_enabled());
    }
    assert!(!anomaly::is_enabled());
}
