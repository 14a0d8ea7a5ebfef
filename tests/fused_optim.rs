//! The fused optimizers against F64 references of their formulas (apex's optimizer suite):
//! issue 5's sizes once each in F32, the option matrix on small lists in F32/F16/BF16 with and
//! without FP32 masters, empty and frozen groups, exact skips on planted Inf/NaN, state_dict.

#[path = "fused_support/mod.rs"]
mod fused_support;

use fused_support::*;
use mixprec::optim::{
    AdamConfig, FusedAdam, FusedSgd, GradScaling, LambConfig, LrSchedule, NovoGradConfig,
    NovoGradNorm, Optimizer, ParamGroup, SgdConfig,
};
use mixprec::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn small() -> Vec<Vec<usize>> {
    vec![vec![37], vec![5, 7], vec![1], vec![65_537]]
}

pub fn sgd_configs() -> Vec<SgdConfig> {
    let b = SgdConfig {
        lr: 0.05,
        ..Default::default()
    };
    vec![
        b,
        SgdConfig {
            momentum: 0.9,
            weight_decay: 1e-2,
            ..b
        },
        SgdConfig {
            momentum: 0.9,
            dampening: 0.2,
            weight_decay: 1e-2,
            wd_after_momentum: true,
            ..b
        },
        SgdConfig {
            momentum: 0.8,
            nesterov: true,
            weight_decay: 1e-3,
            ..b
        },
    ]
}

pub fn adam_configs() -> Vec<AdamConfig> {
    let b = AdamConfig {
        lr: 1e-2,
        ..Default::default()
    };
    vec![
        b,
        AdamConfig {
            adam_w_mode: false,
            weight_decay: 0.1,
            betas: (0.8, 0.99),
            ..b
        },
        AdamConfig {
            weight_decay: 0.05,
            eps: 1e-6,
            bias_correction: false,
            ..b
        },
        AdamConfig {
            amsgrad: true,
            weight_decay: 0.01,
            ..b
        },
        AdamConfig {
            amsgrad: true,
            adam_w_mode: false,
            weight_decay: 0.01,
            ..b
        },
    ]
}

pub fn lamb_configs() -> Vec<LambConfig> {
    let b = LambConfig {
        lr: 1e-2,
        ..Default::default()
    };
    vec![
        b,
        LambConfig {
            weight_decay: 0.0,
            use_nvlamb: true,
            ..b
        },
        LambConfig {
            weight_decay: 0.0,
            use_nvlamb: false,
            grad_averaging: false,
            ..b
        },
        LambConfig {
            bias_correction: false,
            max_grad_norm: 0.0,
            betas: (0.8, 0.9),
            ..b
        },
    ]
}

pub fn novo_configs() -> Vec<NovoGradConfig> {
    let b = NovoGradConfig {
        lr: 1e-2,
        ..Default::default()
    };
    vec![
        b,
        NovoGradConfig {
            weight_decay: 0.01,
            reg_inside_moment: true,
            ..b
        },
        NovoGradConfig {
            weight_decay: 0.01,
            norm_type: NovoGradNorm::Inf,
            grad_averaging: false,
            ..b
        },
        NovoGradConfig {
            bias_correction: false,
            betas: (0.95, 0.98),
            eps: 1e-6,
            ..b
        },
    ]
}

pub fn all_kinds() -> Vec<Kind> {
    let mut v: Vec<Kind> = sgd_configs().into_iter().map(Kind::Sgd).collect();
    v.extend(adam_configs().into_iter().map(Kind::Adam));
    v.extend(lamb_configs().into_iter().map(Kind::Lamb));
    v.extend(novo_configs().into_iter().map(Kind::Novo));
    v
}

#[test]
fn option_matrix_in_every_dtype_with_and_without_masters() {
    for kind in all_kinds() {
        for dt in DTYPES {
            for masters in [false, true] {
                if masters && dt == DType::F32 {
                    continue;
                }
                run_case(kind, &small(), dt, masters, 7, CPU, false);
            }
        }
    }
}

