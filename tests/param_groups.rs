//! Optimizer parameter groups: per-group lr and weight decay in AdamW / LAMB against separate
//! optimizers and a hand-computed step, the name rule, schedules over groups, O2 masters,
//! checkpoints (round trip, and states saved before base learning rates were kept), errors.

use mixprec::amp::{self, OptLevel, Policy};
use mixprec::io::{Checkpoint, TrainProgress};
use mixprec::nn::{self, Embedding, LayerNorm, Linear, Module, TensorInfo};
use mixprec::optim::{
    decays_by_default, AdamConfig, FusedAdam, FusedLamb, LambConfig, LrSchedule, Optimizer,
    ParamGroup, ParamGroups, SgdConfig,
};
use mixprec::{DType, Device, Result, Tensor};

const CPU: Device = Device::Cpu;

fn randn(dims: &[usize], seed: u64) -> Tensor {
    Tensor::randn(dims, 0.0, 1.0, seed, DType::F32, CPU).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
}

/// Fresh variables of the given shapes (the same values for the same seed).
fn params(shapes: &[&[usize]], seed: u64) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, seed + i as u64).to_variable())
        .collect()
}

/// Gradients for step `t`, the same for every copy of the parameters.
fn set_grads(ps: &[Tensor], t: u64) {
    for (i, p) in ps.iter().enumerate() {
        p.set_grad(Some(randn(p.dims(), 1000 * t + i as u64)));
    }
}

const SHAPES: [&[usize]; 4] = [&[3, 4], &[4], &[5, 2], &[2]];

fn adam_configs() -> (AdamConfig, AdamConfig) {
    let a = AdamConfig {
        lr: 0.05,
        weight_decay: 0.1,
        ..Default::default()
    };
    let b = AdamConfig {
        lr: 0.01,
        weight_decay: 0.0,
        betas: (0.8, 0.99),
        ..Default::default()
    };
    (a, b)
}

#[test]
fn two_adamw_groups_equal_two_optimizers() {
    let (ca, cb) = adam_configs();
    let ps = params(&SHAPES, 1);
    let qs = params(&SHAPES, 1);
    let mut grouped = FusedAdam::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), ca),
        ParamGroup::new(ps[2..].to_vec(), cb),
    ])
    .unwrap();
    let mut first = FusedAdam::new(qs[..2].to_vec(), ca).unwrap();
    let mut second = FusedAdam::new(qs[2..].to_vec(), cb).unwrap();
    for t in 0..3 {
        set_grads(&ps, t);
        set_grads(&qs, t);
        grouped.step().unwrap();
        first.step().unwrap();
        second.step().unwrap();
    }
    for (p, q) in ps.iter().zip(&qs) {
        assert_eq!(vals(p), vals(q), "bitwise equal to separate optimizers");
    }
}

/// torch.optim.AdamW's two steps, in f64.
#[test]
fn two_adamw_groups_match_a_hand_computed_step() {
    let (ca, cb) = adam_configs();
    let ps = params(&SHAPES, 3);
    let init: Vec<Vec<f32>> = ps.iter().map(vals).collect();
    let mut opt = FusedAdam::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), ca),
        ParamGroup::new(ps[2..].to_vec(), cb),
    ])
    .unwrap();
    let steps = 2;
    let mut grads: Vec<Vec<Vec<f32>>> = vec![Vec::new(); ps.len()];
    for t in 0..steps {
        set_grads(&ps, t);
        for (i, p) in ps.iter().enumerate() {
            grads[i].push(vals(&p.grad().unwrap()));
        }
        opt.step().unwrap();
    }
    for (i, p) in ps.iter().enumerate() {
        let c = if i < 2 { ca } else { cb };
        let (b1, b2) = c.betas;
        let want: Vec<f64> = (0..init[i].len())
            .map(|k| {
                let (mut w, mut m, mut v) = (f64::from(init[i][k]), 0.0, 0.0);
                for (t, step_grads) in grads[i].iter().enumerate() {
                    let g = f64::from(step_grads[k]);
                    w *= 1.0 - c.lr * c.weight_decay;
                    m = b1 * m + (1.0 - b1) * g;
                    v = b2 * v + (1.0 - b2) * g * g;
                    let n = (t + 1) as i32;
                    let (mh, vh) = (m / (1.0 - b1.powi(n)), v / (1.0 - b2.powi(n)));
                    w -= c.lr * mh / (vh.sqrt() + c.eps);
                }
                w
            })
            .collect();
        for (k, (&got, want)) in vals(p).iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "parameter {i} element {k}: {got} against {want}"
            );
        }
    }
}

