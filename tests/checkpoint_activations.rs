//! Activation checkpointing on the CPU (`nn::checkpoint`, `autograd::checkpoint`): a
//! checkpointed model's loss and every gradient are bitwise those of the plain model, with
//! dropout, under O0/O1/O2 (bf16 and f16 with the loss scaler), nested, with an input that needs
//! no gradient, through `backward_retain_graph`; the dropout generators end where the plain run
//! leaves them; misuse is an error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mixprec::autograd;
use mixprec::nn::{self, BlockConfig, Checkpoint, Dropout, Gpt, GptConfig, Module, Sequential};
use mixprec::nn::{Linear, TransformerBlock};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::{amp, DType, Device, Tensor};

const CPU: Device = Device::Cpu;

/// Each parameter's name and gradient bits.
type Grads = Vec<(String, Option<Vec<u64>>)>;

fn cfg() -> GptConfig {
    GptConfig {
        n_layer: 3,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 128,
        dropout: 0.1,
    }
}

fn ids(b: usize, t: usize, seed: u64, vocab: usize) -> Tensor {
    let v: Vec<i64> = mixprec::tensor::random::uniform(seed, b * t, 0.0, vocab as f64)
        .into_iter()
        .map(|u| u as i64)
        .collect();
    Tensor::from_vec(v, vec![b, t], CPU).unwrap()
}

/// Every value's bits (f64 holds f32, f16 and bf16 values exactly).
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn grads_of<M: Module + ?Sized>(m: &M) -> Grads {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().map(|g| bits(&g))))
        .collect()
}

fn assert_same(
    what: &str,
    plain: &[(String, Option<Vec<u64>>)],
    ck: &[(String, Option<Vec<u64>>)],
) {
    assert_eq!(plain.len(), ck.len(), "{what}: parameter count");
    // By position: a nested wrapper may name the same parameter differently.
    for ((n, a), (_, b)) in plain.iter().zip(ck) {
        assert!(a.is_some(), "{what}: {n} got no gradient");
        assert!(a == b, "{what}: the gradient of {n} differs");
    }
}

/// Two iterations of a GPT's loss and backward (no optimizer): each loss and every gradient.
fn gpt_plain_backward(checkpointed: bool) -> Vec<(u64, Grads)> {
    let m = Gpt::new(cfg(), 5, &CPU)
        .unwrap()
        .with_activation_checkpointing(checkpointed);
    let mut out = Vec::new();
    for step in 0..2 {
        let x = ids(2, 12, 10 + step, 128);
        let y = ids(2, 12, 20 + step, 128);
        m.zero_grad();
        let loss = m.loss(&x, &y).unwrap();
        loss.backward().unwrap();
        out.push((loss.item().unwrap().to_bits(), grads_of(&m)));
    }
    out
}

#[test]
fn gpt_with_dropout_checkpointed_gives_the_plain_gradients_bitwise() {
    let plain = gpt_plain_backward(false);
    let ck = gpt_plain_backward(true);
    for (i, ((lp, gp), (lc, gc))) in plain.iter().zip(&ck).enumerate() {
        // The second iteration's masks show that the generators were left where they were.
        assert_eq!(lp, lc, "loss of iteration {i}");
        assert_same(&format!("iteration {i}"), gp, gc);
    }
    assert_ne!(plain[0].0, plain[1].0);
    // The blocks are recomputed: a recompute in eval mode draws no dropout, which is an error.
    let m = Gpt::new(cfg(), 5, &CPU)
        .unwrap()
        .with_activation_checkpointing(true);
    let loss = m.loss(&ids(2, 12, 1, 128), &ids(2, 12, 2, 128)).unwrap();
    m.eval();
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("dropout draws"), "{err}");
}

/// Three AMP steps of a GPT under `policy`: each loss, the model's gradients after each
/// backward, and the parameters at the end.
fn gpt_amp_steps(policy: &amp::Policy, checkpointed: bool) -> Vec<(u64, Grads)> {
    let m = Gpt::new(cfg(), 6, &CPU)
        .unwrap()
        .with_activation_checkpointing(checkpointed);
    let opt = FusedAdam::new(
        m.parameters(),
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let (model, mut opt) = amp::initialize(m, opt, policy.clone()).unwrap();
    let mut out = Vec::new();
    for step in 0..3 {
        let x = ids(2, 12, 30 + step, 128);
        let y = ids(2, 12, 40 + step, 128);
        let loss = model.scope(|g| g.loss(&x, &y)).unwrap();
        opt.zero_grad().unwrap();
        opt.backward(&loss).unwrap();
        out.push((loss.item().unwrap().to_bits(), grads_of(model.inner())));
        opt.step().unwrap();
    }
    let params = model
        .inner()
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, Some(bits(&p))))
        .collect();
    out.push((0, params));
    out
}

