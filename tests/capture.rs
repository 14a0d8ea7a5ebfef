//! CUDA-graph capture, the parts that need no GPU: capture on the CPU is an error; the step
//! object run eagerly is the plain AMP loop bit for bit (every optimizer and level, a learning
//! rate that changes every step, planted overflows, clipping, micro-batches); the capturable
//! optimizer math (hyperparameters read from the device block, set by `set_lr`); persistent
//! in-place gradients; the in-place ops and the named multi-tensor lists in errors; the FP32
//! masters' single owner. The captured side is tests/cuda_capture.rs.

mod capture_support;

use capture_support::{run, Case, Kind, Mode, Net, KINDS, LEVELS, OVERFLOW_AT};
use mixprec::amp::{self, CapturedStep, OptLevel, Policy};
use mixprec::backend::{MtArray, MtKernel, MtList};
use mixprec::multi_tensor::{self, Row, Scalars};
use mixprec::nn::{self, Linear, Module, Sequential};
use mixprec::optim::{AdamConfig, FusedAdam, FusedSgd, GradScaling, Optimizer, SgdConfig};
use mixprec::{graph, DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

#[test]
fn capture_needs_a_cuda_device() {
    match graph::capture(CPU, || Ok(())) {
        Err(Error::Capture { op, detail }) => {
            assert_eq!(op, "graph::capture");
            assert!(detail.contains("cpu"), "{detail}");
        }
        other => panic!("expected a capture error, got {other:?}"),
    }
    assert!(!graph::is_capturing());
    let m = capture_support::model(Net::Mlp, CPU);
    let o = capture_support::optimizer(Kind::Sgd, m.parameters());
    let (model, mut opt) = amp::initialize(m, o, Policy::opt_level(OptLevel::O2)).unwrap();
    let r = CapturedStep::new(&model, &mut opt, |x, y| {
        nn::cross_entropy(&model.forward(x)?, y)
    });
    match &r {
        Err(Error::Capture { op, detail }) => {
            assert_eq!(*op, "CapturedStep::new");
            assert!(detail.contains("CapturedStep::eager"), "{detail}");
        }
        Err(e) => panic!("expected a capture error, got {e}"),
        Ok(_) => panic!("a CPU model was captured"),
    }
    drop(r);
    // Nothing changed: the optimizer still works eagerly.
    assert!(!opt.persistent_grads());
}

/// The step object, run eagerly, is the hand-written AMP loop bit for bit: parameters, FP32
/// masters, optimizer state, loss scale, skip counts, batch-norm buffers and losses.
#[test]
fn eager_step_object_is_the_hand_written_loop() {
    for kind in KINDS {
        for level in LEVELS {
            let case = Case::new(Net::Mlp, kind, level);
            let (hand, _) = run(&case, CPU, Mode::Hand, 0);
            let (eager, stats) = run(&case, CPU, Mode::Eager, 0);
            assert_eq!(stats.eager, case.steps as u64);
            assert_eq!((stats.captures, stats.replays), (0, 0));
            if let Some(d) = eager.diff(&hand) {
                panic!("{kind:?} {level}: eager step vs hand loop: {d}");
            }
            assert_eq!(
                hand.skipped(),
                vec![OVERFLOW_AT.len() as u64],
                "{kind:?} {level}: the planted overflows are skipped"
            );
        }
    }
}

#[test]
fn eager_step_object_with_batch_norm_clipping_and_micro_batches() {
    let mut case = Case::new(Net::Conv, Kind::Sgd, "O2");
    case.steps = 5;
    case.clip = Some(0.5);
    case.micro_batches = 2;
    let (hand, _) = run(&case, CPU, Mode::Hand, 2);
    let (eager, _) = run(&case, CPU, Mode::Eager, 2);
    if let Some(d) = eager.diff(&hand) {
        panic!("conv net, clip, 2 micro-batches: {d}");
    }
    // num_batches_tracked counted 2 forwards per step.
    let nbt = hand
        .tensors
        .iter()
        .find(|(n, _)| n.ends_with("num_batches_tracked"))
        .map(|(_, v)| f64::from_bits(v[0]))
        .unwrap();
    assert_eq!(nbt, 10.0);
}

/// The kernels read the learning rate (and the rest) from the device block that `set_lr`
/// writes, and the bias corrections from the device step counter: a schedule that changes
/// every step gives exactly the f32 formulas computed on the host.
#[test]
fn capturable_optimizer_math_follows_set_lr_every_step() {
    let w0 = 0.75f32;
    let g = 0.25f32;
    let lrs = [0.1, 0.03, 0.2, 0.07, 0.011];
    // SGD without momentum: w ← w − lr·g.
    let w = Tensor::from_vec(vec![w0], [1], CPU).unwrap().to_variable();
    let mut sgd = FusedSgd::new(vec![w.clone()], SgdConfig::default()).unwrap();
    let gen = sgd.generation();
    let mut want = w0;
    for &lr in &lrs {
        sgd.set_lr(0, lr).unwrap();
        w.set_grad(Some(Tensor::from_vec(vec![g], [1], CPU).unwrap()));
        sgd.step().unwrap();
        want -= lr as f32 * g;
        assert_eq!(w.to_vec::<f32>().unwrap()[0].to_bits(), want.to_bits());
    }
    assert_eq!(sgd.generation(), gen, "set_lr is not a structural change");
    sgd.set_config(
        0,
        SgdConfig {
            lr: 0.1,
            momentum: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(sgd.generation() > gen, "set_config is one");

    // Adam: bias corrections from the device step count (1, 2, ...), lr from the block.
    let w = Tensor::from_vec(vec![w0], [1], CPU).unwrap().to_variable();
    let cfg = AdamConfig::default();
    let mut adam = FusedAdam::new(vec![w.clone()], cfg).unwrap();
    let (b1, b2, eps) = (cfg.betas.0 as f32, cfg.betas.1 as f32, cfg.eps as f32);
    let (mut m, mut v, mut want) = (0.0f32, 0.0f32, w0);
    for (t, &lr) in lrs.iter().enumerate() {
        adam.set_lr(0, lr).unwrap();
        w.set_grad(Some(Tensor::from_vec(vec![g], [1], CPU).unwrap()));
        adam.step().unwrap();
        let step = (t + 1) as f32;
        m = b1 * m + (1.0 - b1) * g;
        v = b2 * v + (1.0 - b2) * g * g;
        let bc1 = 1.0 - b1.powf(step);
        let bc2 = 1.0 - b2.powf(step);
        let denom = v.sqrt() / bc2.sqrt() + eps;
        want -= (lr as f32 / bc1) * (m / denom);
        assert_eq!(
            w.to_vec::<f32>().unwrap()[0].to_bits(),
            want.to_bits(),
            "step {t}"
        );
    }
    // A skipped step (found_inf set) changes nothing, step count included.
    let before = adam.state_dict().unwrap();
    let found = Tensor::scalar(1.0, DType::F32, CPU).unwrap();
    let one = Tensor::scalar(1.0, DType::F32, CPU).unwrap();
    adam.set_lr(0, 0.5).unwrap();
    adam.step_scaled(Some(GradScaling {
        grad_multiplier: &one,
        found_inf: &found,
    }))
    .unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap()[0].to_bits(), want.to_bits());
    let after = adam.state_dict().unwrap();
    assert_eq!(
        before.state[&0]["step"].item().unwrap(),
        after.state[&0]["step"].item().unwrap()
    );
}

#[test]
fn persistent_gradients_accumulate_in_their_own_buffer() {
    let w = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], [3], CPU)
        .unwrap()
        .to_variable();
    let x = Tensor::from_vec(vec![0.5f32, 0.25, -1.0], [3], CPU).unwrap();
    w.zero_grad_in_place().unwrap();
    let g0 = w.grad().expect("zero_grad_in_place makes the buffer");
    assert_eq!(g0.to_vec::<f32>().unwrap(), vec![0.0; 3]);
    for k in 1..=3 {
        w.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
        let g = w.grad().unwrap();
        assert!(g.same_storage(&g0), "backward {k} added in place");
        let want: Vec<f32> = [0.5f32, 0.25, -1.0].iter().map(|v| v * k as f32).collect();
        assert_eq!(g.to_vec::<f32>().unwrap(), want);
    }
    w.zero_grad_in_place().unwrap();
    assert!(w.grad().unwrap().same_storage(&g0));
    assert_eq!(g0.to_vec::<f32>().unwrap(), vec![0.0; 3]);

    // A gradient the user set is never written in place; the default mode replaces tensors.
    let mine = Tensor::from_vec(vec![1.0f32; 3], [3], CPU).unwrap();
    w.set_grad(Some(mine.clone()));
    w.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(mine.to_vec::<f32>().unwrap(), vec![1.0; 3]);
    assert_eq!(
        w.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![1.5, 1.25, 0.0]
    );
    w.zero_grad();
    assert!(w.grad().is_none());

    // Half gradients round as the add op does.
    let h = Tensor::from_vec(vec![1.0f32, 3.0], [2], CPU)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()
        .to_variable();
    let xh = Tensor::from_vec(vec![1e-3f32, 2049.0], [2], CPU)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    h.zero_grad_in_place().unwrap();
    for _ in 0..2 {
        h.mul(&xh).unwrap().sum_all().unwrap().backward().unwrap();
    }
    let twice = xh.add(&xh).unwrap();
    assert_eq!(
        h.grad().unwrap().to_vec_f64().unwrap(),
        twice.to_vec_f64().unwrap()
    );
}

