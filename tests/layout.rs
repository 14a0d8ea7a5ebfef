//! Shape ops: reshape/flatten/unsqueeze/squeeze (buffer-sharing), permute/transpose, narrow,
//! cat and gather, forward against an index-level reference, with gradients.

mod common;

use common::*;
use mixprec::{DType, Tensor};

/// `x` (shape `dims`) permuted: output dim `i` is input dim `perm[i]`.
fn permute_ref(x: &[f64], dims: &[usize], perm: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let st = strides(dims);
    let n: usize = out.iter().product();
    let v = (0..n)
        .map(|flat| {
            let idx = unravel(flat, &out);
            let src: usize = idx.iter().zip(perm).map(|(&i, &p)| i * st[p]).sum();
            x[src]
        })
        .collect();
    (v, out)
}

#[test]
fn reshape_family_shares_the_buffer() {
    let x = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let r = x.reshape(vec![3, 2]).unwrap();
    assert_eq!(r.dims(), [3, 2]);
    assert!(r.same_storage(&x));
    assert_vals(&r, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let f = x.flatten_all().unwrap();
    assert_eq!(f.dims(), [6]);
    assert!(f.same_storage(&x));
    let u = x.unsqueeze(0).unwrap();
    assert_eq!(u.dims(), [1, 2, 3]);
    assert_eq!(x.unsqueeze(1).unwrap().dims(), [2, 1, 3]);
    assert_eq!(x.unsqueeze(2).unwrap().dims(), [2, 3, 1]);
    assert!(u.same_storage(&x));
    let s = u.squeeze(0).unwrap();
    assert_eq!(s.dims(), [2, 3]);
    assert_eq!(x.unsqueeze(2).unwrap().squeeze(-1).unwrap().dims(), [2, 3]);
    // To and from 0-d.
    let one = t64(&[7.0], &[1, 1]);
    let z = one.reshape(()).unwrap();
    assert_eq!(z.rank(), 0);
    assert_eq!(z.item().unwrap(), 7.0);
    assert_eq!(z.unsqueeze(0).unwrap().dims(), [1]);
    assert_eq!(z.flatten(0, -1).unwrap().dims(), [1]);
}

#[test]
fn flatten_ranges() {
    let x = randn(&[2, 3, 4, 5], 1, DType::F32);
    assert_eq!(x.flatten(1, -1).unwrap().dims(), [2, 60]);
    assert_eq!(x.flatten(0, 1).unwrap().dims(), [6, 4, 5]);
    assert_eq!(x.flatten(1, 2).unwrap().dims(), [2, 12, 5]);
    assert_eq!(x.flatten(2, 2).unwrap().dims(), [2, 3, 4, 5]);
    assert_eq!(x.flatten(-2, -1).unwrap().dims(), [2, 3, 20]);
    assert_eq!(vals(&x.flatten(0, -1).unwrap()), vals(&x));
    assert!(x.flatten(2, 1).is_err());
}

#[test]
fn permute_and_transpose_match_reference() {
    let dims = [2, 3, 4];
    let x = randn(&dims, 2, DType::F64);
    let xv = vals(&x);
    for perm in [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ] {
        let (want, shape) = permute_ref(&xv, &dims, &perm);
        let p = x.permute(&perm).unwrap();
        assert_eq!(p.dims(), &shape[..], "{perm:?}");
        assert_vals(&p, &want);
    }
    let t = x.transpose(0, -1).unwrap();
    assert_eq!(t.dims(), [4, 3, 2]);
    assert_vals(&t, &permute_ref(&xv, &dims, &[2, 1, 0]).0);
    let m = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_vals(&m.transpose(0, 1).unwrap(), &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert_vals(&m.transpose(1, 1).unwrap(), &vals(&m));
    // 4-D, i64 too (labels are moved around like any data).
    let l = ti64(&(0..24).collect::<Vec<_>>(), &[1, 2, 3, 4]);
    let (want, _) = permute_ref(
        &(0..24).map(|v| v as f64).collect::<Vec<_>>(),
        &[1, 2, 3, 4],
        &[0, 2, 3, 1],
    );
    assert_vals(&l.permute(&[0, 2, 3, 1]).unwrap(), &want);
}

#[test]
fn narrow_matches_reference() {
    let x = t64(&(0..24).map(|v| v as f64).collect::<Vec<_>>(), &[2, 3, 4]);
    let n = x.narrow(2, 1, 2).unwrap();
    assert_eq!(n.dims(), [2, 3, 2]);
    assert_vals(&n, &[1., 2., 5., 6., 9., 10., 13., 14., 17., 18., 21., 22.]);
    let n = x.narrow(1, 2, 1).unwrap();
    assert_eq!(n.dims(), [2, 1, 4]);
    assert_vals(&n, &[8., 9., 10., 11., 20., 21., 22., 23.]);
    let n = x.narrow(-3, 1, 1).unwrap();
    assert_vals(&n, &(12..24).map(|v| v as f64).collect::<Vec<_>>());
    // Zero length and the full range.
    assert_eq!(x.narrow(0, 2, 0).unwrap().dims(), [0, 3, 4]);
    assert_vals(&x.narrow(1, 0, 3).unwrap(), &vals(&x));
}

#[test]
fn cat_matches_reference() {
    let a = t64(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = t64(&[5.0, 6.0], &[1, 2]);
    let c = Tensor::cat(&[&a, &b], 0).unwrap();
    assert_eq!(c.dims(), [3, 2]);
    assert_vals(&c, &[1., 2., 3., 4., 5., 6.]);
    let d = t64(&[7.0, 8.0, 9.0, 10.0, 11.0, 12.0], &[2, 3]);
    let c = Tensor::cat(&[&a, &d, &a], -1).unwrap();
    assert_eq!(c.dims(), [2, 7]);
    assert_vals(
        &c,
        &[1., 2., 7., 8., 9., 1., 2., 3., 4., 10., 11., 12., 3., 4.],
    );
    // Middle dim of a 3-D tensor, with an empty part.
    let x = randn(&[2, 3, 2], 1, DType::F64);
    let y = randn(&[2, 1, 2], 2, DType::F64);
    let e = Tensor::zeros([2, 0, 2], DType::F64, CPU).unwrap();
    let c = Tensor::cat(&[&x, &e, &y], 1).unwrap();
    assert_eq!(c.dims(), [2, 4, 2]);
    let (xv, yv) = (vals(&x), vals(&y));
    let mut want = Vec::new();
    for o in 0..2 {
        want.extend_from_slice(&xv[o * 6..o * 6 + 6]);
        want.extend_from_slice(&yv[o * 2..o * 2 + 2]);
    }
    assert_vals(&c, &want);
    // narrow inverts cat.
    assert_vals(&c.narrow(1, 3, 1).unwrap(), &yv);
    // One part: itself.
    assert_vals(&Tensor::cat(&[&x], 2).unwrap(), &xv);
}

#[test]
fn gather_matches_reference() {
    let x = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    // Along the last dim (picking class scores by label).
    let idx = ti64(&[2, 0], &[2, 1]);
    let g = x.gather(1, &idx).unwrap();
    assert_eq!(g.dims(), [2, 1]);
    assert_vals(&g, &[3.0, 4.0]);
    // Repeated and reordered indices, more than the dim's size.
    let idx = ti64(&[0, 0, 2, 1, 1, 2, 0, 1], &[2, 4]);
    assert_vals(
        &x.gather(-1, &idx).unwrap(),
        &[1., 1., 3., 2., 5., 6., 4., 5.],
    );
    // Along dim 0.
    let idx = ti64(&[1, 0, 1], &[1, 3]);
    assert_vals(&x.gather(0, &idx).unwrap(), &[4.0, 2.0, 6.0]);
    // 3-D against an index-level reference: out[i][j][k] = x[i][idx[i][j][k]][k].
    let dims = [2, 4, 3];
    let x = randn(&dims, 3, DType::F64);
    let idx_v: Vec<i64> = (0..2 * 5 * 3).map(|i| (i * 7 % 4) as i64).collect();
    let idx = ti64(&idx_v, &[2, 5, 3]);
    let xv = vals(&x);
    let want: Vec<f64> = (0..30)
        .map(|flat| {
            let p = unravel(flat, &[2, 5, 3]);
            xv[(p[0] * 4 + idx_v[flat] as usize) * 3 + p[2]]
        })
        .collect();
    assert_vals(&x.gather(1, &idx).unwrap(), &want);
}

#[test]
fn gradients() {
    gradcheck(&[var(&[2, 3, 4], 1)], |x| x[0].reshape(vec![4, 6]));
    gradcheck(&[var(&[2, 3, 4], 1)], |x| x[0].flatten(1, 2));
    gradcheck(&[var(&[2, 3], 1)], |x| x[0].unsqueeze(1));
    gradcheck(&[var(&[2, 1, 3], 1)], |x| x[0].squeeze(1));
    for perm in [[1, 0, 2], [2, 0, 1], [1, 2, 0]] {
        gradcheck(&[var(&[2, 3, 4], 2)], |x| x[0].permute(&perm));
    }
    gradcheck(&[var(&[2, 3, 4], 3)], |x| x[0].transpose(-1, 0));
    for (dim, start, len) in [(0, 1, 1), (1, 0, 2), (2, 1, 2), (-1, 3, 1), (1, 1, 2)] {
        gradcheck(&[var(&[2, 3, 4], 4)], |x| x[0].narrow(dim, start, len));
    }
    for dim in [0, 1, -1] {
        let mut b = vec![2, 3, 4];
        b[if dim < 0 { 2 } else { dim as usize }] = 2;
        gradcheck(&[var(&[2, 3, 4], 5), var(&b, 6), var(&[2, 3, 4], 7)], |x| {
            Tensor::cat(&[&x[0], &x[1], &x[2]], dim)
        });
    }
    // A tensor concatenated with itself gets both gradients.
    gradcheck(&[var(&[2, 3], 8)], |x| Tensor::cat(&[&x[0], &x[0]], 0));
    // gather with repeated indices: the backward adds them up.
    let idx = ti64(&[0, 0, 2, 1, 1, 2, 0, 1, 2, 2, 2, 2], &[2, 6]);
    gradcheck(&[var(&[2, 3], 9)], |x| x[0].gather(1, &idx));
    let idx = ti64(&[1, 0, 1, 1, 1, 1], &[2, 3]);
    gradcheck(&[var(&[2, 3], 10)], |x| x[0].gather(0, &idx));
}

#[test]
fn views_share_and_copies_do_not() {
    // transpose/narrow/expand/reshape are views: an in-place update of the source shows
    // through them. contiguous() of a view and cat copy: they keep the old values.
    let x = t64(&[1.0, 2.0, 3.0, 4.0], &[2, 2]).to_variable();
    let p = x.transpose(0, 1).unwrap();
    let n = x.narrow(0, 1, 1).unwrap();
    let e = x
        .narrow(0, 0, 1)
        .unwrap()
        .broadcast_as(&[3, 2].into())
        .unwrap();
    let r = x.reshape(vec![4]).unwrap();
    let pc = p.contiguous().unwrap();
    let c = Tensor::cat(&[&x, &x], 0).unwrap();
    assert!(p.same_storage(&x) && n.same_storage(&x) && e.same_storage(&x));
    assert!(!pc.same_storage(&x));
    x.set_data(&t64(&[5.0, 6.0, 7.0, 8.0], &[2, 2])).unwrap();
    assert_vals(&p, &[5.0, 7.0, 6.0, 8.0]);
    assert_vals(&n, &[7.0, 8.0]);
    assert_vals(&e, &[5.0, 6.0, 5.0, 6.0, 5.0, 6.0]);
    assert_vals(&r, &[5.0, 6.0, 7.0, 8.0]);
    assert_vals(&pc, &[1.0, 3.0, 2.0, 4.0]);
    assert_vals(&c, &[1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    // Replacing the buffer of a view would change what its siblings see: refused.
    let v = n.to_variable();
    let err = v.set_data(&t64(&[0.0, 0.0], &[1, 2])).unwrap_err();
    assert!(format!("{err}").contains("view"), "{err}");
    assert_vals(&x, &[5.0, 6.0, 7.0, 8.0]);
}
