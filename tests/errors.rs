//! Bad input gives an `Err` of the right variant whose message names the op — never a panic.

mod common;

use common::*;
use mixprec::{DType, Error, Result, Tensor};

/// The error of `r`, checked to mention `op` in its message.
#[track_caller]
fn err<T: std::fmt::Debug>(r: Result<T>, op: &str) -> Error {
    let e = r.expect_err("expected an error");
    let msg = format!("{e}");
    assert!(msg.contains(op), "message {msg:?} does not name {op:?}");
    e
}

fn f32s(shape: &[usize]) -> Tensor {
    randn(shape, 1, DType::F32)
}

#[test]
fn shape_mismatch_in_binary_ops() {
    let (a, b) = (f32s(&[2, 3]), f32s(&[4]));
    for (op, r) in [
        ("add", a.add(&b)),
        ("sub", a.sub(&b)),
        ("mul", a.mul(&b)),
        ("div", a.div(&b)),
        ("maximum", a.maximum(&b)),
        ("minimum", a.minimum(&b)),
    ] {
        let e = err(r, op);
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
        let msg = format!("{e}");
        assert!(msg.contains("[2, 3]") && msg.contains("[4]"), "{msg}");
    }
    let e = err(f32s(&[2, 3]).add(&f32s(&[3, 2])), "add");
    assert!(matches!(e, Error::ShapeMismatch { op: "add", .. }));
    let e = err(f32s(&[3]).broadcast_as(&[2, 4].into()), "broadcast_as");
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    // Broadcasting may not shrink.
    let e = err(f32s(&[2, 3]).broadcast_as(&[3].into()), "broadcast_as");
    assert!(matches!(e, Error::ShapeMismatch { .. }));
}

#[test]
fn shape_mismatch_in_matmul_and_linear() {
    for (a, b) in [
        (&[2, 3][..], &[4, 2][..]),
        (&[2, 3, 4], &[3, 4, 5]),
        (&[2, 3, 4], &[2, 5, 2]),
        (&[3], &[3, 2]),
        (&[2, 3], &[3]),
        (&[3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[5, 2]),
    ] {
        let e = err(f32s(a).matmul(&f32s(b)), "matmul");
        assert!(
            matches!(e, Error::ShapeMismatch { op: "matmul", .. }),
            "{a:?}·{b:?}: {e:?}"
        );
    }
    let x = f32s(&[5, 4]);
    for w in [&[3, 5][..], &[4], &[2, 3, 4]] {
        let e = err(x.linear(&f32s(w), None), "linear");
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    }
    let e = err(x.linear(&f32s(&[3, 4]), Some(&f32s(&[4]))), "linear");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = err(f32s(&[]).linear(&f32s(&[3, 1]), None), "linear");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
}

#[test]
fn dtype_mismatch_in_matmul_and_linear() {
    let a = f32s(&[2, 3]);
    let b = randn(&[3, 2], 2, DType::F16);
    let e = err(a.matmul(&b), "matmul");
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                op: "matmul",
                lhs: DType::F32,
                rhs: DType::F16
            }
        ),
        "{e:?}"
    );
    let msg = format!("{e}");
    assert!(msg.contains("F32") && msg.contains("F16"), "{msg}");
    let e = err(a.linear(&randn(&[4, 3], 3, DType::BF16), None), "linear");
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e:?}");
}

#[test]
fn shape_and_dtype_mismatch_in_cat() {
    let e = err(Tensor::cat(&[&f32s(&[2, 3]), &f32s(&[2, 4])], 0), "cat");
    assert!(matches!(e, Error::ShapeMismatch { op: "cat", .. }), "{e:?}");
    let e = err(Tensor::cat(&[&f32s(&[2, 3]), &f32s(&[2, 3, 1])], 0), "cat");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = err(
        Tensor::cat(&[&f32s(&[2]), &randn(&[2], 1, DType::F64)], 0),
        "cat",
    );
    assert!(matches!(e, Error::DTypeMismatch { op: "cat", .. }), "{e:?}");
    let e = err(Tensor::cat(&[], 0), "cat");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(Tensor::cat(&[&f32s(&[2]), &f32s(&[2])], 1), "cat");
    assert!(
        matches!(
            e,
            Error::DimOutOfRange {
                dim: 1,
                rank: 1,
                ..
            }
        ),
        "{e:?}"
    );
    let s = f32s(&[]);
    let e = err(Tensor::cat(&[&s, &s], 0), "cat");
    assert!(matches!(e, Error::DimOutOfRange { .. }), "{e:?}");
}