/// A CPU variable of `dt` holding `v`.
fn var(v: Vec<f32>, dt: DType) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, [n], CPU)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_variable()
}

/// Zeroing many persistent gradients: the ones with buffers of their own are cleared by one
/// multi-tensor call in place; the first call makes the buffers; f64 gradients (no
/// multi-tensor kernel) and tensors that collect no gradient are handled one by one.
#[test]
fn zero_grads_in_place_clears_every_buffer_with_one_call() {
    let vars = [
        var(vec![1.0, 2.0, 3.0], DType::F32),
        var(vec![4.0; 70_000], DType::F16), // more than one chunk
        var(vec![5.0, 6.0], DType::BF16),
        var(vec![7.0, 8.0], DType::F64),
        Tensor::from_vec(vec![1.0f32], [1], CPU).unwrap(), // not a variable
    ];
    let frozen = var(vec![1.0], DType::F32);
    frozen.set_requires_grad(false);
    let all: Vec<Tensor> = vars.iter().cloned().chain([frozen.clone()]).collect();
    let learn = &vars[..4];
    multi_tensor::zero_grads_in_place(&all).unwrap();
    let bufs: Vec<Tensor> = learn.iter().map(|v| v.grad().expect("made")).collect();
    assert!(frozen.grad().is_none() && vars[4].grad().is_none());
    for round in 0..2 {
        for v in learn {
            v.mul_scalar(3.0)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
        }
        for g in &bufs {
            assert!(
                g.to_vec_f64().unwrap().iter().all(|&x| x == 3.0),
                "round {round}"
            );
        }
        multi_tensor::recorder::start();
        multi_tensor::zero_grads_in_place(&all).unwrap();
        let calls = multi_tensor::recorder::stop();
        let zero: Vec<_> = calls
            .iter()
            .filter(|c| c.op == "multi_tensor::zero")
            .collect();
        assert_eq!(zero.len(), 1, "round {round}: one call");
        assert_eq!(
            zero[0].rows.len(),
            3,
            "round {round}: the f32, f16 and bf16 gradients"
        );
        for (v, g) in learn.iter().zip(&bufs) {
            let now = v.grad().unwrap();
            assert!(now.same_storage(g), "round {round}: kept its buffer");
            assert!(
                now.to_vec_f64().unwrap().iter().all(|&x| x == 0.0),
                "round {round}"
            );
        }
    }
}

