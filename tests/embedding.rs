//! Embedding: the gather, the table's gradient (an ordered scatter-add, padding row excluded),
//! finite differences, half tables, bad indices and the nn layer.

mod common;

use common::*;
use mixprec::nn::{Embedding, Module};
use mixprec::{DType, Tensor};

#[test]
fn forward_gathers_rows_and_backward_adds_them_back() {
    let table = t64(&[0.0, 0.5, 1.0, 1.5, 2.0, 2.5], &[3, 2]).to_variable();
    let idx = ti64(&[2, 1, 2, 0], &[2, 2]);
    let y = idx.embedding(&table, None).unwrap();
    assert_eq!(y.dims(), [2, 2, 2]);
    assert_vals(&y, &[2.0, 2.5, 1.0, 1.5, 2.0, 2.5, 0.0, 0.5]);
    let g = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[2, 2, 2]);
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&table.grad().unwrap(), &[7.0, 8.0, 3.0, 4.0, 6.0, 8.0]);
    // The padding row gets no gradient.
    table.zero_grad();
    let y = idx.embedding(&table, Some(2)).unwrap();
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    assert_vals(&table.grad().unwrap(), &[7.0, 8.0, 3.0, 4.0, 0.0, 0.0]);
}

#[test]
fn gradient_matches_finite_differences() {
    let idx = ti64(&[3, 0, 3, 1, 4, 3], &[2, 3]);
    check_gradients(&[randn(&[5, 4], 1, DType::F64)], |t| {
        idx.embedding(&t[0], None)
    });
}

#[test]
fn half_tables_sum_in_f32_and_round_once() {
    // 300 positions of one row: a sum rounded once to bf16, not 300 times.
    let idx = ti64(&vec![1; 300], &[300]);
    let table = randn(&[2, 8], 2, DType::BF16).to_variable();
    let g = Tensor::full([300, 8], 0.01, DType::BF16, CPU).unwrap();
    let y = idx.embedding(&table, None).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let dw = table.grad().unwrap();
    assert_eq!(dw.dtype(), DType::BF16);
    let step = half::bf16::from_f64(0.01).to_f64();
    let want = half::bf16::from_f64(300.0 * step).to_f64();
    assert_eq!(vals(&dw)[8..], vec![want; 8][..]);
    assert_eq!(vals(&dw)[..8], vec![0.0; 8][..]);
}

#[test]
fn bad_operands_are_errors() {
    let table = randn(&[3, 2], 3, DType::F32);
    for (idx, what) in [(ti64(&[3], &[1]), "index"), (ti64(&[-1], &[1]), "index")] {
        let e = idx.embedding(&table, None).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
    let e = t32(&[0.0], &[1])
        .embedding(&table, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("i64"), "{e}");
    let e = ti64(&[0], &[1])
        .embedding(&randn(&[6], 1, DType::F32), None)
        .unwrap_err();
    assert!(e.to_string().contains("weight"), "{e}");
    assert!(ti64(&[0], &[1]).embedding(&table, Some(3)).is_err());
}

#[test]
fn the_layer_has_pytorchs_weight() {
    let e = Embedding::new(10, 4, Some(0), 7, &CPU).unwrap();
    let sd = e.state_dict().unwrap();
    assert_eq!(sd.len(), 1);
    assert_eq!(sd[0].0, "weight");
    assert_eq!(e.weight.dims(), [10, 4]);
    assert_eq!(vals(&e.weight)[..4], [0.0; 4]);
    let y = e.forward(&ti64(&[1, 2], &[2])).unwrap();
    assert_eq!(vals(&y), vals(&e.weight)[4..12]);
    assert!(Embedding::new(10, 4, Some(10), 7, &CPU).is_err());
}