#[test]
fn bad_reshapes() {
    let x = f32s(&[2, 3]);
    let e = err(x.reshape(vec![4, 2]), "reshape");
    assert!(
        matches!(e, Error::ShapeMismatch { op: "reshape", .. }),
        "{e:?}"
    );
    let e = err(x.reshape(()), "reshape");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = err(x.squeeze(0), "squeeze");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(x.flatten(1, 0), "flatten");
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    for perm in [&[0, 0][..], &[0], &[0, 2], &[1, 0, 2]] {
        let e = err(x.permute(perm), "permute");
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{perm:?}: {e:?}"
        );
    }
}

#[test]
fn shapes_whose_size_overflows_are_errors() {
    // The element count of these shapes does not fit in usize: an error, not an overflow panic
    // or an attempt to allocate.
    let huge = [usize::MAX / 2, 3];
    let e = err(Tensor::zeros(huge, DType::F32, CPU), "zeros");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(Tensor::randn(huge, 0.0, 1.0, 0, DType::F32, CPU), "randn");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(Tensor::from_vec(vec![0f32; 2], huge, CPU), "from_vec");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(f32s(&[2]).reshape(vec![usize::MAX, 2, 0]), "reshape");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(f32s(&[1]).broadcast_as(&huge.into()), "broadcast_as");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    // Counts that fit but can never be allocated.
    let e = err(Tensor::full([1usize << 62], 1.0, DType::F32, CPU), "full");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let a = Tensor::zeros([1usize << 40, 0], DType::F32, CPU).unwrap();
    let b = Tensor::zeros([0, 1usize << 40], DType::F32, CPU).unwrap();
    let e = err(a.matmul(&b), "matmul");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
}

#[test]
fn dim_out_of_range() {
    let x = f32s(&[2, 3]);
    let cases: Vec<(&str, Result<Tensor>)> = vec![
        ("sum", x.sum_dim(2, false)),
        ("sum", x.sum_dim(-3, false)),
        ("sum", x.sum_dims(&[0, 5], false)),
        ("mean", x.mean_dim(2, false)),
        ("max", x.max_dim(-3, false)),
        ("min", x.min_dim(2, true)),
        ("argmax", x.argmax(2, false)),
        ("softmax", x.softmax(2)),
        ("log_softmax", x.log_softmax(-3)),
        ("narrow", x.narrow(2, 0, 1)),
        ("transpose", x.transpose(0, 2)),
        ("squeeze", x.squeeze(2)),
        ("unsqueeze", x.unsqueeze(3)),
        ("flatten", x.flatten(0, 2)),
        ("gather", x.gather(2, &ti64(&[0], &[1]))),
    ];
    for (op, r) in cases {
        let e = err(r, op);
        assert!(
            matches!(e, Error::DimOutOfRange { rank: 2, .. }),
            "{op}: {e:?}"
        );
    }
    // 0-d tensors have no dims.
    let s = f32s(&[]);
    let e = err(s.sum_dim(0, false), "sum");
    assert!(matches!(e, Error::DimOutOfRange { rank: 0, .. }), "{e:?}");
    let e = err(s.softmax(-1), "softmax");
    assert!(matches!(e, Error::DimOutOfRange { .. }), "{e:?}");
}