/// A backward adds its gradients into the persistent buffers together (one launch per dtype on
/// CUDA; tests/cuda.rs compares those bits with these): the values are those of adding each as
/// it completes, and no user code in the pass sees a gradient without its add — a variable's
/// post-accumulate hook reads its own total, a custom function's backward and a callback queued
/// during the pass read every total decided before them.
#[test]
fn backward_adds_persistent_gradients_together_and_user_code_sees_them_added() {
    use std::sync::{Arc, Mutex};
    let a = var(vec![1.0, 2.0, 3.0], DType::F32);
    let b = var(vec![0.5; 9000], DType::F16);
    let c = var(vec![2.0, -1.0], DType::BF16);
    let d = var(vec![4.0, 8.0], DType::F64);
    let hooked = var(vec![1.0, 1.0], DType::F32);
    let vars = [&a, &b, &c, &d, &hooked];
    multi_tensor::zero_grads_in_place(&vars.map(|v| v.clone())).unwrap();
    let bufs: Vec<Tensor> = vars.iter().map(|v| v.grad().unwrap()).collect();
    let total = |t: &Tensor| t.to_vec_f64().unwrap();
    let seen_in_hook = Arc::new(Mutex::new(Vec::new()));
    let seen_in_custom = Arc::new(Mutex::new(Vec::new()));
    let seen_at_end = Arc::new(Mutex::new(Vec::new()));
    {
        let (s, h) = (seen_in_hook.clone(), hooked.clone());
        let (e, all) = (seen_at_end.clone(), vars.map(|v| v.clone()));
        hooked
            .register_post_accumulate_grad_hook(move |t| {
                s.lock().unwrap().push(t.grad().unwrap().to_vec_f64()?);
                assert!(t.same_storage(&h));
                let (e, all) = (e.clone(), all.clone());
                mixprec::autograd::queue_callback(move || {
                    let now: Vec<Vec<f64>> = all
                        .iter()
                        .map(|v| v.grad().unwrap().to_vec_f64())
                        .collect::<mixprec::Result<_>>()?;
                    e.lock().unwrap().push(now);
                    Ok(())
                })
            })
            .unwrap();
    }
    let scale = |t: &Tensor, k: f64| {
        t.mul_scalar(k)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let step = |k: f64| {
        // The engine walks a node's first operand's subgraph before its second's: hooked's
        // gradient is final first, then a, b and c's, then the custom function's backward runs
        // (reading two of them), then d's, whose add is still pending when the pass ends.
        let abc = scale(&a, k)
            .add(&scale(&b, k))
            .unwrap()
            .add(&scale(&c, k))
            .unwrap();
        let dk = scale(&d, k);
        let (s, ab) = (seen_in_custom.clone(), (a.clone(), b.clone()));
        let gate = mixprec::autograd::custom_function("gate", &[&dk], &dk.detach(), move |g| {
            let (ga, gb) = (ab.0.grad().unwrap(), ab.1.grad().unwrap());
            s.lock().unwrap().push((ga.to_vec_f64()?, gb.to_vec_f64()?));
            Ok(vec![Some(g.clone())])
        });
        scale(&hooked, k)
            .add(&abc)
            .unwrap()
            .add(&gate)
            .unwrap()
            .backward()
            .unwrap();
    };
    step(3.0);
    step(0.1);
    // The totals: each variable's 3 + 0.1 in its dtype (the second add rounds as `add`).
    for (v, buf) in vars.iter().zip(&bufs) {
        let g = v.grad().unwrap();
        assert!(g.same_storage(buf), "kept its buffer");
        let three = Tensor::full(v.dims().to_vec(), 3.0, v.dtype(), CPU).unwrap();
        let tenth = Tensor::full(v.dims().to_vec(), 0.1, v.dtype(), CPU).unwrap();
        let want = total(&three.add(&tenth).unwrap());
        assert!(total(&g) == want, "{:?}: {:?}", v.dtype(), &total(&g)[..2]);
    }
    let three = |v: &Tensor| total(&Tensor::full(v.dims().to_vec(), 3.0, v.dtype(), CPU).unwrap());
    let hook = seen_in_hook.lock().unwrap().clone();
    assert_eq!(hook.len(), 2);
    assert_eq!(hook[0], three(&hooked), "the hook sees its own add");
    let custom = seen_in_custom.lock().unwrap().clone();
    assert!(
        custom[0] == (three(&a), three(&b)),
        "the custom backward sees a and b added: {:?}, {:?}",
        custom[0].0,
        &custom[0].1[..2]
    );
    let end = seen_at_end.lock().unwrap().clone();
    assert_eq!(end.len(), 2);
    for (v, got) in vars.iter().zip(&end[0]) {
        assert!(
            *got == three(v),
            "the callback sees every gradient added: {:?} {:?}",
            v.dtype(),
            &got[..2]
        );
    }
}

/// Every level (with or without FP32 masters): the persistent gradients made by the first
/// `zero_grad` keep their buffers across steps (at O0/O1/O3 the optimizer's parameters are the
/// model's, and zero_grad once dropped the gradients it had just zeroed).
#[test]
fn amp_persistent_mode_keeps_gradient_buffers_across_steps() {
    for level in LEVELS {
        let m = capture_support::model(Net::Mlp, CPU);
        let o = capture_support::optimizer(Kind::AdamW, m.parameters());
        let (model, mut opt) = amp::initialize(m, o, capture_support::policy(level)).unwrap();
        opt.set_persistent_grads(true).unwrap();
        let mut first: Vec<Tensor> = Vec::new();
        for i in 0..3 {
            let (x, y) = capture_support::batch(Net::Mlp, i, 0, CPU);
            opt.zero_grad().unwrap();
            let zeroed: Vec<Tensor> = model
                .parameters()
                .iter()
                .map(|p| p.grad().expect("zero_grad keeps a zeroed gradient"))
                .collect();
            for g in &zeroed {
                let v = g.to_vec_f64().unwrap();
                assert!(v.iter().all(|&x| x == 0.0), "{level} step {i}: not zeroed");
            }
            opt.backward(&nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap())
                .unwrap();
            opt.step().unwrap();
            let grads: Vec<Tensor> = model
                .parameters()
                .iter()
                .map(|p| p.grad().unwrap())
                .collect();
            for (a, b) in zeroed.iter().zip(&grads) {
                assert!(
                    a.same_storage(b),
                    "{level} step {i}: backward moved a gradient"
                );
            }
            if first.is_empty() {
                first = grads;
            } else {
                for (a, b) in first.iter().zip(&grads) {
                    assert!(a.same_storage(b), "{level} step {i}: a gradient moved");
                }
            }
        }
        // Switching modes mid-step is refused.
        let (x, y) = capture_support::batch(Net::Mlp, 0, 0, CPU);
        opt.backward(&nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
        let e = opt.set_persistent_grads(false).unwrap_err().to_string();
        assert!(e.contains("between steps"), "{e}");
        opt.step().unwrap();
        opt.set_persistent_grads(false).unwrap();
    }
}

/// Two losses with two scalers: an overflow in loss 0's backward belongs to scaler 0 only, in
/// the persistent mode (gradients set aside in buffers of their own) as in the default one.
#[test]
fn persistent_mode_keeps_an_overflow_with_its_loss() {
    let run = |persistent: bool| {
        let m = capture_support::model(Net::Mlp, CPU);
        let o = capture_support::optimizer(Kind::Sgd, m.parameters());
        let policy = capture_support::policy("O2").with_num_losses(2);
        let (model, mut opt) = amp::initialize(m, o, policy).unwrap();
        opt.set_persistent_grads(persistent).unwrap();
        for i in 0..4 {
            opt.zero_grad().unwrap();
            for loss_id in 0..2 {
                // Step 1's first loss overflows.
                let (x, y) = capture_support::batch(
                    Net::Mlp,
                    if i == 1 && loss_id == 0 { 3 } else { i + 10 },
                    loss_id,
                    CPU,
                );
                let loss = nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
                opt.backward_with(loss_id, &loss).unwrap();
            }
            opt.step().unwrap();
        }
        let stats: Vec<(f64, u64)> = opt
            .stats()
            .unwrap()
            .iter()
            .map(|s| (s.scale, s.skipped_total))
            .collect();
        let params: Vec<Vec<f64>> = model
            .state_dict()
            .unwrap()
            .iter()
            .map(|(_, t)| t.to_vec_f64().unwrap())
            .collect();
        (stats, params)
    };
    let (s_default, p_default) = run(false);
    let (s_persistent, p_persistent) = run(true);
    assert_eq!(s_default[0].1, 1, "scaler 0 saw the overflow");
    assert_eq!(s_default[1].1, 0, "scaler 1 did not");
    assert_eq!(s_persistent, s_default);
    assert_eq!(p_persistent, p_default);
}

#[test]
fn in_place_ops_check_their_operands() {
    let a = Tensor::zeros([2, 3], DType::F32, CPU).unwrap();
    let e = a
        .copy_in_place(&Tensor::zeros([3, 2], DType::F32, CPU).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                op: "copy_in_place",
                ..
            }
        ),
        "{e}"
    );
    let e = a
        .add_in_place(&Tensor::zeros([2, 3], DType::F16, CPU).unwrap())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                op: "add_in_place",
                ..
            }
        ),
        "{e}"
    );
    let v = Tensor::ones([2], DType::F32, CPU).unwrap().to_variable();
    let e = v.zero_in_place().unwrap_err().to_string();
    assert!(e.contains("requires grad") && e.contains("no_grad"), "{e}");
    {
        let _ng = mixprec::no_grad();
        v.zero_in_place().unwrap();
    }
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
    let x = Tensor::from_vec(vec![1.5f32, -2.0], [2], CPU).unwrap();
    x.add_in_place(&x).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![3.0, -4.0]);
    // bf16 rounding is the add op's.
    let p = Tensor::from_vec(vec![1.0f32, 255.0], [2], CPU)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let q = Tensor::from_vec(vec![0.00390625f32, 1.0], [2], CPU)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let want = p.add(&q).unwrap().to_vec_f64().unwrap();
    p.add_in_place(&q).unwrap();
    assert_eq!(p.to_vec_f64().unwrap(), want);
}