#[test]
fn lamb_groups_share_the_global_norm_and_keep_their_own_decay() {
    // Clipping off: each group's update depends on its own parameters only.
    let off = LambConfig {
        lr: 0.02,
        max_grad_norm: 0.0,
        ..Default::default()
    };
    let no_wd = LambConfig {
        weight_decay: 0.0,
        lr: 0.05,
        ..off
    };
    let ps = params(&SHAPES, 5);
    let qs = params(&SHAPES, 5);
    let mut grouped = FusedLamb::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), off),
        ParamGroup::new(ps[2..].to_vec(), no_wd),
    ])
    .unwrap();
    let mut first = FusedLamb::new(qs[..2].to_vec(), off).unwrap();
    let mut second = FusedLamb::new(qs[2..].to_vec(), no_wd).unwrap();
    for t in 0..3 {
        set_grads(&ps, t);
        set_grads(&qs, t);
        grouped.step().unwrap();
        first.step().unwrap();
        second.step().unwrap();
    }
    for (p, q) in ps.iter().zip(&qs) {
        assert_eq!(vals(p), vals(q));
    }
    // Clipping on: the gradient norm is global over the groups (apex's), so two groups of one
    // config are one group.
    let on = LambConfig {
        max_grad_norm: 0.5,
        ..off
    };
    let ps = params(&SHAPES, 7);
    let qs = params(&SHAPES, 7);
    let mut two = FusedLamb::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), on),
        ParamGroup::new(ps[2..].to_vec(), on),
    ])
    .unwrap();
    let mut one = FusedLamb::new(qs.clone(), on).unwrap();
    for t in 0..2 {
        set_grads(&ps, t);
        set_grads(&qs, t);
        two.step().unwrap();
        one.step().unwrap();
    }
    for (p, q) in ps.iter().zip(&qs) {
        assert_eq!(vals(p), vals(q));
    }
}

/// A GPT-shaped toy: token embedding, a linear layer, a final layer norm, a bias-free head.
struct Tiny {
    wte: Embedding,
    h: Linear,
    ln_f: LayerNorm,
    head: Linear,
}

impl Tiny {
    fn new(seed: u64) -> Tiny {
        Tiny {
            wte: Embedding::new(11, 6, None, seed, &CPU).unwrap(),
            h: Linear::new(6, 6, true, &CPU, seed + 1).unwrap(),
            ln_f: LayerNorm::new(&[6], &CPU).unwrap(),
            head: Linear::new(6, 11, false, &CPU, seed + 2).unwrap(),
        }
    }
}

impl Module for Tiny {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.wte.forward(ids)?;
        let x = self.h.forward(&x)?.relu()?;
        self.head.forward(&self.ln_f.forward(&x)?)
    }
    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        f("wte", &self.wte);
        f("h", &self.h);
        f("ln_f", &self.ln_f);
        f("head", &self.head);
    }
}

fn names(g: &ParamGroups, label: &str) -> Vec<String> {
    g.group(label).unwrap().names.clone()
}

#[test]
fn the_default_rule_splits_by_name() {
    let m = Tiny::new(1);
    let g = ParamGroups::weight_decay_split(m.named_parameters()).unwrap();
    assert_eq!(g.groups().len(), 2);
    assert_eq!(g.groups()[0].label, ParamGroups::DECAY);
    assert_eq!(names(&g, "decay"), ["h.weight", "head.weight"]);
    assert_eq!(
        names(&g, "no_decay"),
        ["wte.weight", "h.bias", "ln_f.weight", "ln_f.bias"]
    );
    assert_eq!(
        g.to_string(),
        "decay: 2 tensors, 102 elements, no_decay: 4 tensors, 84 elements"
    );
    // The rule by itself, on names of common models.
    let w2 = randn(&[4, 4], 0);
    let w1 = randn(&[4], 0);
    let w4 = randn(&[2, 2, 3, 3], 0);
    for (name, t, want) in [
        ("transformer.h.0.attn.c_attn.weight", &w2, true),
        ("transformer.h.0.attn.c_attn.bias", &w1, false),
        ("transformer.h.0.ln_1.weight", &w1, false),
        ("transformer.wte.weight", &w2, false),
        ("transformer.wpe.weight", &w2, false),
        ("model.embed_tokens.weight", &w2, false),
        ("bert.embeddings.word_embeddings.weight", &w2, false),
        ("encoder.layer.0.LayerNorm.weight", &w1, false),
        ("layers.0.post_norm.weight", &w2, false),
        ("layer1.0.conv1.weight", &w4, true),
        ("layer1.0.bn1.weight", &w1, false),
        ("fc.weight", &w2, true),
        ("fc.bias", &w1, false),
        ("lm_head.weight", &w2, true),
    ] {
        assert_eq!(decays_by_default(name, t), want, "{name}");
    }
    // A rule of one's own.
    let g = ParamGroups::by_name(m.named_parameters(), |name, _| name.starts_with("head")).unwrap();
    assert_eq!(names(&g, "decay"), ["head.weight"]);
}

