//! The GPT model (nn::Gpt) on the CPU: names and sizes as Hugging Face's GPT-2, GPT-2's init, a
//! causal forward, the tied head, the weights' round trip through the HF layout, training that
//! lowers the loss under AMP, and sampling.

use mixprec::io::hf_gpt2::{gpt2_names, load_hf_gpt2, save_hf_gpt2, LM_HEAD};
use mixprec::nn::{generate, Gpt, GptConfig, Module, SampleConfig};
use mixprec::optim::{AdamConfig, FusedAdam};
use mixprec::{amp, DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn tiny() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 128,
        dropout: 0.0,
    }
}

fn ids(b: usize, t: usize, seed: u64, vocab: usize) -> Tensor {
    let v: Vec<i64> = mixprec::tensor::random::uniform(seed, b * t, 0.0, vocab as f64)
        .into_iter()
        .map(|u| u as i64)
        .collect();
    Tensor::from_vec(v, vec![b, t], CPU).unwrap()
}

#[test]
fn names_sizes_and_init_are_gpt2s() {
    let cfg = tiny();
    let m = Gpt::new(cfg, 0, &CPU).unwrap();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    let mut want = gpt2_names(cfg.n_layer);
    assert_eq!(
        want.pop().as_deref(),
        Some(LM_HEAD),
        "the tied head is not a parameter of its own"
    );
    assert_eq!(names, want);
    assert_eq!(m.num_parameters(), cfg.num_parameters());
    // GPT-2 124M as everybody counts it (with the vocabulary padded to 50304).
    assert_eq!(GptConfig::gpt2().num_parameters(), 124_475_904);
    let params: std::collections::HashMap<String, Tensor> =
        m.named_parameters().into_iter().collect();
    let std_of = |n: &str| {
        let v = params[n].to_vec_f64().unwrap();
        (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt()
    };
    let c_fc = std_of("transformer.h.0.mlp.c_fc.weight");
    let proj = std_of("transformer.h.0.mlp.c_proj.weight");
    assert!((c_fc - 0.02).abs() < 0.002, "{c_fc}");
    // Residual projections: 0.02 / sqrt(2 * n_layer) = 0.01 here.
    assert!((proj - 0.01).abs() < 0.0015, "{proj}");
    assert_eq!(std_of("transformer.h.1.attn.c_attn.bias"), 0.0);
    assert_eq!(
        params["transformer.ln_f.weight"].to_vec_f64().unwrap(),
        vec![1.0; 32]
    );
}

#[test]
fn forward_is_causal_and_the_first_loss_is_uniform() {
    let cfg = tiny();
    let m = Gpt::new(cfg, 1, &CPU).unwrap();
    let x = ids(2, 12, 3, cfg.vocab_size);
    let logits = m.forward(&x).unwrap();
    assert_eq!(logits.dims(), [2, 12, 128]);
    // Changing token 8 changes no logit before it.
    let mut v = x.to_vec::<i64>().unwrap();
    v[8] = (v[8] + 1) % 128;
    let x2 = Tensor::from_vec(v, vec![2, 12], CPU).unwrap();
    let l1 = logits.to_vec_f32().unwrap();
    let l2 = m.forward(&x2).unwrap().to_vec_f32().unwrap();
    let row = 128;
    assert_eq!(l1[..8 * row], l2[..8 * row], "positions before the change");
    assert_ne!(l1[8 * row..9 * row], l2[8 * row..9 * row]);
    // Small init: the loss starts near ln(V).
    let loss = m.loss(&x, &ids(2, 12, 4, 128)).unwrap().item().unwrap();
    assert!((loss - (128f64).ln()).abs() < 0.1, "{loss}");
    // Too long a context, and float ids, are errors.
    assert!(m.forward(&ids(1, 17, 0, 128)).is_err());
    assert!(m.forward(&x.to_dtype(DType::F32).unwrap()).is_err());
}

#[test]
fn weights_round_trip_through_the_hugging_face_layout() {
    let cfg = tiny();
    let m = Gpt::new(cfg, 2, &CPU).unwrap();
    let dir = scratch("hf");
    let path = dir.join("model.safetensors");
    save_hf_gpt2(&path, &m.state_dict().unwrap(), 100).unwrap();
    let (loaded, dims) = load_hf_gpt2(&path, 128).unwrap();
    assert_eq!(
        (dims.n_layer, dims.n_embd, dims.vocab_size, dims.n_positions),
        (2, 32, 100, 16)
    );
    let m2 = Gpt::new(cfg, 9, &CPU).unwrap();
    let entries: Vec<(String, Tensor)> = loaded.into_iter().filter(|(n, _)| n != LM_HEAD).collect();
    m2.load_state_dict(&entries).unwrap();
    // The padding rows (100..128) came back as zeros; the rest is the same model.
    let x = ids(1, 10, 5, 100);
    let a = m
        .forward(&x)
        .unwrap()
        .narrow(2, 0, 100)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let b = m2
        .forward(&x)
        .unwrap()
        .narrow(2, 0, 100)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + p.abs()), "{p} vs {q}");
    }
}

#[test]
fn training_lowers_the_loss_and_sampling_is_seeded() {
    let cfg = tiny();
    let m = Gpt::new(cfg, 3, &CPU).unwrap();
    let opt = FusedAdam::new(
        m.parameters(),
        AdamConfig {
            lr: 3e-3,
            weight_decay: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let (model, mut opt) = amp::initialize(m, opt, amp::Policy::builtin("O0").unwrap()).unwrap();
    // A repeating sequence: learnable from its own context.
    let seq: Vec<i64> = (0..17).map(|i| (i * 5 % 23) as i64).collect();
    let x = Tensor::from_vec(seq[..16].to_vec(), vec![1, 16], CPU).unwrap();
    let y = Tensor::from_vec(seq[1..].to_vec(), vec![1, 16], CPU).unwrap();
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..30 {
        let loss = model.scope(|g| g.loss(&x, &y)).unwrap();
        last = loss.item().unwrap();
        first.get_or_insert(last);
        opt.zero_grad().unwrap();
        opt.backward(&loss).unwrap();
        opt.step().unwrap();
    }
    assert!(last < 0.5 * first.unwrap(), "{first:?} -> {last}");
    let cfg_s = SampleConfig {
        max_new_tokens: 6,
        temperature: 1.0,
        top_k: Some(10),
        seed: 7,
        vocab: 100,
        context: 16,
    };
    let a = generate(&model, CPU, &[0, 5, 10], &cfg_s).unwrap();
    let b = generate(&model, CPU, &[0, 5, 10], &cfg_s).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 9);
    assert!(a.iter().all(|&t| t < 100));
    // Greedy continues the learnt sequence.
    let g = generate(
        &model,
        CPU,
        &[0, 5, 10],
        &SampleConfig {
            temperature: 0.0,
            ..cfg_s
        },
    )
    .unwrap();
    assert_eq!(&g[3..6], &[15, 20, 2]);
    assert!(model.is_training(), "sampling restores the training mode");
    assert!(generate(&model, CPU, &[], &cfg_s).is_err());
    assert!(generate(&model, CPU, &[100], &cfg_s).is_err());
}

/// A fresh scratch directory for one test (removed first if a crashed run left it).
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
