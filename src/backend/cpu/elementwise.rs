//! Unary, affine, power and broadcast binary ops.

use num_traits::Float;
use rayon::prelude::*;

use super::{alloc, map_float, map_float2, CpuStorage};
use super::{Elem, PAR_THRESHOLD};
use crate::backend::BackendStorage;
use crate::backend::ElementwiseOps;
use crate::backend::{BinaryOp, UnaryOp};
use crate::base::error::Result;
use crate::base::Layout;

/// Elements per block of the blocked maps: widened blocks stay in L1.
const BLOCK: usize = 2048;

/// Applies `f` elementwise, in parallel for large inputs. Works on blocks of widened values so
/// that half inputs convert in bulk.
pub(crate) fn map<T: Elem>(x: &[T], f: impl Fn(T::Acc) -> T::Acc + Sync) -> Vec<T> {
    let mut out = vec![T::default(); x.len()];
    let body = |(src, dst): (&[T], &mut [T])| {
        // On the stack: no allocation per block.
        let mut buf = [T::Acc::default(); BLOCK];
        let buf = &mut buf[..src.len()];
        T::widen_into(src, buf);
        for v in buf.iter_mut() {
            *v = f(*v);
        }
        T::narrow_into(buf, dst);
    };
    if x.len() >= PAR_THRESHOLD {
        x.par_chunks(BLOCK)
            .zip(out.par_chunks_mut(BLOCK))
            .for_each(body);
    } else {
        x.chunks(BLOCK).zip(out.chunks_mut(BLOCK)).for_each(body);
    }
    out
}

/// `f` over two equal-length inputs, blocked like [`map`].
fn zip_map<T: Elem>(a: &[T], b: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc + Sync) -> Vec<T> {
    let mut out = vec![T::default(); a.len()];
    let body = |((sa, sb), dst): ((&[T], &[T]), &mut [T])| {
        let (mut wa, mut wb) = ([T::Acc::default(); BLOCK], [T::Acc::default(); BLOCK]);
        let (wa, wb) = (&mut wa[..sa.len()], &mut wb[..sb.len()]);
        T::widen_into(sa, wa);
        T::widen_into(sb, wb);
        for (x, &y) in wa.iter_mut().zip(wb.iter()) {
            *x = f(*x, y);
        }
        T::narrow_into(wa, dst);
    };
    if a.len() >= PAR_THRESHOLD {
        a.par_chunks(BLOCK)
            .zip(b.par_chunks(BLOCK))
            .zip(out.par_chunks_mut(BLOCK))
            .for_each(body);
    } else {
        a.chunks(BLOCK)
            .zip(b.chunks(BLOCK))
            .zip(out.chunks_mut(BLOCK))
            .for_each(body);
    }
    out
}

pub fn unary<T: Elem>(x: &[T], op: UnaryOp) -> Vec<T> {
    let zero = <T::Acc as num_traits::Zero>::zero();
    match op {
        UnaryOp::Neg => map(x, |v| -v),
        UnaryOp::Relu => map(x, |v| if v > zero { v } else { zero }),
        UnaryOp::Exp => map(x, |v| v.exp()),
        UnaryOp::Log => map(x, |v| v.ln()),
        UnaryOp::Sqrt => map(x, |v| v.sqrt()),
        UnaryOp::Sqr => map(x, |v| v * v),
        UnaryOp::Abs => map(x, |v| v.abs()),
    }
}

pub fn affine<T: Elem>(x: &[T], mul: f64, add: f64) -> Vec<T> {
    let (m, a) = (T::acc(mul), T::acc(add));
    map(x, |v| v * m + a)
}

pub fn powf<T: Elem>(x: &[T], e: f64) -> Vec<T> {
    let e = T::acc(e);
    map(x, |v| v.powf(e))
}

fn apply<A: Float>(op: BinaryOp, a: A, b: A) -> A {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        // NaN propagates, as torch.maximum/minimum.
        BinaryOp::Maximum => {
            if a.is_nan() || b.is_nan() {
                A::nan()
            } else {
                a.max(b)
            }
        }
        BinaryOp::Minimum => {
            if a.is_nan() || b.is_nan() {
                A::nan()
            } else {
                a.min(b)
            }
        }
    }
}

