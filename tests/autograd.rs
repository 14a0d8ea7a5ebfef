//! Autograd semantics: accumulation, no_grad, detach, reuse, freezing, gradient dtypes, and
//! backward misuse.

mod common;

use common::*;
use mixprec::{DType, Error, Tensor};

#[test]
fn gradients_accumulate_until_zero_grad() {
    let x = t64(&[1.0, 2.0, 3.0], &[3]).to_variable();
    assert!(x.grad().is_none());
    let loss = |x: &Tensor| x.sqr().unwrap().sum_all().unwrap();
    loss(&x).backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[2.0, 4.0, 6.0]);
    loss(&x).backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[4.0, 8.0, 12.0]);
    // The same graph walked twice (retained the first time) adds twice too.
    let l = x.mul_scalar(3.0).unwrap().sum_all().unwrap();
    l.backward_retain_graph().unwrap();
    l.backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[10.0, 14.0, 18.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    loss(&x).backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[2.0, 4.0, 6.0]);
}

#[test]
fn backward_releases_saved_tensors_unless_retained() {
    let x = t64(&[1.0, 2.0, 3.0], &[3]).to_variable();
    // The first walk released what the nodes saved (sqr its input): nothing to walk again.
    let l = x.sqr().unwrap().sum_all().unwrap();
    l.backward().unwrap();
    let e = l.backward().unwrap_err();
    assert!(matches!(e, Error::Backward(_)), "{e}");
    let msg = format!("{e}");
    assert!(
        msg.contains("second time") && msg.contains("retain"),
        "{msg}"
    );
    // The failed walk added nothing.
    assert_vals(&x.grad().unwrap(), &[2.0, 4.0, 6.0]);
    // Retained, it can be walked again, and released by the last walk.
    x.zero_grad();
    let l = x.sqr().unwrap().sum_all().unwrap();
    l.backward_retain_graph().unwrap();
    l.backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[4.0, 8.0, 12.0]);
    assert!(l.backward().is_err());
}

#[test]
fn the_graph_keeps_only_what_backward_reads() {
    // relu saves its output and add saves nothing, so the buffer of `h` (the product) is
    // freed with the last user handle, however long the graph lives.
    let w = t64(&[1.0, -2.0, 3.0], &[3]).to_variable();
    let h = w.mul_scalar(2.0).unwrap();
    let probe = h.detach();
    let y = h.add(&w).unwrap().relu().unwrap().sum_all().unwrap();
    drop(h);
    assert_eq!(
        probe.storage_handle_count(),
        1,
        "the graph holds an intermediate nobody's backward reads"
    );
    y.backward().unwrap();
    assert_vals(&w.grad().unwrap(), &[3.0, 0.0, 3.0]);
}

#[test]
fn accumulated_grad_is_not_tied_to_the_graph() {
    let x = t64(&[1.0, 2.0], &[2]).to_variable();
    x.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert!(!g.requires_grad());
    assert!(!g.is_variable());
    // A later backward makes a new gradient tensor; the one read before is unchanged.
    x.sum_all().unwrap().backward().unwrap();
    assert_vals(&g, &[1.0, 1.0]);
    assert_vals(&x.grad().unwrap(), &[2.0, 2.0]);
}

#[test]
fn no_grad_records_nothing() {
    let x = var(&[2, 2], 1);
    {
        let _g = mixprec::no_grad();
        let y = x.mul_scalar(2.0).unwrap().sum_all().unwrap();
        assert!(!y.requires_grad());
        let e = y.backward().unwrap_err();
        assert!(matches!(e, Error::Backward(_)), "{e}");
        // Nested guards restore the outer state.
        {
            let _h = mixprec::no_grad();
        }
        assert!(!x.exp().unwrap().requires_grad());
    }
    // Recording resumes after the guard.
    let y = x.exp().unwrap().sum_all().unwrap();
    assert!(y.requires_grad());
    y.backward().unwrap();
    assert!(x.grad().is_some());
    x.zero_grad();

    let y = mixprec::with_no_grad(|| x.matmul(&x).unwrap().sum_all().unwrap());
    assert!(!y.requires_grad());
    assert!(matches!(y.backward(), Err(Error::Backward(_))));
    assert!(x.grad().is_none());
    assert!(x.exp().unwrap().requires_grad());
    // Every kind of op under no_grad.
    mixprec::with_no_grad(|| {
        let outs = [
            x.relu().unwrap(),
            x.add(&x).unwrap(),
            x.affine(2.0, 1.0).unwrap(),
            x.powf(2.0).unwrap(),
            x.sum_dim(0, false).unwrap(),
            x.max_dim(1, false).unwrap(),
            x.reshape(vec![4]).unwrap(),
            x.transpose(0, 1).unwrap(),
            x.narrow(0, 0, 1).unwrap(),
            Tensor::cat(&[&x, &x], 0).unwrap(),
            x.gather(1, &ti64(&[0, 1], &[2, 1])).unwrap(),
            x.softmax(1).unwrap(),
            x.to_dtype(DType::F32).unwrap(),
            x.linear(&x, None).unwrap(),
        ];
        for (i, o) in outs.iter().enumerate() {
            assert!(!o.requires_grad(), "op {i} recorded under no_grad");
        }
    });
}

