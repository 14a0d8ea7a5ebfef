//! Backward hooks and custom functions (src/autograd/hooks.rs): gradient hooks that see and
//! replace a tensor's gradient, post-accumulate hooks that fire once per variable per backward
//! after its `grad` is final, callbacks queued for the end of backward, and custom functions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mixprec::autograd::{custom_function, queue_callback};
use mixprec::{DType, Device, Error, Tensor};

fn var(values: &[f32]) -> Tensor {
    Tensor::from_slice(values, [values.len()], Device::Cpu)
        .unwrap()
        .to_variable()
}

#[test]
fn grad_hook_sees_and_replaces_the_gradient() {
    let x = var(&[1.0, 2.0, 3.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    y.register_hook(move |g| {
        s.lock().unwrap().push(g.to_vec_f32()?);
        // Replace dL/dy by 10 × itself: x's gradient becomes 2 × 10 × 1.
        Ok(Some(g.mul_scalar(10.0)?))
    });
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![vec![1.0, 1.0, 1.0]]);
    assert_eq!(x.grad().unwrap().to_vec_f32().unwrap(), vec![20.0; 3]);
}

#[test]
fn grad_hook_of_the_wrong_shape_is_an_error() {
    let x = var(&[1.0, 2.0]);
    let y = x.mul_scalar(2.0).unwrap();
    y.register_hook(|_| Ok(Some(Tensor::zeros([3], DType::F32, Device::Cpu)?)));
    let err = y.sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(err, Error::Backward(ref m) if m.contains("[3]")),
        "{err}"
    );
}

#[test]
fn post_accumulate_hooks_fire_once_per_backward_with_the_total() {
    // x is used twice: the hook fires once, after both contributions were summed into grad.
    let x = var(&[1.0, 2.0]);
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = calls.clone();
    let id = x
        .register_post_accumulate_grad_hook(move |t| {
            c.lock().unwrap().push(t.grad().unwrap().to_vec_f32()?);
            Ok(())
        })
        .unwrap();
    let loss = |x: &Tensor| {
        x.mul_scalar(3.0)
            .unwrap()
            .add(&x.sqr().unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
    };
    loss(&x).backward().unwrap();
    // Gradients accumulate across backward calls; the hook sees the running total.
    loss(&x).backward().unwrap();
    assert_eq!(
        *calls.lock().unwrap(),
        vec![vec![5.0, 7.0], vec![10.0, 14.0]]
    );
    assert!(x.remove_hook(id));
    assert!(!x.remove_hook(id));
    loss(&x).backward().unwrap();
    assert_eq!(calls.lock().unwrap().len(), 2);
}

#[test]
fn post_accumulate_hook_needs_a_variable() {
    let x = var(&[1.0]);
    let y = x.mul_scalar(2.0).unwrap();
    assert!(y.register_post_accumulate_grad_hook(|_| Ok(())).is_err());
}

#[test]
fn callbacks_run_after_every_gradient_in_order() {
    let a = var(&[1.0]);
    let b = var(&[2.0]);
    let order = Arc::new(Mutex::new(Vec::<String>::new()));
    for (name, t) in [("a", &a), ("b", &b)] {
        let o = order.clone();
        t.register_post_accumulate_grad_hook(move |_| {
            o.lock().unwrap().push(format!("grad {name}"));
            // The first variable's hook queues the end-of-backward callback once.
            if o.lock().unwrap().len() == 1 {
                let o2 = o.clone();
                queue_callback(move || {
                    o2.lock().unwrap().push("end 1".into());
                    let o3 = o2.clone();
                    // A callback may queue another; it runs after.
                    queue_callback(move || {
                        o3.lock().unwrap().push("end 2".into());
                        Ok(())
                    })
                })?;
            }
            Ok(())
        })
        .unwrap();
    }
    a.mul(&b).unwrap().sum_all().unwrap().backward().unwrap();
    let got = order.lock().unwrap().clone();
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(&got[2..], ["end 1", "end 2"]);
}

#[test]
fn queue_callback_outside_backward_is_an_error_and_failed_callbacks_do_not_leak() {
    assert!(queue_callback(|| Ok(())).is_err());
    let x = var(&[1.0]);
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    x.register_post_accumulate_grad_hook(move |_| {
        let r = r.clone();
        queue_callback(move || {
            r.fetch_add(1, Ordering::SeqCst);
            Err(Error::Backward("planted".into()))
        })
    })
    .unwrap();
    let err = x.sum_all().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("planted"));
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    // A backward that fails before its end drops its queued callbacks.
    let y = var(&[1.0]);
    let z = y.mul_scalar(2.0).unwrap();
    let r2 = ran.clone();
    y.register_post_accumulate_grad_hook(move |_| {
        let r = r2.clone();
        queue_callback(move || {
            r.fetch_add(100, Ordering::SeqCst);
            Ok(())
        })?;
        Err(Error::Backward("hook failed".into()))
    })
    .unwrap();
    assert!(z.sum_all().unwrap().backward().is_err());
    let w = var(&[1.0]);
    w.sum_all().unwrap().backward().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1, "stale callbacks ran");
}

#[test]
fn custom_function_routes_the_gradient_through_its_backward() {
    // f(x) = x³ with the hand-written derivative 3x², composed with the rest of the graph.
    let x = var(&[1.0, -2.0, 0.5]);
    let value = mixprec::with_no_grad(|| x.powf(3.0)).unwrap();
    let xc = x.clone();
    let y = custom_function("cube", &[&x], &value, move |g| {
        Ok(vec![Some(g.mul(&xc.sqr()?.mul_scalar(3.0)?)?)])
    });
    assert!(y.requires_grad());
    assert_eq!(y.to_vec_f32().unwrap(), vec![1.0, -8.0, 0.125]);
    y.mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec_f32().unwrap(),
        vec![6.0, 24.0, 1.5]
    );
    // Without an input that records, nothing is recorded.
    let c = Tensor::from_slice(&[1.0f32], [1], Device::Cpu).unwrap();
    let v = custom_function("id", &[&c], &c, |g| Ok(vec![Some(g.clone())]));
    assert!(!v.requires_grad());
}

#[test]
fn custom_function_backward_errors_are_checked() {
    let x = var(&[1.0, 2.0]);
    let v = mixprec::with_no_grad(|| x.mul_scalar(1.0)).unwrap();
    let y = custom_function("bad", &[&x], &v, |_| Ok(vec![]));
    let e = y.sum_all().unwrap().backward().unwrap_err();
    assert!(e.to_string().contains("bad"), "{e}");
    let y = custom_function("bad_shape", &[&x], &v, |_| {
        Ok(vec![Some(Tensor::zeros([5], DType::F32, Device::Cpu)?)])
    });
    let e = y.sum_all().unwrap().backward().unwrap_err();
    assert!(e.to_string().contains("bad_shape"), "{e}");
}