/// Each kernel's lists and arrays have names, and a call that misses one is told which.
#[test]
fn multi_tensor_errors_name_the_lists() {
    let t = || Tensor::zeros([4], DType::F32, CPU).unwrap();
    let (g, p, m) = (t(), t(), t());
    let steps = Tensor::zeros([1], DType::F32, CPU).unwrap();
    // AdamHyper: lr 0 (so the parameter stays), betas, eps, no decay, AdamW, bias correction.
    let hyper = Tensor::from_vec(vec![0.0f32, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0], [7], CPU).unwrap();
    let row = Row::new(0)
        .with(MtList::Grad, &g)
        .with(MtList::Param, &p)
        .with(MtList::ExpAvg, &m);
    let sc = Scalars::default()
        .with(MtArray::Hyper, &hyper)
        .with(MtArray::Steps, &steps);
    let e = multi_tensor::apply("test", &MtKernel::Adam, std::slice::from_ref(&row), &sc)
        .unwrap_err()
        .to_string();
    assert!(e.contains("exp_avg_sq") && e.contains("tensor 0"), "{e}");
    let short = Tensor::zeros([6], DType::F32, CPU).unwrap();
    let v = t();
    let full_row = row.with(MtList::ExpAvgSq, &v);
    let sc_short = Scalars::default()
        .with(MtArray::Hyper, &short)
        .with(MtArray::Steps, &steps);
    let e = multi_tensor::apply(
        "test",
        &MtKernel::Adam,
        std::slice::from_ref(&full_row),
        &sc_short,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("hyperparameters") && e.contains("7 words"),
        "{e}"
    );
    let no_steps = Scalars::default().with(MtArray::Hyper, &hyper);
    let e = multi_tensor::apply(
        "test",
        &MtKernel::Adam,
        std::slice::from_ref(&full_row),
        &no_steps,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("steps") && e.contains("missing"), "{e}");
    let f = Tensor::zeros([1], DType::F32, CPU).unwrap();
    let e = multi_tensor::apply(
        "test",
        &MtKernel::Check,
        &[Row::new(0).with(MtList::Input, &g).with(MtList::Out, &p)],
        &Scalars::default().with(MtArray::FoundInf, &f),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("only the lists check takes: input"), "{e}");
    // The complete call runs: the kernel reads its block (lr 0 leaves p as it was) and the
    // moments move.
    g.copy_in_place(&Tensor::ones([4], DType::F32, CPU).unwrap())
        .unwrap();
    multi_tensor::apply("test", &MtKernel::Adam, &[full_row], &sc).unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![0.0; 4]);
    let m1 = m.to_vec::<f32>().unwrap()[0];
    assert_eq!(
        m1.to_bits(),
        (1.0f32 - 0.9f32).to_bits(),
        "exp_avg = (1 - beta1)·g"
    );
}