#[test]
fn i64_tensors_in_float_ops() {
    let l = ti64(&[1, 2, 3, 4], &[2, 2]);
    let f = f32s(&[2, 2]);
    let cases: Vec<(&str, Result<Tensor>)> = vec![
        ("add", l.add(&f)),
        ("mul", f.mul(&l)),
        ("neg", l.neg()),
        ("relu", l.relu()),
        ("exp", l.exp()),
        ("log", l.log()),
        ("sqrt", l.sqrt()),
        ("sqr", l.sqr()),
        ("abs", l.abs()),
        ("affine", l.affine(2.0, 1.0)),
        ("affine", l.add_scalar(1.0)),
        ("affine", l.mul_scalar(2.0)),
        ("powf", l.powf(2.0)),
        ("sum", l.sum_dim(0, false)),
        ("sum", l.sum_all()),
        ("mean", l.mean_dim(0, false)),
        ("mean", l.mean_all()),
        ("max", l.max_dim(0, false)),
        ("min", l.min_dim(0, false)),
        ("softmax", l.softmax(1)),
        ("log_softmax", l.log_softmax(1)),
        ("matmul", l.matmul(&l)),
    ];
    for (op, r) in cases {
        let e = err(r, op);
        assert!(
            matches!(
                e,
                Error::UnsupportedDType {
                    got: DType::I64,
                    ..
                }
            ),
            "{op}: {e:?}"
        );
    }
}

#[test]
fn gather_index_errors() {
    let x = f32s(&[2, 3]);
    for bad in [3i64, -1, 100] {
        let idx = ti64(&[0, bad], &[2, 1]);
        let e = err(x.gather(1, &idx), "gather");
        assert!(matches!(e, Error::InvalidArgument { .. }), "{bad}: {e:?}");
        assert!(format!("{e}").contains(&bad.to_string()));
    }
    // Index of the wrong dtype or shape.
    let e = err(x.gather(1, &f32s(&[2, 1])), "gather");
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e:?}");
    let e = err(x.gather(1, &ti64(&[0, 0, 0], &[3, 1])), "gather");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = err(x.gather(1, &ti64(&[0, 0], &[2])), "gather");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
}

#[test]
fn narrow_out_of_bounds() {
    let x = f32s(&[2, 3]);
    for (start, len) in [(0, 4), (3, 1), (2, 2), (usize::MAX, 2), (1, usize::MAX)] {
        let e = err(x.narrow(1, start, len), "narrow");
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{start}+{len}: {e:?}"
        );
    }
    // The end is allowed: an empty slice.
    assert_eq!(x.narrow(1, 3, 0).unwrap().dims(), [2, 0]);
}

#[test]
fn empty_reductions() {
    let e0 = Tensor::zeros([2, 0], DType::F32, CPU).unwrap();
    for (op, r) in [
        ("max", e0.max_dim(1, false)),
        ("min", e0.min_dim(-1, false)),
        ("argmax", e0.argmax(1, false)),
    ] {
        let e = err(r, op);
        assert!(matches!(e, Error::InvalidShape { .. }), "{op}: {e:?}");
    }
    let e = err(e0.mean_all(), "mean");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
}

