//! AMP on the CPU: policies and their errors here; the device cases (apex's suite: per-op
//! dtypes under O1, the cast cache, checkpoint/restore at every level, three scalers, several
//! models/optimizers/losses with planted Inf, ...) are in amp_cases/ and run here on the CPU
//! and from tests/cuda.rs (section "amp") on the GPU.

mod amp_cases;

use mixprec::amp::{self, LossScale, OptLevel, Policy};
use mixprec::nn::{Linear, Module};
use mixprec::optim::{Sgd, SgdConfig};
use mixprec::{DType, Device, Error, Result};

const CPU: Device = Device::Cpu;

fn sgd(params: Vec<mixprec::Tensor>, lr: f64, momentum: f64) -> Sgd {
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

// ---- policies ----------------------------------------------------------------------------------

#[test]
fn levels_have_apex_properties() {
    let p = |l| Policy::opt_level(l).properties().unwrap();
    let o0 = p(OptLevel::O0);
    assert_eq!(o0.cast_model_type, Some(DType::F32));
    assert!(!o0.autocast && !o0.master_weights && !o0.keep_batchnorm_fp32);
    assert_eq!(o0.loss_scale, LossScale::Static(1.0));
    let o1 = p(OptLevel::O1);
    assert_eq!(o1.cast_model_type, None);
    assert!(o1.autocast && !o1.master_weights);
    assert_eq!(o1.loss_scale, LossScale::Dynamic);
    let o2 = p(OptLevel::O2);
    assert_eq!(o2.cast_model_type, Some(DType::F16));
    assert!(!o2.autocast && o2.master_weights && o2.keep_batchnorm_fp32);
    assert_eq!(o2.loss_scale, LossScale::Dynamic);
    let o3 = p(OptLevel::O3);
    assert_eq!(o3.cast_model_type, Some(DType::F16));
    assert!(!o3.autocast && !o3.master_weights && !o3.keep_batchnorm_fp32);
    assert_eq!(o3.loss_scale, LossScale::Static(1.0));
    let d = Policy::opt_level(OptLevel::O2);
    assert_eq!(d.init_scale, 65536.0);
    assert_eq!(d.scale_window, 2000);
    assert_eq!(d.max_loss_scale, 16777216.0);
    assert_eq!((d.growth_factor, d.backoff_factor), (2.0, 0.5));
}

#[test]
fn bf16_defaults_to_no_loss_scaling() {
    for l in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        let p = Policy::opt_level(l)
            .with_half_dtype(DType::BF16)
            .properties()
            .unwrap();
        assert_eq!(p.loss_scale, LossScale::Static(1.0), "{l}");
        assert_eq!(p.half_dtype, DType::BF16);
    }
    // Asked for explicitly: allowed (with a warning in the log).
    let p = Policy::opt_level(OptLevel::O2)
        .with_half_dtype(DType::BF16)
        .with_loss_scale(LossScale::Dynamic)
        .properties()
        .unwrap();
    assert_eq!(p.loss_scale, LossScale::Dynamic);
    assert_eq!(p.cast_model_type, Some(DType::BF16));
}

#[test]
fn every_config_file_loads() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/configs");
    let want = [
        ("O0", OptLevel::O0, DType::F16, LossScale::Static(1.0)),
        ("O1", OptLevel::O1, DType::F16, LossScale::Dynamic),
        ("O2", OptLevel::O2, DType::F16, LossScale::Dynamic),
        ("O3", OptLevel::O3, DType::F16, LossScale::Static(1.0)),
        ("O1_bf16", OptLevel::O1, DType::BF16, LossScale::Static(1.0)),
        ("O2_bf16", OptLevel::O2, DType::BF16, LossScale::Static(1.0)),
        ("O3_bf16", OptLevel::O3, DType::BF16, LossScale::Static(1.0)),
    ];
    for (name, level, half, scale) in want {
        let p = Policy::from_toml_file(format!("{dir}/{name}.toml")).unwrap();
        let props = p.properties().unwrap();
        assert_eq!(props.opt_level, level, "{name}");
        assert_eq!(props.half_dtype, half, "{name}");
        assert_eq!(props.loss_scale, scale, "{name}");
    }
}

#[test]
fn toml_overrides_apply() {
    let p = Policy::from_toml_str(
        "opt_level = \"O2\"\nkeep_batchnorm_fp32 = false\nloss_scale = 128\nscale_window = 7\nmin_loss_scale = 1.0\nnum_losses = 3\nreport_interval = 0\n",
    )
    .unwrap();
    let props = p.properties().unwrap();
    assert!(!props.keep_batchnorm_fp32);
    assert_eq!(props.loss_scale, LossScale::Static(128.0));
    assert_eq!(p.scale_window, 7);
    assert_eq!(p.min_loss_scale, Some(1.0));
    assert_eq!(p.num_losses, 3);
    assert_eq!(p.report_interval, 0);
    // apex's spelling of autocast is accepted at O1.
    let p = Policy::from_toml_str("opt_level = \"O1\"\npatch_torch_functions = true").unwrap();
    assert!(p.properties().unwrap().autocast);
}