#[test]
fn checkpointed_gpt_under_amp_is_bitwise_the_plain_one() {
    let policies = [
        ("O1 bf16", amp::Policy::builtin("O1_bf16").unwrap()),
        ("O2 bf16", amp::Policy::builtin("O2_bf16").unwrap()),
        ("O2 f16", amp::Policy::builtin("O2").unwrap()),
    ];
    for (name, policy) in policies {
        let plain = gpt_amp_steps(&policy, false);
        let ck = gpt_amp_steps(&policy, true);
        for (i, ((lp, gp), (lc, gc))) in plain.iter().zip(&ck).enumerate() {
            assert_eq!(lp, lc, "{name}: loss of step {i}");
            assert_same(&format!("{name}: step {i}"), gp, gc);
        }
        let (_, first) = &plain[0];
        let dtypes: Vec<DType> = Gpt::new(cfg(), 6, &CPU)
            .unwrap()
            .parameters()
            .iter()
            .map(|p| p.dtype())
            .collect();
        assert!(!first.is_empty() && !dtypes.is_empty());
    }
}

fn block_cfg() -> BlockConfig {
    BlockConfig {
        n_embd: 16,
        n_head: 2,
        n_inner: 64,
        dropout: 0.2,
        residual_init_std: 0.02,
    }
}

fn block(seed: u64) -> TransformerBlock {
    TransformerBlock::new(&block_cfg(), seed, &CPU).unwrap()
}

fn input(requires_grad: bool) -> Tensor {
    let x = Tensor::randn(vec![2, 8, 16], 0.0, 1.0, 77, DType::F32, CPU).unwrap();
    if requires_grad {
        x.to_variable()
    } else {
        x
    }
}

/// A loss of a `[2, 8, 16]` output whose gradient differs from element to element.
fn loss_of(y: &Tensor) -> Tensor {
    let w = Tensor::randn(vec![2, 8, 16], 0.0, 1.0, 78, DType::F32, CPU).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap()
}

/// The loss bits, every parameter's gradient and the input's, of `model` on one input.
fn run_stack(model: &dyn Module, x_grad: bool) -> (u64, Grads, Option<Vec<u64>>) {
    let x = input(x_grad);
    let loss = loss_of(&model.forward(&x).unwrap());
    loss.backward().unwrap();
    (
        loss.item().unwrap().to_bits(),
        grads_of(model),
        x.grad().map(|g| bits(&g)),
    )
}

#[test]
fn nested_and_repeated_checkpoints_give_the_plain_gradients() {
    let plain = Sequential::new()
        .with(block(1))
        .with(block(2))
        .with(block(3))
        .with(block(4));
    // [ckpt([ckpt(b1), b2]), b3, ckpt(b4)]
    let inner = Sequential::new()
        .with(nn::checkpoint(block(1)))
        .with(block(2));
    let ck = Sequential::new()
        .with(nn::checkpoint(inner))
        .with(block(3))
        .with(nn::checkpoint(block(4)));
    let names: Vec<String> = ck.named_parameters().into_iter().map(|(n, _)| n).collect();
    let want: Vec<String> = plain
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.len(), want.len());
    let (lp, gp, xp) = run_stack(&plain, true);
    let (lc, gc, xc) = run_stack(&ck, true);
    assert_eq!(lp, lc, "loss");
    assert_same("nested", &gp, &gc);
    assert!(xp.is_some() && xp == xc, "the input's gradient");
}

#[test]
fn an_input_without_gradient_still_trains_the_parameters() {
    let plain = Sequential::new().with(block(11)).with(block(12));
    let ck = Sequential::new()
        .with(nn::checkpoint(block(11)))
        .with(nn::checkpoint(block(12)));
    let (lp, gp, xp) = run_stack(&plain, false);
    let (lc, gc, xc) = run_stack(&ck, false);
    assert_eq!(lp, lc);
    assert_same("input without gradient", &gp, &gc);
    assert!(xp.is_none() && xc.is_none());
}

#[test]
fn retained_graphs_recompute_again() {
    let plain = Sequential::new().with(block(21));
    let ck = nn::checkpoint(block(21));
    let twice = |m: &dyn Module| {
        let x = input(true);
        let loss = loss_of(&m.forward(&x).unwrap());
        loss.backward_retain_graph().unwrap();
        loss.backward().unwrap();
        // A third walk finds the saved tensors released.
        let err = loss.backward().unwrap_err().to_string();
        assert!(err.contains("second time"), "{err}");
        (grads_of(m), x.grad().map(|g| bits(&g)))
    };
    let (gp, xp) = twice(&plain);
    let (gc, xc) = twice(&ck);
    assert_same("retained", &gp, &gc);
    assert!(xp.is_some() && xp == xc);
}