#[test]
fn no_grad_is_per_thread() {
    let x = var(&[2], 2);
    let _g = mixprec::no_grad();
    let recorded =
        std::thread::scope(|s| s.spawn(|| x.exp().unwrap().requires_grad()).join().unwrap());
    assert!(recorded);
    assert!(!x.exp().unwrap().requires_grad());
}

#[test]
fn detach_cuts_the_graph() {
    let x = t64(&[1.0, 2.0], &[2]).to_variable();
    let d = x.sqr().unwrap().detach();
    assert!(!d.requires_grad());
    assert_vals(&d, &[1.0, 4.0]);
    // y = x · detach(x²): dy/dx = x² only (no 2x·x term).
    x.mul(&d).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[1.0, 4.0]);
    // A loss made only of detached values has nothing to differentiate.
    assert!(matches!(
        d.sum_all().unwrap().backward(),
        Err(Error::Backward(_))
    ));
    // detach shares the buffer.
    assert!(x.detach().same_storage(&x));
}

#[test]
fn tensor_used_twice_gets_both_contributions() {
    let x = t64(&[3.0, -1.0], &[2]).to_variable();
    // x·x: 2x.
    x.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[6.0, -2.0]);
    x.zero_grad();
    // Diamond: a = 2x, b = x², y = a + b + x: 2 + 2x + 1.
    let a = x.mul_scalar(2.0).unwrap();
    let b = x.sqr().unwrap();
    a.add(&b)
        .unwrap()
        .add(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_vals(&x.grad().unwrap(), &[9.0, 1.0]);
    x.zero_grad();
    // An intermediate used twice: h = exp(x), y = h·h + h: (2h + 1)·h.
    let h = x.exp().unwrap();
    h.mul(&h)
        .unwrap()
        .add(&h)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want: Vec<f64> = [3.0f64, -1.0]
        .iter()
        .map(|v| (2.0 * v.exp() + 1.0) * v.exp())
        .collect();
    assert_close(&vals(&x.grad().unwrap()), &want, 1e-12, 0.0);
}

#[test]
fn frozen_variable_gets_no_grad() {
    let w = t64(&[2.0, 3.0], &[2]).to_variable();
    let x = t64(&[5.0, 7.0], &[2]).to_variable();
    w.set_requires_grad(false);
    assert!(!w.requires_grad());
    let y = w.mul(&x).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert!(w.grad().is_none());
    assert_vals(&x.grad().unwrap(), &[2.0, 3.0]);
    // Only frozen inputs: nothing records.
    assert!(!w.sqr().unwrap().requires_grad());
    assert!(w.sqr().unwrap().sum_all().unwrap().backward().is_err());
    // Unfrozen again.
    w.set_requires_grad(true);
    w.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&w.grad().unwrap(), &[5.0, 7.0]);
    // On a non-variable, set_requires_grad does nothing.
    let c = t64(&[1.0], &[1]);
    c.set_requires_grad(true);
    assert!(!c.requires_grad());
}

#[test]
fn freezing_after_recording_stops_the_gradient() {
    // The graph was built while w required grad; freezing before backward still keeps w's grad
    // empty (PyTorch would still compute it; here the flag is read at backward time).
    let w = t64(&[2.0], &[1]).to_variable();
    let x = t64(&[5.0], &[1]).to_variable();
    let y = w.mul(&x).unwrap().sum_all().unwrap();
    w.set_requires_grad(false);
    y.backward().unwrap();
    assert!(w.grad().is_none());
    assert_vals(&x.grad().unwrap(), &[2.0]);
}