#[test]
fn item_and_to_vec() {
    let e = err(f32s(&[2]).item(), "item");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(Tensor::zeros([0], DType::F32, CPU).unwrap().item(), "item");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    let e = err(f32s(&[2]).to_vec::<f64>(), "to_vec");
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                lhs: DType::F32,
                rhs: DType::F64,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn creation_errors() {
    let e = err(
        Tensor::from_vec(vec![1f32, 2.0, 3.0], [2, 2], CPU),
        "from_vec",
    );
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    assert!(format!("{e}").contains('3') && format!("{e}").contains('4'));
    let e = err(
        Tensor::from_slice(&[1i64], (), CPU).and_then(|t| t.reshape(vec![2])),
        "reshape",
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let e = err(Tensor::from_vec(Vec::<f64>::new(), (), CPU), "from_vec");
    assert!(matches!(e, Error::InvalidShape { .. }), "{e:?}");
    for (start, end, step) in [
        (0.0, 5.0, 0.0),
        (0.0, 5.0, -1.0),
        (5.0, 0.0, 1.0),
        (0.0, 1.0, f64::NAN),
        (0.0, f64::INFINITY, 1.0),
        (f64::NAN, 1.0, 1.0),
        (0.0, 1e30, 1.0),
    ] {
        let e = err(Tensor::arange(start, end, step, DType::F32, CPU), "arange");
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{start}..{end} by {step}: {e:?}"
        );
    }
    for (lo, hi) in [(1.0, 1.0), (2.0, 1.0), (f64::NAN, 1.0)] {
        let e = err(
            Tensor::rand_uniform([2], lo, hi, 0, DType::F32, CPU),
            "rand_uniform",
        );
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    }
}

/// Random samples of an integer dtype would be truncated to (mostly) zeros: an error.
#[test]
fn random_samples_need_a_float_dtype() {
    let e = err(Tensor::randn([4], 0.0, 1.0, 0, DType::I64, CPU), "randn");
    assert!(
        matches!(
            e,
            Error::UnsupportedDType {
                got: DType::I64,
                ..
            }
        ),
        "{e:?}"
    );
    let e = err(
        Tensor::rand_uniform([4], 0.0, 10.0, 0, DType::I64, CPU),
        "rand_uniform",
    );
    assert!(matches!(e, Error::UnsupportedDType { .. }), "{e:?}");
    // Integers from arange are fine (as torch.arange).
    assert_eq!(
        Tensor::arange(0.0, 3.0, 1.0, DType::I64, CPU)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        [0, 1, 2]
    );
}

/// Shapes the host cannot hold are `Error::OutOfMemory` naming the op and the bytes, not a
/// process abort ("memory allocation failed"). 2^45 f32 values (128 TiB) exceed a 47-bit
/// address space under any overcommit policy; 2^40 (4 TiB, the case of issue 19) exceeds this
/// machine's memory, which the default heuristic overcommit refuses.
#[test]
fn allocations_the_host_cannot_hold_are_errors() {
    let oom = |r: Result<Tensor>, op: &str, bytes: u64| match r {
        Err(e @ Error::OutOfMemory { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!("{op}: out of memory on cpu")),
                "{msg}"
            );
            assert!(msg.contains(&format!("({bytes} bytes)")), "{msg}");
        }
        other => panic!("{op}: expected OutOfMemory, got {other:?}"),
    };
    let huge = [1usize << 20, 1 << 25];
    let bytes = 4u64 << 45;
    oom(Tensor::zeros(huge, DType::F32, CPU), "zeros", bytes);
    oom(Tensor::ones(huge, DType::F32, CPU), "ones", bytes);
    oom(Tensor::full(huge, 2.0, DType::F32, CPU), "full", bytes);
    oom(
        Tensor::randn(huge, 0.0, 1.0, 0, DType::F32, CPU),
        "randn",
        bytes,
    );
    oom(
        Tensor::rand_uniform(huge, 0.0, 1.0, 0, DType::F32, CPU),
        "rand_uniform",
        bytes,
    );
    // Outputs much larger than their inputs.
    let col = f32s(&[1 << 22, 1]);
    let row = f32s(&[1, 1 << 23]);
    oom(col.add(&row), "add", bytes);
    oom(col.matmul(&row), "matmul", bytes);
    // A broadcast is a view (as PyTorch's expand): its copy is what may not fit.
    let wide = f32s(&[1])
        .broadcast_as(&mixprec::Shape::new(huge.to_vec()))
        .unwrap();
    assert_eq!(wide.dims(), huge);
    oom(wide.contiguous(), "copy_strided", bytes);
    let heuristic =
        std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|m| m.trim() != "1");
    if heuristic {
        oom(
            Tensor::zeros([1usize << 40], DType::F32, CPU),
            "zeros",
            4u64 << 40,
        );
    }
    // Nothing was lost: small tensors still work.
    assert_eq!(Tensor::zeros([3], DType::F32, CPU).unwrap().dims(), [3]);
}

#[test]
fn backward_errors() {
    let x = var(&[2], 1);
    let e = err(x.mul_scalar(2.0).unwrap().backward(), "backward");
    assert!(matches!(e, Error::Backward(_)), "{e:?}");
    let e = err(f32s(&[]).backward(), "backward");
    assert!(matches!(e, Error::Backward(_)), "{e:?}");
}

#[test]
fn set_data_errors() {
    let x = var(&[2], 1);
    let e = err(x.set_data(&f32s(&[3])), "set_data");
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
}
