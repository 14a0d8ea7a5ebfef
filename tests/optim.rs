//! SGD against a hand-written f64 transcription of torch.optim.SGD, param groups, frozen
//! parameters, state-dict round trips and config errors.

use mixprec::nn::{mse_loss, Linear, Module, Reduction};
use mixprec::optim::{Optimizer, ParamGroup, Sgd, SgdConfig};
use mixprec::{DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

/// torch.optim.SGD's `_single_tensor_sgd` for one parameter, in f64.
struct Reference {
    w: Vec<f64>,
    buf: Option<Vec<f64>>,
    cfg: SgdConfig,
}

impl Reference {
    fn step(&mut self, grad: &[f64]) {
        let c = self.cfg;
        let mut g: Vec<f64> = grad
            .iter()
            .zip(&self.w)
            .map(|(g, w)| g + c.weight_decay * w)
            .collect();
        if c.momentum != 0.0 {
            let buf = match self.buf.take() {
                None => g.clone(),
                Some(b) => b
                    .iter()
                    .zip(&g)
                    .map(|(b, g)| c.momentum * b + (1.0 - c.dampening) * g)
                    .collect(),
            };
            g = if c.nesterov {
                g.iter()
                    .zip(&buf)
                    .map(|(g, b)| g + c.momentum * b)
                    .collect()
            } else {
                buf.clone()
            };
            self.buf = Some(buf);
        }
        for (w, g) in self.w.iter_mut().zip(&g) {
            *w -= c.lr * g;
        }
    }
}

/// A deterministic gradient for step `t`.
fn grad_at(t: u64, n: usize) -> Vec<f64> {
    Tensor::randn([n], 0.0, 1.0, 100 + t, DType::F64, CPU)
        .unwrap()
        .to_vec()
        .unwrap()
}

fn variants() -> Vec<SgdConfig> {
    let base = SgdConfig {
        lr: 0.1,
        ..Default::default()
    };
    vec![
        base,
        SgdConfig {
            weight_decay: 0.01,
            ..base
        },
        SgdConfig {
            momentum: 0.9,
            ..base
        },
        SgdConfig {
            momentum: 0.9,
            dampening: 0.3,
            weight_decay: 1e-3,
            ..base
        },
        SgdConfig {
            momentum: 0.8,
            nesterov: true,
            ..base
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.5,
            nesterov: true,
            weight_decay: 0.1,
            ..base
        },
    ]
}

#[test]
fn sgd_matches_torch_formula_over_five_steps() {
    let n = 7;
    for cfg in variants() {
        for dtype in [DType::F64, DType::F32, DType::F16] {
            let init = Tensor::randn([n], 0.0, 1.0, 5, DType::F64, CPU).unwrap();
            let p = init.to_dtype(dtype).unwrap().to_variable();
            let mut reference = Reference {
                w: p.to_vec_f64().unwrap(),
                buf: None,
                cfg,
            };
            let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
            for t in 0..5 {
                let g = grad_at(t, n);
                let gt = Tensor::from_vec(g.clone(), [n], CPU).unwrap();
                p.set_grad(Some(gt.to_dtype(dtype).unwrap()));
                opt.step().unwrap();
                reference.step(&gt.to_dtype(dtype).unwrap().to_vec_f64().unwrap());
                assert_eq!(p.dtype(), dtype);
                // F16 params: the weight is rounded to half after each step, so the reference
                // drifts by that rounding; F32 computes in f32.
                let tol = match dtype {
                    DType::F64 => 1e-13,
                    DType::F32 => 1e-5,
                    _ => 1e-2,
                };
                let got = p.to_vec_f64().unwrap();
                for (a, b) in got.iter().zip(&reference.w) {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "{cfg:?} {dtype} step {t}: {a} vs {b}"
                    );
                }
            }
            if cfg.momentum != 0.0 {
                let b = opt.momentum_buffer(&p).unwrap();
                let want = if dtype == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                assert_eq!(b.dtype(), want, "momentum state is FP32 (F64 for F64)");
            } else {
                assert!(opt.momentum_buffer(&p).is_none());
            }
        }
    }
}