#[test]
fn gradient_dtype_is_the_variables() {
    for dt in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        let x = randn(&[2, 3], 1, dt).to_variable();
        // Computed in f32, as AMP does with a half weight.
        let y = x
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(y.dtype(), DType::F32);
        y.backward_retain_graph().unwrap();
        let g = x.grad().unwrap();
        assert_eq!(g.dtype(), dt, "grad of a {dt} variable");
        assert_eq!(g.dims(), [2, 3]);
        let want: Vec<f64> = vals(&x).iter().map(|v| 2.0 * v).collect();
        let rtol = if dt == DType::BF16 { 1e-2 } else { 1e-3 };
        assert_close(&vals(&g), &want, rtol, 1e-6);
        // Accumulation keeps the dtype.
        y.backward().unwrap();
        assert_eq!(x.grad().unwrap().dtype(), dt);
    }
    // Mixed inputs: an f16 weight and an f32 input in one product.
    let w = randn(&[3, 2], 2, DType::F16).to_variable();
    let x = randn(&[4, 3], 3, DType::F32).to_variable();
    let y = x.matmul(&w.to_dtype(DType::F32).unwrap()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F16);
    assert_eq!(x.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn backward_needs_a_single_element() {
    let x = var(&[2, 3], 4);
    let y = x.mul_scalar(2.0).unwrap();
    let e = y.backward().unwrap_err();
    assert!(matches!(e, Error::Backward(_)), "{e}");
    assert!(format!("{e}").contains("backward"), "{e}");
    assert!(x.grad().is_none(), "a failed backward leaves no gradient");
    // One element of any rank is a loss.
    let one = x.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap();
    assert_eq!(one.dims(), [1, 1]);
    one.backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn backward_of_a_variable_itself() {
    let x = t64(&[4.0], &[]).to_variable();
    x.backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[1.0]);
    // sum_all of a 0-d variable.
    x.sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[2.0]);
}

#[test]
fn only_variables_keep_gradients() {
    let x = var(&[3], 5);
    let h = x.exp().unwrap();
    h.sum_all().unwrap().backward().unwrap();
    assert!(h.grad().is_none(), "intermediates keep no gradient");
    assert!(x.grad().is_some());
    // Inputs that are not variables need no gradient.
    let c = randn(&[3], 6, DType::F64);
    assert!(!c.requires_grad());
    x.zero_grad();
    x.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &vals(&c));
    assert!(c.grad().is_none());
}

#[test]
fn to_variable_shares_the_buffer_and_set_data_is_seen() {
    let base = t64(&[1.0, 2.0], &[2]);
    let x = base.to_variable();
    assert!(x.same_storage(&base));
    assert!(x.is_variable() && x.requires_grad());
    x.set_data(&t64(&[5.0, 6.0], &[2])).unwrap();
    assert_vals(&base, &[5.0, 6.0]);
    x.cast_in_place(DType::F32).unwrap();
    assert_eq!(x.dtype(), DType::F32);
    assert!(x.set_data(&t64(&[1.0], &[1])).is_err());
}

#[test]
fn deep_graph_backward_and_drop_do_not_overflow_the_stack() {
    // A loss accumulated over many steps without detaching makes a long chain; walking it
    // (backward) and dropping it must not recurse once per node.
    let x = t64(&[1.0], &[1]).to_variable();
    let mut y = x.clone();
    for _ in 0..100_000 {
        y = y.add_scalar(1.0).unwrap();
    }
    y.sum_all().unwrap().backward().unwrap();
    assert_vals(&x.grad().unwrap(), &[1.0]);
    drop(y);
    // A chain that is still shared part-way down is dropped in pieces.
    let mut y = x.clone();
    let mut middle = None;
    for i in 0..100_000 {
        y = y.add_scalar(1.0).unwrap();
        if i == 50_000 {
            middle = Some(y.clone());
        }
    }
    drop(y);
    assert_eq!(middle.unwrap().item().unwrap(), 50_002.0);
}

#[test]
fn gradcheck_of_a_small_network() {
    // A two-layer MLP with a softmax cross-entropy, every parameter checked.
    let x = randn(&[5, 4], 7, DType::F64);
    let labels = ti64(&[0, 2, 1, 1, 0], &[5, 1]);
    let params = [
        var(&[6, 4], 8),
        var(&[6], 9),
        var(&[3, 6], 10),
        var(&[3], 11),
    ];
    gradcheck(&params, |p| {
        let h = x.linear(&p[0], Some(&p[1]))?.relu()?;
        let logits = h.linear(&p[2], Some(&p[3]))?;
        logits
            .log_softmax(-1)?
            .gather(1, &labels)?
            .mean_all()?
            .neg()
    });
}
