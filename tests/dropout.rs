//! Dropout: masks from the generator's (seed, offset) by the documented rule, the offset
//! advancing per draw, the backward through the same mask, eval mode, bad arguments.

mod common;

use common::*;
use mixprec::backend::{dropout_word, DropoutParams};
use mixprec::nn::{Dropout, Module};
use mixprec::{DType, DropoutGenerator, Tensor};

#[test]
fn masks_follow_the_rule_and_the_offset_advances() {
    let gen = DropoutGenerator::new(1234, CPU).unwrap();
    let x = Tensor::ones([3, 50], DType::F32, CPU).unwrap();
    let p = DropoutParams { n: 150, p: 0.25 };
    for draw in 0..3u64 {
        let y = x.dropout(0.25, &gen).unwrap();
        assert_eq!(gen.state().unwrap(), (1234, 150 * (draw + 1)));
        for (i, v) in vals(&y).iter().enumerate() {
            let keep = dropout_word(1234, 150 * draw, i as u64) as u64 >= p.threshold();
            assert_eq!(
                *v,
                if keep { (1.0f32 / 0.75) as f64 } else { 0.0 },
                "draw {draw} value {i}"
            );
        }
    }
}

#[test]
fn backward_uses_the_forwards_mask() {
    let gen = DropoutGenerator::new(5, CPU).unwrap();
    let x = randn(&[4, 30], 1, DType::F64).to_variable();
    let y = x.dropout(0.5, &gen).unwrap();
    // A later draw must not change the mask the backward applies.
    let _ = x.dropout(0.5, &gen).unwrap();
    let g = randn(&[4, 30], 2, DType::F64);
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let (xv, yv, gv, dx) = (vals(&x), vals(&y), vals(&g), vals(&x.grad().unwrap()));
    let mut dropped = 0;
    for i in 0..xv.len() {
        if yv[i] == 0.0 {
            dropped += 1;
            assert_eq!(dx[i], 0.0);
        } else {
            assert!((yv[i] - 2.0 * xv[i]).abs() < 1e-15);
            assert!((dx[i] - 2.0 * gv[i]).abs() < 1e-15);
        }
    }
    assert!(dropped > 30 && dropped < 90, "{dropped} of 120 dropped");
}

#[test]
fn a_strided_input_draws_by_logical_position() {
    let base = randn(&[5, 8], 3, DType::F32);
    let (g1, g2) = (
        DropoutGenerator::new(9, CPU).unwrap(),
        DropoutGenerator::new(9, CPU).unwrap(),
    );
    let a = base.transpose(0, 1).unwrap().dropout(0.3, &g1).unwrap();
    let b = base
        .transpose(0, 1)
        .unwrap()
        .contiguous()
        .unwrap()
        .dropout(0.3, &g2)
        .unwrap();
    assert_eq!(vals(&a), vals(&b));
}

#[test]
fn edge_probabilities_eval_mode_and_errors() {
    let gen = DropoutGenerator::new(1, CPU).unwrap();
    let x = randn(&[100], 4, DType::BF16);
    assert_eq!(vals(&x.dropout(0.0, &gen).unwrap()), vals(&x));
    assert!(vals(&x.dropout(1.0, &gen).unwrap())
        .iter()
        .all(|v| *v == 0.0));
    assert!(x.dropout(1.5, &gen).is_err());
    assert!(ti64(&[1], &[1]).dropout(0.5, &gen).is_err());
    let layer = Dropout::new(0.5, 3, &CPU).unwrap();
    layer.set_training(false);
    assert_eq!(vals(&layer.forward(&x).unwrap()), vals(&x));
    layer.set_training(true);
    assert_ne!(vals(&layer.forward(&x).unwrap()), vals(&x));
    assert!(Dropout::new(-0.1, 3, &CPU).is_err());
}