#[test]
fn named_groups_build_optimizers_with_no_decay_where_the_rule_says() {
    let m = Tiny::new(2);
    let g = ParamGroups::weight_decay_split(m.named_parameters()).unwrap();
    let cfg = AdamConfig {
        lr: 6e-4,
        weight_decay: 0.1,
        ..Default::default()
    };
    let opt = FusedAdam::with_param_groups(&g, cfg).unwrap();
    let gs = opt.groups();
    assert_eq!(gs.len(), 2);
    assert_eq!(gs[0].config, cfg);
    assert_eq!(
        gs[1].config,
        AdamConfig {
            weight_decay: 0.0,
            ..cfg
        }
    );
    assert_eq!(gs[1].params[0].id(), m.wte.weight.id());
    let lamb = FusedLamb::with_param_groups(&g, LambConfig::default()).unwrap();
    assert_eq!(lamb.groups()[1].config.weight_decay, 0.0);
    assert_eq!(lamb.groups()[0].config.weight_decay, 0.01);
    // Per group configs of one's own.
    let layered = g.with_configs(|grp| SgdConfig {
        lr: if grp.label == "decay" { 0.1 } else { 0.01 },
        ..Default::default()
    });
    assert_eq!(layered[1].config.lr, 0.01);
}

#[test]
fn schedules_scale_every_group_from_its_base_lr() {
    let ps = params(&SHAPES, 9);
    let mut opt = FusedAdam::with_groups(vec![
        ParamGroup::new(
            ps[..2].to_vec(),
            AdamConfig {
                lr: 1.0,
                ..Default::default()
            },
        ),
        ParamGroup::new(
            ps[2..].to_vec(),
            AdamConfig {
                lr: 0.1,
                ..Default::default()
            },
        ),
    ])
    .unwrap();
    let s = LrSchedule::Step {
        base: 1.0,
        step_size: 2,
        gamma: 0.5,
    };
    assert_eq!(s.apply(&mut opt, 2).unwrap(), 0.5);
    assert_eq!(opt.groups()[0].config.lr, 0.5);
    assert_eq!(opt.groups()[1].config.lr, 0.05);
    assert_eq!(opt.base_lrs(), [1.0, 0.1]);
    assert_eq!(opt.param_groups()[1].hyperparams["initial_lr"], 0.1);
    // set_lr leaves the base: the next schedule value is from it again.
    opt.set_lr(1, 7.0).unwrap();
    s.apply(&mut opt, 4).unwrap();
    assert_eq!(opt.groups()[1].config.lr, 0.025);
    // A new config is a new base.
    opt.set_config(
        1,
        AdamConfig {
            lr: 0.2,
            ..Default::default()
        },
    )
    .unwrap();
    s.apply(&mut opt, 0).unwrap();
    assert_eq!(opt.groups()[1].config.lr, 0.2);
    assert_eq!(opt.groups()[0].config.lr, 1.0);
    // A first group at lr 0 (frozen) stays 0; the schedule's values are the second's.
    let mut frozen_first = FusedAdam::with_groups(vec![
        ParamGroup::new(
            ps[..2].to_vec(),
            AdamConfig {
                lr: 0.0,
                ..Default::default()
            },
        ),
        ParamGroup::new(ps[2..].to_vec(), AdamConfig::default()),
    ])
    .unwrap();
    s.apply(&mut frozen_first, 3).unwrap();
    assert_eq!(frozen_first.groups()[0].config.lr, 0.0);
    assert_eq!(frozen_first.groups()[1].config.lr, 0.5);
}