/// The FP32 masters are one object: the model's FP32 state dict reads them, a restored
/// optimizer state writes into the same tensors (nothing to republish).
#[test]
fn masters_have_one_owner() {
    let m = capture_support::model(Net::Mlp, CPU);
    let o = capture_support::optimizer(Kind::Sgd, m.parameters());
    let (model, mut opt) = amp::initialize(m, o, Policy::opt_level(OptLevel::O2)).unwrap();
    let masters = opt.inner().master_weights().expect("O2 keeps masters");
    let before = masters.tensors();
    let saved = opt.state_dict().unwrap();
    let model_saved = model.state_dict().unwrap();
    for i in 0..2 {
        let (x, y) = capture_support::batch(Net::Mlp, i, 0, CPU);
        opt.zero_grad().unwrap();
        opt.backward(&nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap())
            .unwrap();
        opt.step().unwrap();
    }
    // The model's state dict is the masters' current values (set_lr on the way changes nothing).
    opt.inner_mut().set_lr_all(0.01).unwrap();
    let sd = model.state_dict().unwrap();
    let w = model.parameters()[0].id();
    let mw = masters.get(w).unwrap();
    assert_eq!(sd[0].1.to_vec_f64().unwrap(), mw.to_vec_f64().unwrap());
    assert_ne!(
        sd[0].1.to_vec_f64().unwrap(),
        model_saved[0].1.to_vec_f64().unwrap()
    );
    // Restoring writes into the same master tensors.
    opt.load_state_dict(&saved).unwrap();
    model.load_state_dict(&model_saved).unwrap();
    for (a, b) in before.iter().zip(masters.tensors()) {
        assert!(a.same_storage(&b), "a master was replaced");
    }
    assert_eq!(
        model.state_dict().unwrap()[0].1.to_vec_f64().unwrap(),
        model_saved[0].1.to_vec_f64().unwrap()
    );
}