#[test]
fn unscaling_inside_the_update_matches() {
    for kind in [
        Kind::Sgd(sgd_configs()[1]),
        Kind::Adam(adam_configs()[0]),
        Kind::Lamb(lamb_configs()[0]),
        Kind::Novo(novo_configs()[0]),
    ] {
        run_case(kind, &small(), DType::F16, true, 4, CPU, true);
        run_case(kind, &small(), DType::F32, false, 4, CPU, true);
    }
}

/// Issue 5's sizes, F32, 7 steps, once per optimizer (about 45.5M parameters).
#[test]
fn issue_sizes_in_f32() {
    let dims = vec![
        vec![4096, 1024],
        vec![4096],
        vec![4096, 2048],
        vec![32320, 1024],
        vec![1],
        vec![278_011],
    ];
    for kind in [
        Kind::Adam(AdamConfig {
            weight_decay: 0.01,
            ..adam_configs()[0]
        }),
        Kind::Sgd(sgd_configs()[3]),
        Kind::Lamb(lamb_configs()[0]),
        Kind::Novo(novo_configs()[1]),
    ] {
        run_case(kind, &dims, DType::F32, false, 7, CPU, false);
    }
}

#[test]
fn planted_inf_and_nan_make_every_optimizer_skip_exactly() {
    let kinds = [
        Kind::Sgd(sgd_configs()[1]),
        Kind::Adam(adam_configs()[3]),
        Kind::Lamb(lamb_configs()[0]),
        Kind::Novo(novo_configs()[0]),
    ];
    for kind in kinds {
        for (bad, at) in [(f32::INFINITY, 0), (f32::NAN, 1), (f32::NEG_INFINITY, 2)] {
            for (dt, masters) in [
                (DType::F32, false),
                (DType::F16, true),
                (DType::BF16, false),
            ] {
                check_skip(kind, dt, masters, bad, at, CPU);
            }
        }
    }
}

#[test]
fn empty_and_frozen_groups_change_nothing() {
    let a = tensor(1, &[10], DType::F32, CPU).to_variable();
    let frozen = tensor(2, &[4], DType::F32, CPU).to_variable();
    frozen.set_requires_grad(false);
    let before = frozen.to_vec_f64().unwrap();
    let mut opt = FusedAdam::with_groups(vec![
        ParamGroup::new(vec![], AdamConfig::default()),
        ParamGroup::new(vec![a.clone()], AdamConfig::default()),
        ParamGroup::new(
            vec![frozen.clone()],
            AdamConfig {
                lr: 1.0,
                ..Default::default()
            },
        ),
    ])
    .unwrap();
    a.set_grad(Some(tensor(3, &[10], DType::F32, CPU)));
    opt.step().unwrap();
    opt.step().unwrap();
    assert_eq!(frozen.to_vec_f64().unwrap(), before);
    let st = opt.state_dict().unwrap();
    assert_eq!(
        st.state.len(),
        1,
        "only the parameter with a gradient has state"
    );
    assert_eq!(st.state[&0]["step"].item().unwrap(), 2.0);
    assert_eq!(st.param_groups.len(), 3);
    assert!(st.param_groups[0].params.is_empty());
}

