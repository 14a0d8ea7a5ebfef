//! User cast lists (apex's register_half_function / register_float_function /
//! register_promote_function): a policy's `[ops]` lists and the code registrations change what
//! O1 autocast does; wrong names and an op in two lists are errors.
//!
//! The classes are process-wide, so the tests of this file take turns (`serial`).

use std::sync::Mutex;

use mixprec::amp::{self, OpClass, OpKind, OptLevel, Policy};
use mixprec::nn::{Linear, Module};
use mixprec::optim::{Sgd, SgdConfig};
use mixprec::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Activates `policy` as `amp::initialize` does (on a fresh one-layer model).
fn activate(policy: Policy) {
    let m = Linear::new(2, 2, true, &CPU, 1).unwrap();
    let o = Sgd::new(m.parameters(), SgdConfig::default()).unwrap();
    amp::initialize(m, o, policy.with_report_interval(0)).unwrap();
}

fn f16(dims: &[usize], seed: u64) -> Tensor {
    Tensor::randn(dims, 0.0, 1.0, seed, DType::F16, CPU).unwrap()
}

/// The dtype of an O1 matmul of f16 inputs, and of a softmax of an f32 input, under an f16
/// scope.
fn o1_dtypes() -> (DType, DType) {
    let _scope = amp::autocast(DType::F16).unwrap();
    let mm = f16(&[2, 3], 1).matmul(&f16(&[3, 2], 2)).unwrap().dtype();
    let x = Tensor::randn([2, 3], 0.0, 1.0, 3, DType::F32, CPU).unwrap();
    (mm, x.softmax(-1).unwrap().dtype())
}

#[test]
fn policy_lists_move_ops_and_the_next_policy_undoes_them() {
    let _s = serial();
    activate(Policy::opt_level(OptLevel::O1));
    assert_eq!(o1_dtypes(), (DType::F16, DType::F32), "the default O1");

    let p = Policy::from_toml_str("opt_level = \"O1\"\n[ops]\nfloat = [\"matmul\"]\n").unwrap();
    assert_eq!(p.op_classes, [(OpKind::Matmul, OpClass::Fp32)]);
    activate(p);
    assert_eq!(o1_dtypes(), (DType::F32, DType::F32), "matmul in f32");
    assert_eq!(amp::class_for(OpKind::Matmul), OpClass::Fp32);
    assert_eq!(amp::autocast::op_class("matmul"), OpClass::Fp32);
    assert_eq!(
        amp::autocast::moved_ops(),
        [(OpKind::Matmul, OpClass::Fp32)]
    );

    let p = Policy::from_toml_str("opt_level = \"O1\"\n[ops]\nhalf = [\"softmax\"]\n").unwrap();
    activate(p);
    assert_eq!(
        o1_dtypes(),
        (DType::F16, DType::F16),
        "softmax in half; the previous policy's matmul undone"
    );

    // Another level's policy (no lists) undoes them.
    activate(Policy::opt_level(OptLevel::O0));
    assert_eq!(o1_dtypes(), (DType::F16, DType::F32));
    assert!(amp::autocast::moved_ops().is_empty());
}