#[test]
fn sgd_on_a_real_backward_and_frozen_params() {
    let lin = Linear::new(3, 2, true, &CPU, 1).unwrap();
    let frozen = lin.bias.clone().unwrap();
    frozen.set_requires_grad(false);
    let bias_before = frozen.to_vec::<f32>().unwrap();
    let w_before = lin.weight.to_vec::<f32>().unwrap();
    let mut opt = Sgd::new(
        lin.parameters(),
        SgdConfig {
            lr: 0.5,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    let x = Tensor::randn([4, 3], 0.0, 1.0, 2, DType::F32, CPU).unwrap();
    let y = Tensor::randn([4, 2], 0.0, 1.0, 3, DType::F32, CPU).unwrap();
    mse_loss(&lin.forward(&x).unwrap(), &y, Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    assert!(frozen.grad().is_none());
    let g = lin.weight.grad().unwrap().to_vec::<f32>().unwrap();
    opt.step().unwrap();
    let w = lin.weight.to_vec::<f32>().unwrap();
    for i in 0..6 {
        assert!((w[i] - (w_before[i] - 0.5 * g[i])).abs() < 1e-6);
    }
    assert_eq!(frozen.to_vec::<f32>().unwrap(), bias_before);
    assert!(opt.momentum_buffer(&frozen).is_none());
    assert_eq!(opt.state_dict().unwrap().state.len(), 1);
    // The update happened in place and recorded nothing.
    assert!(lin.weight.is_variable() && lin.weight.grad().is_some());
    opt.zero_grad();
    assert!(lin.weight.grad().is_none());
}

#[test]
fn param_groups_have_their_own_hyperparameters() {
    let a = Tensor::ones([2], DType::F32, CPU).unwrap().to_variable();
    let b = Tensor::ones([3], DType::F32, CPU).unwrap().to_variable();
    let mut opt = Sgd::with_groups(vec![
        ParamGroup::new(
            vec![a.clone()],
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        ),
        ParamGroup::new(
            vec![b.clone()],
            SgdConfig {
                lr: 0.01,
                weight_decay: 1.0,
                ..Default::default()
            },
        ),
    ])
    .unwrap();
    assert_eq!(opt.lr(), 0.1);
    let groups = opt.param_groups();
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[1].params.len(), 1);
    assert_eq!(groups[1].hyperparams["lr"], 0.01);
    assert_eq!(groups[1].hyperparams["weight_decay"], 1.0);
    a.set_grad(Some(Tensor::ones([2], DType::F32, CPU).unwrap()));
    b.set_grad(Some(Tensor::ones([3], DType::F32, CPU).unwrap()));
    opt.step().unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.9; 2]);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.98; 3]); // 1 − 0.01·(1 + 1·1)
    opt.set_lr(1, 0.5).unwrap();
    assert_eq!(opt.param_groups()[1].hyperparams["lr"], 0.5);
    assert_eq!(opt.lr(), 0.1);
    opt.set_lr_all(0.2).unwrap();
    assert_eq!(opt.groups()[1].config.lr, 0.2);
    assert!(opt.set_lr(2, 0.1).is_err());
    assert!(opt.set_lr(0, -1.0).is_err());
    assert_eq!(opt.lr(), 0.2, "a rejected lr changes nothing");
    assert_eq!(opt.params().len(), 2);
}