#[test]
fn the_dropout_generator_is_left_where_the_plain_run_leaves_it() {
    let d = Arc::new(Dropout::new(0.5, 9, &CPU).unwrap());
    let x = input(true);
    let y = nn::checkpointed_forward(&d, &x).unwrap();
    let after_forward = d.generator.state().unwrap();
    loss_of(&y).backward().unwrap();
    // The recompute drew from the recorded state, not from the generator.
    assert_eq!(d.generator.state().unwrap(), after_forward);
    let plain = Dropout::new(0.5, 9, &CPU).unwrap();
    let yp = plain.forward(&x.detach().to_variable()).unwrap();
    assert_eq!(bits(&yp), bits(&y));
    assert_eq!(plain.generator.state().unwrap(), after_forward);
    // The checkpointed input's gradient is the mask scaled: what the plain run gives.
    let xp = x.detach().to_variable();
    let plain2 = Dropout::new(0.5, 9, &CPU).unwrap();
    loss_of(&plain2.forward(&xp).unwrap()).backward().unwrap();
    assert_eq!(bits(&xp.grad().unwrap()), bits(&x.grad().unwrap()));
}

#[test]
fn a_function_of_several_inputs() {
    let a = Tensor::randn(vec![4, 5], 0.0, 1.0, 1, DType::F32, CPU)
        .unwrap()
        .to_variable();
    let b = Tensor::randn(vec![4, 5], 0.0, 1.0, 2, DType::F32, CPU)
        .unwrap()
        .to_variable();
    let lin = Linear::new(5, 3, true, &CPU, 3).unwrap();
    let f = |xs: &[Tensor], lin: &Linear| -> mixprec::Result<Tensor> {
        lin.forward(&xs[0].mul(&xs[1])?.add(&xs[0])?)?.sqr()
    };
    let plain = f(&[a.clone(), b.clone()], &lin).unwrap().sum_all().unwrap();
    plain.backward().unwrap();
    let want: Vec<_> = [&a, &b]
        .iter()
        .map(|t| bits(&t.grad().unwrap()))
        .chain(lin.parameters().iter().map(|p| bits(&p.grad().unwrap())))
        .collect();
    a.zero_grad();
    b.zero_grad();
    lin.zero_grad();
    let lin = Arc::new(lin);
    let l2 = lin.clone();
    let y = autograd::checkpoint("two_inputs", &[&a, &b], &lin.parameters(), move |xs| {
        f(xs, &l2)
    })
    .unwrap();
    assert!(y.requires_grad());
    y.sum_all().unwrap().backward().unwrap();
    let got: Vec<_> = [&a, &b]
        .iter()
        .map(|t| bits(&t.grad().unwrap()))
        .chain(lin.parameters().iter().map(|p| bits(&p.grad().unwrap())))
        .collect();
    assert_eq!(want, got);
    // Under no_grad it is the function itself, recording nothing.
    let y = mixprec::with_no_grad(|| {
        autograd::checkpoint("two_inputs", &[&a, &b], &[], |xs| xs[0].add(&xs[1]))
    })
    .unwrap();
    assert!(!y.requires_grad());
}

#[test]
fn misuse_is_an_error() {
    let x = input(true);
    // A computed tensor passed as a parameter.
    let computed = x.sqr().unwrap();
    let err = autograd::checkpoint("ck", &[&x], &[computed], |xs| xs[0].sqr())
        .unwrap_err()
        .to_string();
    assert!(err.contains("params"), "{err}");

    // Switched to eval between forward and backward: the recompute draws no dropout.
    let ck = Checkpoint::new(block(31));
    let y = ck.forward(&x).unwrap();
    ck.eval();
    let err = loss_of(&y).backward().unwrap_err().to_string();
    assert!(err.contains("dropout draws"), "{err}");
    ck.set_training(true);

    // A recompute of another shape.
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = autograd::checkpoint("shape_shifter", &[&x], &[], move |xs| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            xs[0].sqr()
        } else {
            xs[0].sqr()?.sum_dim(0, false)
        }
    })
    .unwrap();
    let err = loss_of(&y).backward().unwrap_err().to_string();
    assert!(
        err.contains("shape_shifter") && err.contains("recompute"),
        "{err}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // An error inside the recompute is the backward's error.
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = autograd::checkpoint("failing", &[&x], &[], move |xs| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            xs[0].sqr()
        } else {
            xs[0].matmul(&xs[0])
        }
    })
    .unwrap();
    assert!(loss_of(&y).backward().is_err());

    // The module still works after the failed passes.
    let (l1, g1, _) = run_stack(&ck, true);
    assert!(f64::from_bits(l1).is_finite() && g1.iter().all(|(_, g)| g.is_some()));
}