#[test]
fn step_checks_its_batches() {
    let m = Sequential::new().with(Linear::new(16, 10, true, &CPU, 1).unwrap());
    let o = FusedSgd::new(m.parameters(), SgdConfig::default()).unwrap();
    let (model, mut opt) = amp::initialize(m, o, Policy::opt_level(OptLevel::O0)).unwrap();
    let mut step = CapturedStep::eager(&model, &mut opt, |x, y| {
        nn::cross_entropy(&model.forward(x)?, y)
    })
    .unwrap();
    let (x, y) = capture_support::batch(Net::Mlp, 0, 0, CPU);
    step.run(&x, &y).unwrap();
    let x4 = x.narrow(0, 0, 4).unwrap();
    let y4 = y.narrow(0, 0, 4).unwrap();
    let e = step.run(&x4, &y4).unwrap_err().to_string();
    assert!(e.contains("static input") && e.contains("[4, 16]"), "{e}");
    let e = step
        .run_accumulated(&[(x.clone(), y.clone()), (x.clone(), y.clone())])
        .unwrap_err()
        .to_string();
    assert!(e.contains("micro_batches"), "{e}");
    let mut bad = CapturedStep::eager(&model, step.optimizer(), |x, _| Ok(x.clone())).unwrap();
    let e = bad.run(&x, &y).unwrap_err().to_string();
    assert!(e.contains("loss") && e.contains("single"), "{e}");
    assert!(
        CapturedStep::eager(&model, bad.optimizer(), |x, _| Ok(x.clone()))
            .unwrap()
            .warmup_steps(0)
            .is_err()
    );
}