#[test]
fn state_dict_round_trip_continues_bitwise_with_masters() {
    for kind in [
        Kind::Adam(adam_configs()[3]),
        Kind::Sgd(sgd_configs()[2]),
        Kind::Lamb(lamb_configs()[0]),
        Kind::Novo(novo_configs()[1]),
    ] {
        let mk = || -> (Vec<Tensor>, Box<dyn Optimizer>) {
            let ps: Vec<Tensor> = (0..3)
                .map(|k| tensor(10 + k, &[k as usize + 3, 4], DType::F32, CPU).to_variable())
                .collect();
            let mut o = kind.make(ps.clone());
            o.use_master_weights().unwrap();
            for p in &ps {
                p.cast_in_place(DType::BF16).unwrap();
            }
            (ps, o)
        };
        let grads = |s: u64, ps: &[Tensor]| {
            for (k, p) in ps.iter().enumerate() {
                p.set_grad(Some(tensor(
                    100 + s * 3 + k as u64,
                    p.dims(),
                    DType::BF16,
                    CPU,
                )));
            }
        };
        let (p1, mut o1) = mk();
        for s in 0..3 {
            grads(s, &p1);
            o1.step().unwrap();
        }
        let saved = o1.state_dict().unwrap();
        assert!(saved.state[&0].contains_key("master_param"));
        let (p2, mut o2) = mk();
        o2.load_state_dict(&saved).unwrap();
        for s in 3..5 {
            grads(s, &p1);
            o1.step().unwrap();
            grads(s, &p2);
            o2.step().unwrap();
        }
        let (a, b) = (snapshot(o1.as_ref(), &[]), snapshot(o2.as_ref(), &[]));
        assert_eq!(a, b, "{kind:?}: restored optimizer continues identically");
        // A state with an unknown key is refused and changes nothing.
        let mut bad = saved.clone();
        bad.state.get_mut(&0).unwrap().insert(
            "bogus".into(),
            Tensor::scalar(1.0, DType::F32, CPU).unwrap(),
        );
        let e = o2.load_state_dict(&bad).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        assert_eq!(snapshot(o2.as_ref(), &[]), b);
    }
}