/// Binary op over two operands of one shape and one dense order (their spans), blocked.
pub fn zip<T: Elem>(a: &[T], b: &[T], op: BinaryOp) -> Vec<T> {
    zip_map(a, b, |x, y| apply(op, x, y))
}

/// Binary op of two operands read through their strides (`la`, `lb`: the output's shape,
/// stride 0 along broadcast dims), written row-major. Rows of the last dimension are the unit
/// of work: each computes its two base offsets once, then walks with the last strides.
pub fn binary_strided<T: Elem>(a: &[T], la: &Layout, b: &[T], lb: &Layout, op: BinaryOp) -> Vec<T> {
    let n = la.elem_count();
    if n == 0 {
        return Vec::new();
    }
    let dims = la.dims();
    let rank = dims.len();
    let (sa, sb) = (la.strides(), lb.strides());
    let last = if rank == 0 { 1 } else { dims[rank - 1] };
    let (ja, jb) = if rank == 0 {
        (0, 0)
    } else {
        (sa[rank - 1], sb[rank - 1])
    };
    let mut res = vec![T::default(); n];
    let row = |(r, dst): (usize, &mut [T])| {
        // Decompose the row index into the leading coordinates.
        let (mut oa, mut ob, mut rem) = (la.offset(), lb.offset(), r);
        for d in (0..rank.saturating_sub(1)).rev() {
            let c = rem % dims[d];
            rem /= dims[d];
            oa += c * sa[d];
            ob += c * sb[d];
        }
        for (j, o) in dst.iter_mut().enumerate() {
            *o = T::from_acc(apply(op, a[oa + j * ja].to_acc(), b[ob + j * jb].to_acc()));
        }
    };
    if n >= PAR_THRESHOLD {
        res.par_chunks_mut(last).enumerate().for_each(row);
    } else {
        res.chunks_mut(last).enumerate().for_each(row);
    }
    res
}

pub fn relu_backward<T: Elem>(g: &[T], x: &[T]) -> Vec<T> {
    let zero = <T::Acc as num_traits::Zero>::zero();
    let f = |(g, x): (&T, &T)| {
        if x.to_acc() > zero {
            *g
        } else {
            T::from_acc(zero)
        }
    };
    if g.len() >= PAR_THRESHOLD {
        g.par_iter().zip(x.par_iter()).map(f).collect()
    } else {
        g.iter().zip(x.iter()).map(f).collect()
    }
}

impl ElementwiseOps for CpuStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        Ok(map_float!(&*self.span(l), op.name(), |v| unary(v, op)))
    }
    fn affine(&self, l: &Layout, mul: f64, add: f64) -> Result<Self> {
        Ok(map_float!(&*self.span(l), "affine", |v| {
            affine(v, mul, add)
        }))
    }
    fn powf(&self, l: &Layout, e: f64) -> Result<Self> {
        Ok(map_float!(&*self.span(l), "powf", |v| powf(v, e)))
    }
    fn binary(
        &self,
        l: &Layout,
        rhs: &Self,
        rl: &Layout,
        op: BinaryOp,
        out: &Layout,
    ) -> Result<Self> {
        alloc::probe_output(op.name(), out.elem_count(), self.dtype())?;
        // Same dense strides on all three: one walk over the spans.
        if l.is_dense() && l.strides() == rl.strides() && l.strides() == out.strides() {
            let (a, b) = (self.span(l), rhs.span(rl));
            return Ok(map_float2!(&*a, &*b, op.name(), |x, y| zip(x, y, op)));
        }
        let flat = Layout::contiguous(out.shape().clone());
        let res = map_float2!(self, rhs, op.name(), |a, b| {
            binary_strided(a, l, b, rl, op)
        });
        if out.is_contiguous() {
            Ok(res)
        } else {
            res.copy_strided(&flat, out)
        }
    }
    fn relu_backward(&self, l: &Layout, x: &Self, xl: &Layout) -> Result<Self> {
        let (g, x) = (self.span(l), x.span(xl));
        Ok(map_float2!(&*g, &*x, "relu_backward", |g, x| {
            relu_backward(g, x)
        }))
    }
}