#[cfg(feature = "train")]
#[test]
fn run_config_has_the_cuda_graph_switch() {
    use mixprec::train::RunConfig;
    assert!(RunConfig::default().cuda_graph);
    let c = RunConfig::from_toml_str("cuda_graph = false", "t.toml").unwrap();
    assert!(!c.cuda_graph);
    match RunConfig::from_toml_str("cuda_graph = 1", "t.toml") {
        Err(Error::Config { key, .. }) => assert_eq!(key, "cuda_graph"),
        other => panic!("expected a config error, got {other:?}"),
    }
    // Checkpoints written before the key existed still load their config.
    let mut j = serde_json::to_value(RunConfig::default()).unwrap();
    j.as_object_mut().unwrap().remove("cuda_graph");
    let back: RunConfig = serde_json::from_value(j).unwrap();
    assert!(back.cuda_graph);
}

/// The steps of one case run by `CapturedStep::eager`, each step's multi-tensor calls recorded
/// (`eval_every` > 0: an eval forward after every that many steps, outside the record).
fn recorded_steps(case: &Case, eval_every: usize) -> Vec<Vec<multi_tensor::recorder::Call>> {
    use capture_support::{batch, lr_at, model, optimizer, policy};
    let m = model(case.net, CPU);
    let o = optimizer(case.kind, m.parameters());
    let (model, mut opt) = amp::initialize(m, o, policy(case.level)).unwrap();
    opt.clip_grad_norm(case.clip).unwrap();
    let mut step = CapturedStep::eager(&model, &mut opt, |x, y| {
        nn::cross_entropy(&model.forward(x)?, y)
    })
    .unwrap()
    .micro_batches(case.micro_batches)
    .unwrap();
    let mut steps = Vec::new();
    for i in 0..case.steps {
        step.optimizer()
            .inner_mut()
            .set_lr_all(lr_at(case.kind, i))
            .unwrap();
        let bs: Vec<(Tensor, Tensor)> = (0..case.micro_batches)
            .map(|mb| batch(case.net, i, mb, CPU))
            .collect();
        multi_tensor::recorder::start();
        let r = step.run_accumulated(&bs);
        // Held (with the buffers they name) until the end of the case.
        steps.push(multi_tensor::recorder::stop());
        r.unwrap();
        if eval_every > 0 && (i + 1) % eval_every == 0 {
            let _ng = mixprec::no_grad();
            model.eval();
            model.forward(&batch(case.net, 100 + i, 1, CPU).0).unwrap();
            model.set_training(true);
        }
    }
    steps
}

