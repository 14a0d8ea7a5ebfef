//! Matrix products: 2-D, batched, `[..,m,k]·[k,n]` and `linear`, against an f64 triple loop,
//! with gradients.

mod common;

use common::*;
use mixprec::{DType, Tensor};

/// `a [batch, m, k] · b [batch, k, n]` in f64 (`b_batched` false: one `b` for every batch).
fn matmul_ref(
    a: &[f64],
    b: &[f64],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    b_batched: bool,
) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let bo = if b_batched { bi * k * n } else { 0 };
        for i in 0..m {
            for j in 0..n {
                out[(bi * m + i) * n + j] = (0..k)
                    .map(|p| a[(bi * m + i) * k + p] * b[bo + p * n + j])
                    .sum();
            }
        }
    }
    out
}

#[test]
fn hand_values_2d() {
    let a = t32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let b = t32(&[7.0, 8.0, 9.0, 10.0, 11.0, 12.0], &[3, 2]);
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), [2, 2]);
    assert_eq!(c.to_vec::<f32>().unwrap(), [58.0, 64.0, 139.0, 154.0]);
    // Outer and inner products through 2-D shapes.
    let col = t64(&[1.0, 2.0], &[2, 1]);
    let row = t64(&[3.0, 4.0, 5.0], &[1, 3]);
    assert_vals(&col.matmul(&row).unwrap(), &[3., 4., 5., 6., 8., 10.]);
    let r2 = t64(&[3.0, 4.0], &[1, 2]);
    assert_vals(&r2.matmul(&col).unwrap(), &[11.0]);
}

#[test]
fn shapes_match_reference() {
    // (m, k, n): including 1s and sizes that are not multiples of any SIMD width.
    for (i, &(m, k, n)) in [(1, 1, 1), (3, 5, 2), (7, 1, 9), (17, 13, 11), (1, 8, 1)]
        .iter()
        .enumerate()
    {
        let s = i as u64 * 10;
        let a = randn(&[m, k], s, DType::F64);
        let b = randn(&[k, n], s + 1, DType::F64);
        let c = a.matmul(&b).unwrap();
        assert_eq!(c.dims(), [m, n]);
        assert_close(
            &vals(&c),
            &matmul_ref(&vals(&a), &vals(&b), 1, m, k, n, false),
            1e-12,
            1e-12,
        );
        // f32 through the same kernel.
        let c32 = a
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&b.to_dtype(DType::F32).unwrap())
            .unwrap();
        assert_eq!(c32.dtype(), DType::F32);
        assert_close(&vals(&c32), &vals(&c), 1e-5, 1e-5);
    }
}

#[test]
fn batched_matches_reference() {
    let (m, k, n) = (3, 4, 5);
    let a = randn(&[2, 3, m, k], 1, DType::F64);
    let b = randn(&[2, 3, k, n], 2, DType::F64);
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), [2, 3, m, n]);
    assert_close(
        &vals(&c),
        &matmul_ref(&vals(&a), &vals(&b), 6, m, k, n, true),
        1e-12,
        1e-12,
    );
}

#[test]
fn batch_times_matrix_matches_reference() {
    // [.., m, k] · [k, n]: one matrix for the whole batch.
    let (m, k, n) = (3, 4, 2);
    let a = randn(&[2, 5, m, k], 3, DType::F64);
    let b = randn(&[k, n], 4, DType::F64);
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), [2, 5, m, n]);
    assert_close(
        &vals(&c),
        &matmul_ref(&vals(&a), &vals(&b), 10, m, k, n, false),
        1e-12,
        1e-12,
    );
}

#[test]
fn large_product_parallel_path() {
    // m·n·k above the CPU kernel's threshold for a multi-threaded GEMM.
    let (m, k, n) = (70, 80, 90);
    let a = randn(&[m, k], 5, DType::F32);
    let b = randn(&[k, n], 6, DType::F32);
    let c = a.matmul(&b).unwrap();
    assert_close(
        &vals(&c),
        &matmul_ref(&vals(&a), &vals(&b), 1, m, k, n, false),
        1e-4,
        1e-4,
    );
}

#[test]
fn empty_dims() {
    let a = Tensor::zeros([0, 3], DType::F32, CPU).unwrap();
    let b = Tensor::ones([3, 2], DType::F32, CPU).unwrap();
    assert_eq!(a.matmul(&b).unwrap().dims(), [0, 2]);
    // k = 0: a sum of nothing, zeros.
    let a = Tensor::ones([2, 0], DType::F32, CPU).unwrap();
    let b = Tensor::ones([0, 3], DType::F32, CPU).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), [2, 3]);
    assert_eq!(c.to_vec::<f32>().unwrap(), [0.0; 6]);
}