#[test]
fn f64_parameters_take_the_plain_sgd_path_and_others_refuse_them() {
    let p = tensor(1, &[8], DType::F64, CPU).to_variable();
    let mut o = FusedSgd::new(
        vec![p.clone()],
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    let w = p.to_vec_f64().unwrap();
    let g = tensor(2, &[8], DType::F64, CPU);
    p.set_grad(Some(g.clone()));
    o.step().unwrap();
    let g = g.to_vec_f64().unwrap();
    for (i, v) in p.to_vec_f64().unwrap().iter().enumerate() {
        assert!((v - (w[i] - 0.1 * g[i])).abs() < 1e-15);
    }
    let e = FusedAdam::new(vec![p], AdamConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("f64"), "{e}");
}

#[test]
fn bad_scaling_operands_and_configs_are_errors() {
    let p = tensor(1, &[8], DType::F32, CPU).to_variable();
    let mut o = FusedAdam::new(vec![p.clone()], AdamConfig::default()).unwrap();
    p.set_grad(Some(tensor(2, &[8], DType::F32, CPU)));
    let m = Tensor::scalar(1.0, DType::F16, CPU).unwrap();
    let f = Tensor::scalar(0.0, DType::F32, CPU).unwrap();
    let e = o
        .step_scaled(Some(GradScaling {
            grad_multiplier: &m,
            found_inf: &f,
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("grad_multiplier"), "{e}");
    let e = FusedAdam::new(
        vec![p.clone()],
        AdamConfig {
            betas: (1.0, 0.9),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("beta1"), "{e}");
    assert!(o.set_lr(0, f64::NAN).is_err());
    assert!(o.set_lr(3, 0.1).is_err());
}

#[test]
fn schedules_follow_torch() {
    let s = LrSchedule::Step {
        base: 1.0,
        step_size: 2,
        gamma: 0.5,
    };
    assert_eq!(s.lr_at(0).unwrap(), 1.0);
    assert_eq!(s.lr_at(3).unwrap(), 0.5);
    let c = LrSchedule::Cosine {
        base: 1.0,
        min: 0.0,
        total: 10,
    };
    assert!((c.lr_at(5).unwrap() - 0.5).abs() < 1e-12);
    assert!(c.lr_at(10).unwrap().abs() < 1e-12);
    let w = LrSchedule::LinearWarmup {
        base: 1.0,
        start_factor: 0.1,
        warmup: 10,
    };
    assert!((w.lr_at(0).unwrap() - 0.1).abs() < 1e-12);
    assert_eq!(w.lr_at(20).unwrap(), 1.0);
    // nanoGPT's get_lr: (step+1)/warmup, then cosine to min at total.
    let wc = LrSchedule::WarmupCosine {
        base: 1.0,
        min: 0.1,
        warmup: 10,
        total: 110,
    };
    assert!((wc.lr_at(0).unwrap() - 0.1).abs() < 1e-12);
    assert!((wc.lr_at(9).unwrap() - 1.0).abs() < 1e-12);
    assert!((wc.lr_at(10).unwrap() - 1.0).abs() < 1e-12);
    assert!((wc.lr_at(60).unwrap() - 0.55).abs() < 1e-12);
    assert!((wc.lr_at(110).unwrap() - 0.1).abs() < 1e-12);
    assert!((wc.lr_at(500).unwrap() - 0.1).abs() < 1e-12);
    assert!(LrSchedule::WarmupCosine {
        base: 1.0,
        min: 0.0,
        warmup: 5,
        total: 4
    }
    .lr_at(0)
    .is_err());
    let o = LrSchedule::one_cycle(1.0, 100);
    assert!((o.lr_at(0).unwrap() - 0.04).abs() < 1e-12);
    assert!((o.lr_at(29).unwrap() - 1.0).abs() < 1e-12);
    assert!((o.lr_at(99).unwrap() - 0.04 / 1e4).abs() < 1e-12);
    let p = tensor(1, &[8], DType::F32, CPU).to_variable();
    let mut opt = FusedSgd::new(vec![p], SgdConfig::default()).unwrap();
    assert_eq!(o.apply(&mut opt, 29).unwrap(), opt.lr());
    assert!(LrSchedule::Step {
        base: 1.0,
        step_size: 0,
        gamma: 0.5
    }
    .lr_at(1)
    .is_err());
}

#[test]
fn clip_grad_norm_scales_in_place_and_returns_the_norm() {
    let ps: Vec<Tensor> = (0..3)
        .map(|k| tensor(k, &[100 + k as usize], DType::F32, CPU).to_variable())
        .collect();
    for (k, p) in ps.iter().enumerate() {
        p.set_grad(Some(tensor(40 + k as u64, p.dims(), DType::F32, CPU)));
    }
    let before: Vec<f64> = ps
        .iter()
        .flat_map(|p| p.grad().unwrap().to_vec_f64().unwrap())
        .collect();
    let norm = before.iter().map(|x| x * x).sum::<f64>().sqrt();
    let n = mixprec::optim::clip_grad_norm(&ps, 1.0).unwrap();
    assert!((n.item().unwrap() - norm).abs() < 1e-4 * norm);
    let after: Vec<f64> = ps
        .iter()
        .flat_map(|p| p.grad().unwrap().to_vec_f64().unwrap())
        .collect();
    let coef = 1.0 / (norm + 1e-6);
    for (a, b) in after.iter().zip(&before) {
        assert!((a - b * coef).abs() < 1e-6);
    }
    let m = Tensor::scalar(0.5, DType::F32, CPU).unwrap();
    let f = Tensor::scalar(0.0, DType::F32, CPU).unwrap();
    let gs: Vec<Tensor> = ps.iter().map(|p| p.grad().unwrap()).collect();
    let (n2, c2) = mixprec::optim::clip_grad_norm_coef(&gs, 100.0, &m, &f).unwrap();
    assert!((n2.item().unwrap() - 0.5).abs() < 1e-5);
    assert_eq!(c2.item().unwrap(), 1.0);
    assert!(mixprec::optim::clip_grad_norm(&ps, -1.0).is_err());
    // The AMP form: the coefficient lands in the multiplier; the gradients are untouched.
    let m = Tensor::scalar(0.5, DType::F32, CPU).unwrap();
    let n3 = mixprec::optim::clip_grad_norm_into(&gs, 0.25, &m, &f).unwrap();
    let n3 = n3.item().unwrap();
    assert!((n3 - 0.5).abs() < 1e-5);
    assert!((m.item().unwrap() - 0.5 * 0.25 / (n3 + 1e-6)).abs() < 1e-6);
    assert_eq!(f.item().unwrap(), 0.0);
    let g_after: Vec<f64> = gs.iter().flat_map(|g| g.to_vec_f64().unwrap()).collect();
    assert_eq!(g_after, after);
}