#[test]
fn code_registrations_move_ops_until_cleared_and_policies_win() {
    let _s = serial();
    activate(Policy::opt_level(OptLevel::O1));
    amp::register_float_function(OpKind::Matmul);
    assert_eq!(o1_dtypes().0, DType::F32);
    amp::register_half_function(OpKind::Softmax);
    assert_eq!(o1_dtypes(), (DType::F32, DType::F16));
    // A policy list takes precedence for the ops it names.
    activate(Policy::opt_level(OptLevel::O1).with_half_function(OpKind::Matmul));
    assert_eq!(o1_dtypes(), (DType::F16, DType::F16));
    activate(Policy::opt_level(OptLevel::O1));
    assert_eq!(
        o1_dtypes(),
        (DType::F32, DType::F16),
        "the code's classes stay"
    );
    amp::register_promote_function(OpKind::Matmul);
    {
        // Promote: f16 with f32 gives f32.
        let _scope = amp::autocast(DType::F16).unwrap();
        let b = Tensor::randn([3, 2], 0.0, 1.0, 4, DType::F32, CPU).unwrap();
        assert_eq!(f16(&[2, 3], 1).matmul(&b).unwrap().dtype(), DType::F32);
        assert_eq!(
            f16(&[2, 3], 1).matmul(&f16(&[3, 2], 2)).unwrap().dtype(),
            DType::F16
        );
    }
    amp::clear_registered_functions();
    assert_eq!(o1_dtypes(), (DType::F16, DType::F32));
    // The crate's own ops are moved with register_function, not register_op.
    assert!(amp::autocast::register_op("matmul", OpClass::Fp32).is_err());
}

#[test]
fn a_wrong_name_is_an_error_listing_the_known_names() {
    let e = Policy::from_toml_str("opt_level = \"O1\"\n[ops]\nfloat = [\"matmull\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ops.float")
            && e.contains("matmull")
            && e.contains("<string>:3:")
            && e.contains("`matmull` is not an op"),
        "{e}"
    );
    for k in OpKind::ALL {
        assert!(e.contains(k.name()), "{} missing from: {e}", k.name());
    }
    // An unknown list.
    let e = Policy::from_toml_str("opt_level = \"O1\"\n[ops]\nbfloat = [\"matmul\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("bfloat") && e.contains("half"), "{e}");
    // Not a list of names.
    assert!(Policy::from_toml_str("opt_level = \"O1\"\n[ops]\nhalf = \"softmax\"\n").is_err());
}

#[test]
fn an_op_in_two_lists_or_lists_without_autocast_are_errors() {
    let e = Policy::from_toml_str(
        "opt_level = \"O1\"\n[ops]\nhalf = [\"softmax\"]\nfloat = [\"exp\", \"softmax\"]\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("ops.float") && e.contains("softmax") && e.contains("also in ops.half"),
        "{e}"
    );
    let e = Policy::from_toml_str("opt_level = \"O2\"\n[ops]\nfloat = [\"matmul\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("ops.float") && e.contains("O1"), "{e}");
    // The same rules for a policy built in code.
    let p = Policy::opt_level(OptLevel::O1)
        .with_float_function(OpKind::Exp)
        .with_promote_function(OpKind::Exp);
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("ops.promote") && e.contains("exp"), "{e}");
    let p = Policy::opt_level(OptLevel::O3).with_half_function(OpKind::Softmax);
    assert!(p.validate().is_err());
    let p = Policy::opt_level(OptLevel::O1).with_op_class(OpKind::Softmax, OpClass::Fp32Math);
    assert!(p.validate().unwrap_err().to_string().contains("softmax"));
    // Every list parses, in the order of the file.
    let p = Policy::from_toml_str(
        "opt_level = \"O1\"\n[ops]\nhalf = [\"softmax\"]\nfloat = [\"matmul\", \"gelu\"]\npromote = [\"cat\"]\npassthrough = [\"sum\"]\n",
    )
    .unwrap();
    assert_eq!(
        p.op_classes,
        [
            (OpKind::Softmax, OpClass::Half),
            (OpKind::Matmul, OpClass::Fp32),
            (OpKind::Gelu, OpClass::Fp32),
            (OpKind::Cat, OpClass::Promote),
            (OpKind::Sum, OpClass::Passthrough),
        ]
    );
    let mut built = Policy::opt_level(OptLevel::O1)
        .with_half_function(OpKind::Softmax)
        .with_float_function(OpKind::Matmul)
        .with_float_function(OpKind::Gelu)
        .with_promote_function(OpKind::Cat)
        .with_op_class(OpKind::Sum, OpClass::Passthrough);
    built.source = "<string>".into();
    assert_eq!(p, built, "a file and the builder give the same policy");
}