/// Properties print as a sentence (logs and the main job's summary), not as a Rust struct.
#[test]
fn properties_print_as_people_read_them() {
    let say = |l| Policy::opt_level(l).properties().unwrap().to_string();
    assert_eq!(say(OptLevel::O0), "FP32 weights, no loss scaling");
    assert_eq!(
        say(OptLevel::O1),
        "FP32 weights, autocast to f16, dynamic loss scale"
    );
    assert_eq!(
        say(OptLevel::O2),
        "f16 weights and activations, FP32 batch norm, FP32 master weights, dynamic loss scale"
    );
    assert_eq!(
        say(OptLevel::O3),
        "f16 weights and activations, no loss scaling"
    );
}

/// The error's (file, key, value) or a panic naming what came back.
#[track_caller]
fn config_err(r: Result<Policy>) -> (String, String, String, String) {
    match r {
        Err(Error::Config {
            file,
            key,
            value,
            allowed,
            ..
        }) => (file, key, value, allowed),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn forbidden_combinations_and_bad_values_are_config_errors() {
    let cases: &[(&str, &str)] = &[
        // apex: patch_torch_functions only at O1.
        ("opt_level = \"O0\"\nautocast = true", "autocast"),
        ("opt_level = \"O2\"\nautocast = true", "autocast"),
        (
            "opt_level = \"O3\"\npatch_torch_functions = true",
            "patch_torch_functions",
        ),
        // apex: O1 keeps the model FP32.
        (
            "opt_level = \"O1\"\ncast_model_type = \"f16\"",
            "cast_model_type",
        ),
        // apex: keep_batchnorm_fp32 is None at O1.
        (
            "opt_level = \"O1\"\nkeep_batchnorm_fp32 = true",
            "keep_batchnorm_fp32",
        ),
        (
            "opt_level = \"O1\"\nkeep_batchnorm_fp32 = false",
            "keep_batchnorm_fp32",
        ),
        // keep_batchnorm_fp32 with an FP32 model.
        (
            "opt_level = \"O0\"\nkeep_batchnorm_fp32 = true",
            "keep_batchnorm_fp32",
        ),
        (
            "opt_level = \"O2\"\ncast_model_type = \"f32\"\nkeep_batchnorm_fp32 = true",
            "keep_batchnorm_fp32",
        ),
        // apex: no master weights at O1.
        (
            "opt_level = \"O1\"\nmaster_weights = true",
            "master_weights",
        ),
        // a cast type other than f32 or the half type.
        (
            "opt_level = \"O2\"\ncast_model_type = \"bf16\"",
            "cast_model_type",
        ),
        // unknown keys, wrong types, bad values.
        ("opt_level = \"O2\"\nloss_scal = 1.0", "loss_scal"),
        ("opt_level = \"O4\"", "opt_level"),
        ("half_dtype = \"f16\"", "opt_level"),
        ("opt_level = 2", "opt_level"),
        (
            "opt_level = \"O2\"\nkeep_batchnorm_fp32 = \"yes\"",
            "keep_batchnorm_fp32",
        ),
        ("opt_level = \"O2\"\nloss_scale = \"auto\"", "loss_scale"),
        ("opt_level = \"O2\"\nloss_scale = -1.0", "loss_scale"),
        ("opt_level = \"O2\"\nhalf_dtype = \"f32\"", "half_dtype"),
        ("opt_level = \"O2\"\nscale_window = 0", "scale_window"),
        ("opt_level = \"O2\"\nscale_window = 1.5", "scale_window"),
        ("opt_level = \"O2\"\nnum_losses = 0", "num_losses"),
        ("opt_level = \"O2\"\ngrowth_factor = 1.0", "growth_factor"),
        ("opt_level = \"O2\"\nbackoff_factor = 1.0", "backoff_factor"),
        ("opt_level = \"O2\"\nmin_loss_scale = 1e9", "min_loss_scale"),
        ("opt_level = \"O2\"\nverbosity = 7", "verbosity"),
        (
            "opt_level = \"O1\"\nautocast = true\npatch_torch_functions = true",
            "",
        ),
        ("opt_level = \"O2\"\ninit_scale = 1e9", "init_scale"),
        (
            "opt_level = \"O2\"\ninit_scale = 1024\nmax_loss_scale = 512",
            "init_scale",
        ),
        ("opt_level = \"O2\"\nverbosity = 300", "verbosity"),
    ];
    for (text, key) in cases {
        let (file, k, _value, allowed) = config_err(Policy::from_toml_str(text));
        assert_eq!(file, "<string>", "{text}");
        if !key.is_empty() {
            assert_eq!(&k, key, "{text}");
        }
        assert!(!allowed.is_empty(), "{text}");
    }
    // A syntax error has a place.
    assert!(matches!(
        Policy::from_toml_str("opt_level = "),
        Err(Error::ConfigSyntax { at: Some(_), .. })
    ));
    // The place, the value as written and what is allowed.
    assert_eq!(
        Policy::from_toml_str("opt_level = \"O2\"\n\ninit_scale = 1e9\n")
            .unwrap_err()
            .to_string(),
        "config <string>:3:14: key `init_scale` = 1e9: at most max_loss_scale = 16777216"
    );
    // The file's path is named.
    let path = std::env::temp_dir().join(format!("mixprec-amp-bad-{}.toml", std::process::id()));
    std::fs::write(&path, "opt_level = \"O2\"\nautocast = true\n").unwrap();
    let (file, key, value, _) = config_err(Policy::from_toml_file(&path));
    std::fs::remove_file(&path).ok();
    assert_eq!(file, path.display().to_string());
    assert_eq!((key.as_str(), value.as_str()), ("autocast", "true"));
    // A policy built in code is held to the same rules (at initialize).
    let (file, key, ..) = config_err(
        Policy::opt_level(OptLevel::O1)
            .with_master_weights(true)
            .properties()
            .map(|_| Policy::opt_level(OptLevel::O1)),
    );
    assert_eq!((file.as_str(), key.as_str()), ("<code>", "master_weights"));
    let m = Linear::new(2, 2, true, &CPU, 0).unwrap();
    let o = sgd(m.parameters(), 0.1, 0.0);
    let r = amp::initialize(m, o, Policy::opt_level(OptLevel::O3).with_autocast(true));
    assert!(matches!(r, Err(Error::Config { .. })));
}

#[test]
fn a_missing_policy_file_is_an_io_error() {
    assert!(matches!(
        Policy::from_toml_file("/nonexistent/amp.toml"),
        Err(Error::Io { .. })
    ));
}

// ---- the device cases, on the CPU --------------------------------------------------------------

fn amp_device() -> Device {
    Device::Cpu
}

macro_rules! on_cpu {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                amp_cases::$name()
            }
        )*
    };
}