#[test]
fn o2_keeps_masters_per_group_and_decays_only_the_decay_group() {
    let m = Tiny::new(3);
    let before: Vec<(String, Vec<f32>)> = m
        .named_parameters()
        .iter()
        .map(|(n, t)| (n.clone(), vals(t)))
        .collect();
    let g = ParamGroups::weight_decay_split(m.named_parameters()).unwrap();
    let cfg = AdamConfig {
        lr: 0.01,
        weight_decay: 0.5,
        ..Default::default()
    };
    let opt = FusedAdam::with_param_groups(&g, cfg).unwrap();
    let policy = Policy::opt_level(OptLevel::O2).with_report_interval(0);
    let (m, mut opt) = amp::initialize(m, opt, policy).unwrap();
    assert_eq!(m.inner().h.weight.dtype(), DType::F16);
    assert_eq!(m.inner().ln_f.named_parameters()[0].1.dtype(), DType::F32);
    // A zero loss: zero gradients, so Adam's update is 0 and only the decay moves weights.
    let ids = Tensor::from_slice(&[1i64, 4, 7], [3], CPU).unwrap();
    let loss = m
        .forward(&ids)
        .unwrap()
        .sum_all()
        .unwrap()
        .mul_scalar(0.0)
        .unwrap();
    opt.zero_grad().unwrap();
    opt.backward(&loss).unwrap();
    opt.step().unwrap();
    let masters = opt.master_params();
    let order: Vec<String> = g
        .groups()
        .iter()
        .flat_map(|g| g.names.iter().cloned())
        .collect();
    for (name, master) in order.iter().zip(&masters) {
        assert_eq!(master.dtype(), DType::F32);
        let old = &before.iter().find(|(n, _)| n == name).unwrap().1;
        let decayed = g.group("decay").unwrap().names.contains(name);
        for (&got, &was) in vals(master).iter().zip(old) {
            if decayed {
                let want = f64::from(was) * (1.0 - 0.01 * 0.5);
                assert!(
                    (f64::from(got) - want).abs() <= 1e-6,
                    "{name}: {got} {want}"
                );
            } else {
                assert_eq!(got, was, "{name} has no decay");
            }
        }
    }
}

fn tiny_run(seed: u64, cfg: AdamConfig) -> (amp::AmpModel<Tiny>, amp::AmpOptimizer<FusedAdam>) {
    let m = Tiny::new(seed);
    let g = ParamGroups::weight_decay_split(m.named_parameters()).unwrap();
    let opt = FusedAdam::with_param_groups(&g, cfg).unwrap();
    let policy = Policy::opt_level(OptLevel::O0).with_report_interval(0);
    amp::initialize(m, opt, policy).unwrap()
}

fn tiny_steps(
    m: &amp::AmpModel<Tiny>,
    o: &mut amp::AmpOptimizer<FusedAdam>,
    steps: std::ops::Range<u64>,
) {
    let sched = LrSchedule::Cosine {
        base: 0.05,
        min: 0.0,
        total: 8,
    };
    for t in steps {
        sched.apply(o.inner_mut(), t).unwrap();
        let ids = Tensor::from_slice(&[(t % 11) as i64, 3, 9, 1], [4], CPU).unwrap();
        let y = Tensor::from_slice(&[2i64, 5, (t % 11) as i64, 0], [4], CPU).unwrap();
        let loss = nn::cross_entropy(&m.forward(&ids).unwrap(), &y).unwrap();
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
    }
}

