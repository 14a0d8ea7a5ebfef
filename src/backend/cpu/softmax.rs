//! Softmax and log-softmax over the middle dimension, with the max subtracted for stability.

use num_traits::Float;
use rayon::prelude::*;

use super::{map_float, map_float2, CpuStorage};
use super::{Elem, PAR_THRESHOLD};
use crate::backend::DimSplit;
use crate::backend::SoftmaxOps;
use crate::base::error::Result;
use crate::base::Layout;

/// Runs `f(o, i)` for every (outer, inner) lane; each lane owns the elements `o·len·inner + j·inner + i`.
fn lanes<T: Elem>(
    n: usize,
    (outer, len, inner): DimSplit,
    f: impl Fn(usize, usize, &mut dyn FnMut(usize, T)) + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); n];
    if inner == 1 {
        let body = |(o, dst): (usize, &mut [T])| f(o, 0, &mut |j, v| dst[j] = v);
        if n >= PAR_THRESHOLD {
            out.par_chunks_mut(len.max(1)).enumerate().for_each(body);
        } else {
            out.chunks_mut(len.max(1)).enumerate().for_each(body);
        }
    } else {
        for o in 0..outer {
            for i in 0..inner {
                f(o, i, &mut |j, v| out[(o * len + j) * inner + i] = v);
            }
        }
    }
    out
}

pub fn softmax<T: Elem>(x: &[T], split: DimSplit, log: bool) -> Vec<T> {
    let (_, len, inner) = split;
    lanes(x.len(), split, |o, i, put| {
        let at = |j: usize| x[(o * len + j) * inner + i].to_acc();
        let mut max = T::Acc::neg_infinity();
        for j in 0..len {
            max = max.max(at(j));
        }
        let mut sum = <T::Acc as num_traits::Zero>::zero();
        for j in 0..len {
            sum += (at(j) - max).exp();
        }
        if log {
            let lse = max + sum.ln();
            for j in 0..len {
                put(j, T::from_acc(at(j) - lse));
            }
        } else {
            for j in 0..len {
                put(j, T::from_acc((at(j) - max).exp() / sum));
            }
        }
    })
}

/// softmax: dx = y·(g − Σ g·y); log-softmax: dx = g − exp(y)·Σ g.
pub fn softmax_backward<T: Elem>(g: &[T], y: &[T], split: DimSplit, log: bool) -> Vec<T> {
    let (_, len, inner) = split;
    lanes(g.len(), split, |o, i, put| {
        let k = |j: usize| (o * len + j) * inner + i;
        let mut s = <T::Acc as num_traits::Zero>::zero();
        for j in 0..len {
            s += if log {
                g[k(j)].to_acc()
            } else {
                g[k(j)].to_acc() * y[k(j)].to_acc()
            };
        }
        for j in 0..len {
            let (gj, yj) = (g[k(j)].to_acc(), y[k(j)].to_acc());
            put(
                j,
                T::from_acc(if log {
                    gj - yj.exp() * s
                } else {
                    yj * (gj - s)
                }),
            );
        }
    })
}

impl SoftmaxOps for CpuStorage {
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(map_float!(&*self.span(l), "softmax", |x| softmax(
            x, split, log
        )))
    }
    fn softmax_backward(
        &self,
        l: &Layout,
        y: &Self,
        yl: &Layout,
        dim: usize,
        log: bool,
    ) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        let (g, y) = (self.span(l), y.span(yl));
        Ok(map_float2!(&*g, &*y, "softmax_backward", |g, y| {
            softmax_backward(g, y, split, log)
        }))
    }
}
