//! Activation checkpointing on the GPU: a tiny GPT with every block checkpointed gives bitwise
//! the plain model's losses, gradients and parameters, on the flash-attention path (no dropout
//! on attention) and on the math path with dropout, eager and inside a captured CUDA-graph step
//! (whose replays then make no host synchronisation). Ignored on CI (no GPU): run with
//! `cargo test --test cuda_checkpoint -- --ignored` on a GPU machine.

use mixprec::amp::{self, CapturedStep};
use mixprec::backend::cuda::host_sync_count;
use mixprec::nn::{Gpt, GptConfig, Module};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::tensor::SdpaOptions;
use mixprec::{DType, Device, Tensor};

/// The tests capture CUDA graphs: one at a time (another thread's launches during a capture
/// make it fail).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpu() -> Device {
    // The ordered embedding backward: its default atomics would make even two plain runs differ.
    mixprec::backend::cuda::set_deterministic(true);
    Device::cuda(0).expect("these tests need a CUDA GPU")
}

/// Head dim 64: the flash path's, in f16/bf16 without dropout.
fn cfg(dropout: f64) -> GptConfig {
    GptConfig {
        n_layer: 3,
        n_head: 2,
        n_embd: 128,
        block_size: 64,
        vocab_size: 256,
        dropout,
    }
}

fn ids(b: usize, t: usize, seed: u64, vocab: usize, dev: Device) -> Tensor {
    let v: Vec<i64> = mixprec::tensor::random::uniform(seed, b * t, 0.0, vocab as f64)
        .into_iter()
        .map(|u| u as i64)
        .collect();
    Tensor::from_vec(v, vec![b, t], Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

struct Run {
    losses: Vec<u64>,
    /// Every gradient after the first (eager) backward.
    first_grads: Vec<(String, Vec<u64>)>,
    params: Vec<(String, Vec<u64>)>,
    replay_syncs: Option<u64>,
}

/// Six steps of `policy` (the first by hand, eager; then a step object, captured or not).
fn run(dropout: f64, policy: &str, checkpointed: bool, captured: bool) -> Run {
    let dev = gpu();
    let c = cfg(dropout);
    let m = Gpt::new(c, 3, &dev)
        .unwrap()
        .with_activation_checkpointing(checkpointed);
    let opt = FusedAdam::new(
        m.parameters(),
        AdamConfig {
            lr: 1e-3,
            weight_decay: 0.1,
            adam_w_mode: true,
            ..Default::default()
        },
    )
    .unwrap();
    let (model, mut opt) = amp::initialize(m, opt, amp::Policy::builtin(policy).unwrap()).unwrap();
    opt.clip_grad_norm(Some(1.0)).unwrap();
    let batches: Vec<(Tensor, Tensor)> = (0..3)
        .map(|i| (ids(4, 64, 10 + i, 256, dev), ids(4, 64, 20 + i, 256, dev)))
        .collect();
    let mut losses = Vec::new();
    let (x, y) = &batches[0];
    let loss = model.scope(|g| g.loss(x, y)).unwrap();
    opt.zero_grad().unwrap();
    opt.backward(&loss).unwrap();
    let first_grads = model
        .inner()
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n}: no gradient"));
            (n, bits(&g))
        })
        .collect();
    opt.step().unwrap();
    losses.push(loss.item().unwrap().to_bits());
    let body = |x: &Tensor, y: &Tensor| model.scope(|g| g.loss(x, y));
    let mut step = if captured {
        CapturedStep::new(&model, &mut opt, body).unwrap()
    } else {
        CapturedStep::eager(&model, &mut opt, body).unwrap()
    };
    let mut replay_syncs = None;
    for i in 0..5 {
        let (x, y) = &batches[i % 3];
        let before = host_sync_count();
        let loss = step.run(x, y).unwrap();
        if captured && i == 4 {
            replay_syncs = Some(host_sync_count() - before);
        }
        losses.push(loss.item().unwrap().to_bits());
    }
    if captured {
        assert!(step.stats().captures >= 1, "the step was captured");
    }
    let params = model
        .inner()
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, bits(&p)))
        .collect();
    Run {
        losses,
        first_grads,
        params,
        replay_syncs,
    }
}

/// Whether two runs are bitwise equal (losses, first gradients, parameters).
fn equal(a: &Run, b: &Run) -> bool {
    a.losses == b.losses && a.first_grads == b.first_grads && a.params == b.params
}

/// [`same`] where two plain runs repeat bit for bit; where they do not (the flash backward adds
/// dQ with f32 atomics in an order that varies between runs, deterministic switch or not), the
/// checkpointed run must stay as close to the plain one as a second plain run is.
fn same_or_within_noise(what: &str, plain: &Run, control: &Run, ck: &Run) {
    if equal(plain, control) {
        return same(what, plain, ck);
    }
    let dist = |a: &Run, b: &Run| {
        a.losses
            .iter()
            .zip(&b.losses)
            .map(|(x, y)| (f64::from_bits(*x) - f64::from_bits(*y)).abs())
            .fold(0.0, f64::max)
    };
    let (noise, got) = (dist(plain, control), dist(plain, ck));
    println!("{what}: two plain runs differ (loss by {noise:.2e}); checkpointed by {got:.2e}");
    assert!(
        got <= 4.0 * noise.max(1e-6),
        "{what}: {got:e} against run-to-run {noise:e}"
    );
}

fn same(what: &str, plain: &Run, ck: &Run) {
    assert_eq!(plain.losses, ck.losses, "{what}: losses");
    for ((n, a), (_, b)) in plain.first_grads.iter().zip(&ck.first_grads) {
        assert!(a == b, "{what}: the gradient of {n} differs");
    }
    for ((n, a), (_, b)) in plain.params.iter().zip(&ck.params) {
        assert!(a == b, "{what}: parameter {n} differs after the steps");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_gpt_checkpointed_is_bitwise_the_plain_one() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let probe = Tensor::zeros(vec![4, 2, 64, 64], DType::BF16, dev).unwrap();
    let path = probe.attention_path(
        &probe,
        &probe,
        &SdpaOptions {
            causal: true,
            ..Default::default()
        },
    );
    println!("attention path: {path:?}");
    for captured in [false, true] {
        for policy in ["O2_bf16", "O2", "O1_bf16"] {
            let what = format!("{policy}, captured {captured}");
            let plain = run(0.0, policy, false, captured);
            let control = run(0.0, policy, false, captured);
            let ck = run(0.0, policy, true, captured);
            same_or_within_noise(&what, &plain, &control, &ck);
            if captured {
                assert_eq!(ck.replay_syncs, Some(0), "{what}: host syncs in a replay");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpt_with_dropout_checkpointed_is_bitwise_the_plain_one() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for captured in [false, true] {
        for policy in ["O2_bf16", "O0"] {
            let what = format!("dropout, {policy}, captured {captured}");
            let plain = run(0.1, policy, false, captured);
            let ck = run(0.1, policy, true, captured);
            same(&what, &plain, &ck);
            if captured {
                assert_eq!(ck.replay_syncs, Some(0), "{what}: host syncs in a replay");
            }
        }
    }
}