/// The first way step `b`'s multi-tensor calls differ from step `a`'s, if any.
fn first_list_change(
    a: &[multi_tensor::recorder::Call],
    b: &[multi_tensor::recorder::Call],
) -> Option<String> {
    if a.len() != b.len() {
        let names =
            |s: &[multi_tensor::recorder::Call]| -> Vec<&str> { s.iter().map(|c| c.op).collect() };
        return Some(format!(
            "{} calls {:?} vs {} calls {:?}",
            a.len(),
            names(a),
            b.len(),
            names(b)
        ));
    }
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        if x.op != y.op || x.kernel != y.kernel {
            return Some(format!(
                "call {k}: `{}` {:?} vs `{}` {:?}",
                x.op, x.kernel, y.op, y.kernel
            ));
        }
        if x.rows.len() != y.rows.len() {
            return Some(format!(
                "call {k} (`{}` {:?}): {} tensors vs {}",
                x.op,
                x.kernel,
                x.rows.len(),
                y.rows.len()
            ));
        }
        for (r, (p, q)) in x.rows.iter().zip(&y.rows).enumerate() {
            if p != q {
                let moved: Vec<usize> = (0..p.2.len()).filter(|&l| p.2[l] != q.2[l]).collect();
                return Some(format!(
                    "call {k} (`{}` {:?}), tensor {r}: (slot, len, addresses) {p:?} vs {q:?}: \
                     role(s) {moved:?} moved",
                    x.op, x.kernel
                ));
            }
        }
    }
    None
}

/// What a captured step needs of the eager steps before it: from the second step on, every
/// multi-tensor call of a step passes the same buffers, in the same order, as in the step
/// before (CUDA keys its chunk tables by these addresses and refuses a table first built
/// during capture; a replay runs on the addresses of capture time). Every level and optimizer,
/// planted overflows (skipped steps), and the conv net with clipping, micro-batches and eval
/// passes. The previous step's buffers are held, so a per-step temporary cannot reappear at
/// the same address by chance.
#[test]
fn every_step_passes_the_same_buffers_to_the_multi_tensor_calls() {
    let mut cases = Vec::new();
    for kind in KINDS {
        for level in LEVELS {
            cases.push((Case::new(Net::Mlp, kind, level), 0));
        }
    }
    for (kind, level) in [
        (Kind::Sgd, "O2"),
        (Kind::AdamW, "O1"),
        (Kind::Lamb, "O3"),
        (Kind::Sgd, "O0"),
        (Kind::AdamW, "O2 bf16"),
    ] {
        let mut case = Case::new(Net::Conv, kind, level);
        case.clip = Some(1.0);
        case.micro_batches = 2;
        case.steps = 5;
        cases.push((case, 2));
    }
    let mut failures = Vec::new();
    for (case, eval_every) in &cases {
        let steps = recorded_steps(case, *eval_every);
        assert!(
            steps.iter().all(|s| !s.is_empty()),
            "{case:?}: a step made no multi-tensor call"
        );
        for i in 1..steps.len() {
            if let Some(d) = first_list_change(&steps[i - 1], &steps[i]) {
                failures.push(format!(
                    "{:?} {:?} {} (clip {:?}, {} micro-batches): step {i} vs step {}: {d}",
                    case.net,
                    case.kind,
                    case.level,
                    case.clip,
                    case.micro_batches,
                    i - 1
                ));
                break;
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Half batch-norm statistics (O3 keeps BatchNorm in half) are updated in their own buffers:
/// a CUDA graph replays on their addresses, and a buffer made during a capture may not outlive
/// it (the H200 refused the O3 conv net's capture with "4 buffer(s) (64 bytes) allocated during
/// the capture are still alive": two layers' running mean and variance).
#[test]
fn half_batch_norm_statistics_keep_their_buffers() {
    let bn = nn::BatchNorm2d::new(8, &Device::Cpu).unwrap();
    for t in [&bn.running_mean, &bn.running_var, &bn.weight, &bn.bias] {
        t.cast_in_place(DType::F16).unwrap();
    }
    let addresses = || {
        multi_tensor::recorder::start();
        multi_tensor::l2norm(&[bn.running_mean.clone(), bn.running_var.clone()], false).unwrap();
        let calls = multi_tensor::recorder::stop();
        calls
            .iter()
            .flat_map(|c| c.rows.iter().flat_map(|r| r.2))
            .filter(|&a| a != 0)
            .collect::<Vec<u64>>()
    };
    let before = addresses();
    assert_eq!(before.len(), 2, "{before:?}");
    let vals: Vec<f32> = (0..2 * 8 * 3 * 3).map(|i| (i % 7) as f32 - 2.5).collect();
    let x = Tensor::from_vec(vals, [2, 8, 3, 3], Device::Cpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    bn.set_training(true);
    for _ in 0..2 {
        bn.forward(&x).unwrap();
    }
    assert_eq!(addresses(), before, "the statistics moved to new buffers");
    let mean = bn.running_mean.to_vec_f64().unwrap();
    assert!(mean.iter().any(|&m| m != 0.0), "not updated: {mean:?}");
}