on_cpu!(
    o1_op_result_dtypes,
    o1_gradients_have_the_parameters_dtype_and_scopes_nest,
    user_ops_register_a_class,
    cache_holds_parameter_casts_per_grad_mode_until_backward,
    cache_never_goes_stale_across_train_eval_train,
    checkpoint_at_step_5_of_10_restores_bitwise_at_every_level,
    casts_per_level,
    three_scalers_decrease_independently,
    dynamic_scale_grows_after_the_window_and_clamps,
    bf16_policy_runs_unscaled_and_trains,
    multiple_models_optimizers_losses_with_planted_inf,
    accumulation_unscales_once_and_matches_fp32,
    clipping_uses_the_unscaled_norm,
    o2_master_params_are_fp32_and_model_weights_follow_them,
    initialize_twice_is_an_error,
    initialize_checks_its_inputs,
    tiny_resnet_trains_on_fashion_mnist_at_every_level,
);

// ---- the report line -----------------------------------------------------------------------------

/// Log records of this test binary (the scaler's report lines).
static LINES: std::sync::Mutex<Vec<(std::thread::ThreadId, String)>> =
    std::sync::Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, r: &log::Record) {
        if let Ok(mut l) = LINES.lock() {
            l.push((std::thread::current().id(), format!("{}", r.args())));
        }
    }
    fn flush(&self) {}
}

#[test]
fn the_scaler_reports_one_line_per_interval_not_per_overflow() {
    let _ = log::set_logger(&Capture);
    // Intervals with skipped steps log at info, quiet ones at debug: capture both.
    log::set_max_level(log::LevelFilter::Debug);
    let m = Linear::new(4, 2, true, &CPU, 0).unwrap();
    let o = sgd(m.parameters(), 0.01, 0.0);
    let policy = Policy::opt_level(OptLevel::O1).with_report_interval(4);
    let (m, mut o) = amp::initialize(m, o, policy).unwrap();
    let x = mixprec::Tensor::ones([3, 4], DType::F32, CPU).unwrap();
    for i in 0..8 {
        let mut loss = m.forward(&x).unwrap().sum_all().unwrap();
        if i < 3 {
            loss = loss.mul_scalar(1e38).unwrap(); // overflows: three skipped steps
        }
        o.zero_grad().unwrap();
        o.backward(&loss).unwrap();
        o.step().unwrap();
    }
    // This test's lines (the other tests of the binary log from their own threads).
    let me = std::thread::current().id();
    let lines: Vec<String> = LINES
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, l)| *t == me && l.starts_with("amp: loss scaler 0:"))
        .map(|(_, l)| l.clone())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].contains("step 4") && lines[0].contains("3 step(s) skipped"),
        "{lines:?}"
    );
    assert!(lines[0].contains("scale 8192"), "{lines:?}");
    assert!(
        lines[1].contains("step 8") && lines[1].contains("0 step(s) skipped"),
        "{lines:?}"
    );
}