#[test]
fn groups_round_trip_through_a_checkpoint() {
    let dir = std::env::temp_dir().join(format!("mixprec_param_groups_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = AdamConfig {
        lr: 0.05,
        weight_decay: 0.1,
        ..Default::default()
    };
    let (ma, mut oa) = tiny_run(4, cfg);
    tiny_steps(&ma, &mut oa, 0..6);

    let (mb, mut ob) = tiny_run(4, cfg);
    tiny_steps(&mb, &mut ob, 0..3);
    let progress = TrainProgress {
        epoch: 0,
        step: 3,
        seed: 1,
    };
    let ck = Checkpoint::capture(&mb, &ob, progress, mixprec::io::serde_json::Value::Null).unwrap();
    let path = dir.join("groups.safetensors");
    ck.save(&path).unwrap();
    let loaded = Checkpoint::load(&path).unwrap();
    let groups = &loaded.optimizer.optimizer.param_groups;
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].hyperparams["weight_decay"], 0.1);
    assert_eq!(groups[1].hyperparams["weight_decay"], 0.0);
    assert_eq!(groups[1].hyperparams["initial_lr"], 0.05);
    assert_eq!(
        groups, &ck.optimizer.optimizer.param_groups,
        "exact in JSON"
    );

    // Other weights and other hyperparameters, restored: every bit continues alike.
    let other = AdamConfig {
        lr: 0.3,
        weight_decay: 0.7,
        ..Default::default()
    };
    let (mc, mut oc) = tiny_run(99, other);
    loaded.restore(&mc, &mut oc).unwrap();
    assert_eq!(oc.inner().groups()[1].config, ob.inner().groups()[1].config);
    assert_eq!(oc.inner().base_lrs(), [0.05, 0.05]);
    tiny_steps(&mc, &mut oc, 3..6);
    for ((n, a), (_, c)) in ma.named_parameters().iter().zip(mc.named_parameters()) {
        assert_eq!(vals(a), vals(&c), "{n}");
    }

    // A state saved before base learning rates were kept loads; the optimizer keeps its own.
    let mut old = ck.clone();
    for g in &mut old.optimizer.optimizer.param_groups {
        g.hyperparams.remove("initial_lr");
    }
    let (md, mut od) = tiny_run(5, other);
    old.restore(&md, &mut od).unwrap();
    assert_eq!(od.inner().base_lrs(), [0.3, 0.3]);
    assert_eq!(od.inner().groups()[0].config.weight_decay, 0.1);
    // A bad base is refused, and nothing changes.
    let mut bad = ck.optimizer.optimizer.clone();
    bad.param_groups[1]
        .hyperparams
        .insert("initial_lr".into(), -1.0);
    let (_me, mut oe) = tiny_run(6, other);
    let e = oe
        .inner_mut()
        .load_state_dict(&bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("initial_lr"), "{e}");
    assert_eq!(oe.inner().groups()[0].config, other);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_groups_are_errors() {
    let ps = params(&SHAPES, 11);
    // A parameter in two groups.
    let e = FusedAdam::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), AdamConfig::default()),
        ParamGroup::new(ps[1..].to_vec(), AdamConfig::default()),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("more than once"), "{e}");
    // No groups at all, or only empty ones.
    let e = FusedLamb::with_groups(vec![]).unwrap_err().to_string();
    assert!(e.contains("at least one parameter"), "{e}");
    let e = FusedAdam::with_groups(vec![ParamGroup::new(vec![], AdamConfig::default())])
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least one parameter"), "{e}");
    // Bad values in one group.
    let e = FusedAdam::with_groups(vec![
        ParamGroup::new(ps[..2].to_vec(), AdamConfig::default()),
        ParamGroup::new(
            ps[2..].to_vec(),
            AdamConfig {
                weight_decay: -0.1,
                ..Default::default()
            },
        ),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("weight_decay"), "{e}");
    let e = FusedLamb::new(
        ps.clone(),
        LambConfig {
            lr: f64::NAN,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("lr"), "{e}");

    // From a model: a parameter in no group, an unknown group, a tied weight in two groups.
    let m = Tiny::new(4);
    let e = ParamGroups::by_rule(m.named_parameters(), &["a"], |n, _| {
        (!n.starts_with("ln_f")).then_some("a")
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("ln_f.weight") && e.contains("in no group"),
        "{e}"
    );
    let e = ParamGroups::by_rule(m.named_parameters(), &["a", "b"], |_, _| Some("c"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`c`") && e.contains("[\"a\", \"b\"]"), "{e}");
    let mut tied = m.named_parameters();
    tied.push(("lm_head.weight".into(), m.wte.weight.clone()));
    let e = ParamGroups::weight_decay_split(tied.clone())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("wte.weight"),
        "{e}"
    );
    // Tied names in one group: the tensor once, under its first name.
    let g =
        ParamGroups::by_name(tied, |n, _| n.ends_with("weight") && !n.starts_with("ln")).unwrap();
    assert_eq!(
        names(&g, "decay"),
        ["wte.weight", "h.weight", "head.weight"]
    );
    // Empty inputs, repeated names and labels.
    assert!(ParamGroups::weight_decay_split(Vec::new()).is_err());
    assert!(ParamGroups::by_rule(m.named_parameters(), &[], |_, _| Some("a")).is_err());
    assert!(ParamGroups::by_rule(m.named_parameters(), &["a", "a"], |_, _| Some("a")).is_err());
    let mut twice = m.named_parameters();
    twice.push(twice[0].clone());
    assert!(ParamGroups::weight_decay_split(twice)
        .unwrap_err()
        .to_string()
        .contains("twice"));
}

/// `TensorInfo` is how a model names its tensors; the rule sees those names.
#[test]
fn the_rule_sees_full_dotted_names() {
    let m = Tiny::new(8);
    let mut seen = Vec::new();
    m.visit("", &mut |i: &TensorInfo| seen.push(i.name.to_string()));
    let g = ParamGroups::by_name(m.named_parameters(), |n, _| {
        assert!(seen.iter().any(|s| s == n), "{n}");
        true
    })
    .unwrap();
    assert_eq!(g.group("no_decay").unwrap().params.len(), 0);
}