#[test]
fn linear_matches_reference() {
    let (inf, outf) = (4, 3);
    let x = randn(&[2, 5, inf], 7, DType::F64);
    let w = randn(&[outf, inf], 8, DType::F64);
    let b = randn(&[outf], 9, DType::F64);
    let (xv, wv, bv) = (vals(&x), vals(&w), vals(&b));
    // x · Wᵀ + b.
    let want: Vec<f64> = (0..10 * outf)
        .map(|flat| {
            let (r, o) = (flat / outf, flat % outf);
            (0..inf)
                .map(|i| xv[r * inf + i] * wv[o * inf + i])
                .sum::<f64>()
                + bv[o]
        })
        .collect();
    let y = x.linear(&w, Some(&b)).unwrap();
    assert_eq!(y.dims(), [2, 5, outf]);
    assert_close(&vals(&y), &want, 1e-12, 1e-12);
    let y0 = x.linear(&w, None).unwrap();
    let want0: Vec<f64> = want
        .iter()
        .enumerate()
        .map(|(i, v)| v - bv[i % outf])
        .collect();
    assert_close(&vals(&y0), &want0, 1e-12, 1e-12);
    // A single sample [in] gives [out].
    let x1 = x
        .narrow(0, 0, 1)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap()
        .reshape(vec![inf])
        .unwrap();
    let y1 = x1.linear(&w, Some(&b)).unwrap();
    assert_eq!(y1.dims(), [outf]);
    assert_close(&vals(&y1), &want[..outf], 1e-12, 1e-12);
}

#[test]
fn gradients() {
    gradcheck(&[var(&[3, 4], 1), var(&[4, 2], 2)], |x| x[0].matmul(&x[1]));
    gradcheck(&[var(&[1, 1], 1), var(&[1, 5], 2)], |x| x[0].matmul(&x[1]));
    gradcheck(&[var(&[2, 3, 4], 3), var(&[2, 4, 5], 4)], |x| {
        x[0].matmul(&x[1])
    });
    gradcheck(&[var(&[2, 2, 3, 4], 3), var(&[2, 2, 4, 2], 4)], |x| {
        x[0].matmul(&x[1])
    });
    gradcheck(&[var(&[2, 3, 4], 5), var(&[4, 5], 6)], |x| {
        x[0].matmul(&x[1])
    });
    // Products with transposed operands (their backward uses every transposition case).
    gradcheck(&[var(&[4, 3], 7), var(&[5, 4], 8)], |x| {
        x[0].transpose(0, 1)?.matmul(&x[1].transpose(0, 1)?)
    });
    // linear, with and without bias, on 2-D and 3-D inputs.
    gradcheck(&[var(&[5, 4], 9), var(&[3, 4], 10), var(&[3], 11)], |x| {
        x[0].linear(&x[1], Some(&x[2]))
    });
    gradcheck(&[var(&[2, 3, 4], 12), var(&[2, 4], 13)], |x| {
        x[0].linear(&x[1], None)
    });
    gradcheck(&[var(&[4], 14), var(&[3, 4], 15), var(&[3], 16)], |x| {
        x[0].linear(&x[1], Some(&x[2]))
    });
    // The same matrix on both sides: both contributions.
    gradcheck(&[var(&[3, 3], 17)], |x| x[0].matmul(&x[0]));
}

#[test]
fn gradients_through_internal_transposed_products() {
    // The backward of a backward-style product: d/dA of sum(w ∘ (A·Bᵀ)) uses the (false, true) case;
    // linear records it directly.
    let x = var(&[3, 4], 18);
    let w = var(&[2, 4], 19);
    let y = x.linear(&w, None).unwrap();
    let g = randn(&[3, 2], 20, DType::F64);
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    // dL/dx = g·W, dL/dW = gᵀ·x.
    let (gv, wv, xv) = (vals(&g), vals(&w), vals(&x));
    let dx = matmul_ref(&gv, &wv, 1, 3, 2, 4, false);
    let gt = vals(&g.transpose(0, 1).unwrap());
    let dw = matmul_ref(&gt, &xv, 1, 2, 3, 4, false);
    assert_close(&vals(&x.grad().unwrap()), &dx, 1e-12, 1e-12);
    assert_close(&vals(&w.grad().unwrap()), &dw, 1e-12, 1e-12);
}