#[test]
fn state_dict_round_trip_continues_identically() {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 1e-2,
        ..Default::default()
    };
    let make = |seed| {
        (0..3)
            .map(|i| {
                Tensor::randn([i + 2, 2], 0.0, 1.0, seed + i as u64, DType::F32, CPU)
                    .unwrap()
                    .to_variable()
            })
            .collect::<Vec<_>>()
    };
    let ps = make(10);
    let groups = |ps: &[Tensor], cfg2: SgdConfig| {
        vec![
            ParamGroup::new(ps[..2].to_vec(), cfg2),
            ParamGroup::new(ps[2..].to_vec(), SgdConfig { lr: 0.3, ..cfg2 }),
        ]
    };
    let mut opt = Sgd::with_groups(groups(&ps, cfg)).unwrap();
    let grads = |ps: &[Tensor], t: u64| {
        for (i, p) in ps.iter().enumerate() {
            // The last parameter gets no gradient on even steps: it has no state at first.
            if i == 2 && t.is_multiple_of(2) {
                p.zero_grad();
                continue;
            }
            let g = Tensor::randn(
                p.shape().clone(),
                0.0,
                1.0,
                1000 * t + i as u64,
                DType::F32,
                CPU,
            );
            p.set_grad(Some(g.unwrap()));
        }
    };
    for t in 0..2 {
        grads(&ps, t);
        opt.step().unwrap();
    }
    let saved = opt.state_dict().unwrap();
    assert_eq!(saved.param_groups.len(), 2);
    assert_eq!(saved.param_groups[1].params, vec![2]);
    assert_eq!(saved.param_groups[1].hyperparams["lr"], 0.3);
    assert!(saved.state[&0].contains_key("momentum_buffer"));
    assert!(saved
        .state
        .values()
        .all(|s| s["momentum_buffer"].dtype() == DType::F32));

    // A second model with the same weights and a fresh optimizer with other hyperparameters.
    let qs = make(99);
    for (q, p) in qs.iter().zip(&ps) {
        q.set_data(p).unwrap();
    }
    let mut opt2 = Sgd::with_groups(groups(&qs, SgdConfig::default())).unwrap();
    opt2.load_state_dict(&saved).unwrap();
    assert_eq!(opt2.groups()[0].config, cfg);
    // The saved state is a copy: continuing the first optimizer does not change it.
    for t in 2..5 {
        grads(&ps, t);
        opt.step().unwrap();
        grads(&qs, t);
        opt2.step().unwrap();
    }
    for (p, q) in ps.iter().zip(&qs) {
        assert_eq!(p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());
    }
    let mut opt3 = Sgd::with_groups(groups(&make(5), SgdConfig::default())).unwrap();
    opt3.load_state_dict(&saved).unwrap();

    // Mismatched layouts are errors and change nothing.
    let mut one_group = Sgd::new(make(7), SgdConfig::default()).unwrap();
    let e = one_group.load_state_dict(&saved).unwrap_err();
    assert!(e.to_string().contains("2 groups"), "{e}");
    let other_shapes: Vec<Tensor> = (0..3)
        .map(|_| Tensor::zeros([5], DType::F32, CPU).unwrap().to_variable())
        .collect();
    let mut wrong = Sgd::with_groups(groups(&other_shapes, SgdConfig::default())).unwrap();
    let e = wrong.load_state_dict(&saved).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    assert_eq!(wrong.groups()[0].config, SgdConfig::default());
    let mut bad = saved.clone();
    bad.param_groups[0].hyperparams.insert("betas".into(), 0.9);
    assert!(opt3
        .load_state_dict(&bad)
        .unwrap_err()
        .to_string()
        .contains("betas"));
    let mut bad = saved.clone();
    bad.param_groups[0].hyperparams.insert("lr".into(), -0.1);
    assert!(opt3.load_state_dict(&bad).is_err());
    let mut bad = saved.clone();
    bad.param_groups[1].params = vec![7];
    bad.state.insert(3, bad.state[&0].clone());
    assert!(opt3.load_state_dict(&bad).is_err());
}

#[test]
fn config_errors_name_the_key() {
    let p = || vec![Tensor::zeros([2], DType::F32, CPU).unwrap().to_variable()];
    let check = |cfg: SgdConfig, key: &str| {
        let e = Sgd::new(p(), cfg).unwrap_err();
        match &e {
            Error::InvalidArgument { name, .. } => assert_eq!(*name, key, "{e}"),
            _ => panic!("{e}"),
        }
    };
    let d = SgdConfig::default();
    check(SgdConfig { lr: -0.1, ..d }, "lr");
    check(SgdConfig { lr: f64::NAN, ..d }, "lr");
    check(
        SgdConfig {
            momentum: -0.9,
            ..d
        },
        "momentum",
    );
    check(
        SgdConfig {
            weight_decay: -1.0,
            ..d
        },
        "weight_decay",
    );
    check(
        SgdConfig {
            nesterov: true,
            ..d
        },
        "nesterov",
    );
    let e = Sgd::new(
        p(),
        SgdConfig {
            nesterov: true,
            momentum: 0.9,
            dampening: 0.1,
            ..d
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("dampening = 0"), "{e}");
    assert!(Sgd::new(vec![], d).is_err());
    let t = p().remove(0);
    assert!(Sgd::new(vec![t.clone(), t.clone()], d).is_err());
    let labels = Tensor::zeros([2], DType::I64, CPU).unwrap();
    assert!(Sgd::new(vec![labels], d).is_err());
    // A plain tensor (not a variable) never gets a gradient: every optimizer refuses it,
    // naming its place; a frozen variable is fine.
    let plain = Tensor::zeros([2, 3], DType::F32, CPU).unwrap();
    for e in [
        Sgd::new(vec![p().remove(0), plain.clone()], d).map(|_| ()),
        mixprec::optim::FusedAdam::new(vec![plain.clone()], Default::default()).map(|_| ()),
        mixprec::optim::FusedLamb::new(vec![plain.mul_scalar(2.0).unwrap()], Default::default())
            .map(|_| ()),
    ] {
        let msg = e.unwrap_err().to_string();
        assert!(
            msg.contains("is not a variable") && msg.contains("[2, 3]"),
            "{msg}"
        );
    }
    let frozen = p().remove(0);
    frozen.set_requires_grad(false);
    assert!(Sgd::new(vec![frozen], d).is_ok());
}