#[test]
fn empty_inner_dim_in_folded_and_linear_products() {
    // k = 0 with a batch folded into the rows: zeros of [.., m, n].
    let a = Tensor::ones([2, 3, 0], DType::F32, CPU).unwrap();
    let b = Tensor::ones([0, 4], DType::F32, CPU).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.dims(), [2, 3, 4]);
    assert_eq!(c.to_vec::<f32>().unwrap(), [0.0; 24]);
    // linear with in_features = 0: just the bias.
    let w = Tensor::ones([4, 0], DType::F32, CPU).unwrap();
    let bias = Tensor::full([4], 2.0, DType::F32, CPU).unwrap();
    let y = a.linear(&w, Some(&bias)).unwrap();
    assert_eq!(y.dims(), [2, 3, 4]);
    assert_eq!(y.to_vec::<f32>().unwrap(), [2.0; 24]);
}

#[test]
fn linear_in_half_adds_the_bias_before_the_one_rounding() {
    // The bias joins the f32 product (cuBLASLt's epilogue does the same): the half result is the
    // f32 result rounded once, not the product rounded and then the sum rounded again.
    for dt in [DType::F16, DType::BF16] {
        let x = randn(&[6, 5, 24], 21, DType::F32).to_dtype(dt).unwrap();
        let w = randn(&[9, 24], 22, DType::F32).to_dtype(dt).unwrap();
        let b = randn(&[9], 23, DType::F32).to_dtype(dt).unwrap();
        let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = up(&x).linear(&up(&w), Some(&up(&b))).unwrap();
        let y = x.linear(&w, Some(&b)).unwrap();
        assert_eq!(y.dtype(), dt);
        assert_eq!(vals(&y), vals(&want.to_dtype(dt).unwrap()), "{dt}");
    }
}

#[test]
fn linear_bias_gradient_alone_and_with_the_weight() {
    // A frozen weight: only x and b want gradients; db is the column sum of dy.
    let x = var(&[7, 4], 24);
    let w = randn(&[3, 4], 25, DType::F64);
    let b = var(&[3], 26);
    let g = randn(&[7, 3], 27, DType::F64);
    let y = x.linear(&w, Some(&b)).unwrap();
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let gv = vals(&g);
    let db: Vec<f64> = (0..3)
        .map(|j| (0..7).map(|r| gv[r * 3 + j]).sum())
        .collect();
    assert_close(&vals(&b.grad().unwrap()), &db, 1e-12, 1e-12);
    assert!(w.grad().is_none());
    let dx = matmul_ref(&gv, &vals(&w), 1, 7, 3, 4, false);
    assert_close(&vals(&x.grad().unwrap()), &dx, 1e-12, 1e-12);
    // Mixed dtypes (an f32 bias on f64 activations) take the promoting path and still work.
    let b32 = randn(&[3], 28, DType::F32);
    let y = x.detach().linear(&w, Some(&b32)).unwrap();
    assert_eq!(y.dtype(), DType::F64);
}

#[test]
fn fused_linear_gelu_is_linear_then_gelu() {
    // f64 and f32: the very same values as the two ops (no intermediate rounding to skip).
    for dt in [DType::F64, DType::F32] {
        let x = randn(&[2, 3, 8], 30, dt);
        let w = randn(&[5, 8], 31, dt);
        let b = randn(&[5], 32, dt);
        let fused = x.linear_gelu_tanh(&w, &b).unwrap();
        let plain = x.linear(&w, Some(&b)).unwrap().gelu_tanh().unwrap();
        assert_eq!(fused.dims(), [2, 3, 5]);
        assert_eq!(vals(&fused), vals(&plain), "{dt}");
    }
    // Half: GELU of the f32 sum, rounded once.
    for dt in [DType::F16, DType::BF16] {
        let x = randn(&[6, 24], 33, DType::F32).to_dtype(dt).unwrap();
        let w = randn(&[9, 24], 34, DType::F32).to_dtype(dt).unwrap();
        let b = randn(&[9], 35, DType::F32).to_dtype(dt).unwrap();
        let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = up(&x)
            .linear(&up(&w), Some(&up(&b)))
            .unwrap()
            .gelu_tanh()
            .unwrap();
        let got = x.linear_gelu_tanh(&w, &b).unwrap();
        assert_eq!(vals(&got), vals(&want.to_dtype(dt).unwrap()), "{dt}");
    }
    gradcheck(&[var(&[5, 4], 36), var(&[3, 4], 37), var(&[3], 38)], |x| {
        x[0].linear_gelu_tanh(&x[1], &x[2])
    });
    gradcheck(
        &[var(&[2, 3, 4], 39), var(&[3, 4], 40), var(&[3], 41)],
        |x| x[0].linear_gelu_tanh(&x[1], &x[2]),
    );
    // A shape mismatch is the linear's error.
    let e = randn(&[2, 4], 42, DType::F64)
        .linear_gelu_tanh(
            &randn(&[3, 5], 43, DType::F64),
            &randn(&[3], 44, DType::F64),
        )
        .unwrap_err();
    assert!(e.to_string().contains("linear"), "{e}");
}
