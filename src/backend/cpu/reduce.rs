//! Reductions over the middle dimension of `(outer, len, inner)`.

use rayon::prelude::*;

use super::{map_float, CpuStorage};
use super::{Elem, PAR_THRESHOLD};
use crate::backend::ReduceOps;
use crate::backend::{DimSplit, ReduceOp};
use crate::base::error::Result;
use crate::base::Layout;
use crate::base::WithDType;

/// Accumulates in f64 whatever the dtype and rounds once: a long f32 sum accumulated in f32
/// drifts by ~√n ulps (1e-4 relative at a million elements), more than the GPU's tree
/// reduction, and the reference must be the more exact of the two.
pub fn reduce<T: Elem>(x: &[T], op: ReduceOp, (outer, len, inner): DimSplit) -> Vec<T> {
    let init = match op {
        ReduceOp::Sum => 0.0f64,
        ReduceOp::Max => f64::NEG_INFINITY,
        ReduceOp::Min => f64::INFINITY,
    };
    let combine = |acc: f64, v: f64| match op {
        ReduceOp::Sum => acc + v,
        // NaN wins, as in torch.max.
        ReduceOp::Max => {
            if v.is_nan() || v > acc {
                v
            } else {
                acc
            }
        }
        ReduceOp::Min => {
            if v.is_nan() || v < acc {
                v
            } else {
                acc
            }
        }
    };
    let mut out = vec![T::default(); outer * inner];
    let block = |(o, dst): (usize, &mut [T])| {
        let base = o * len * inner;
        if inner == 1 {
            let mut acc = init;
            for v in &x[base..base + len] {
                acc = combine(acc, v.to_f64());
            }
            dst[0] = T::from_f64(acc);
        } else {
            let mut acc = vec![init; inner];
            for j in 0..len {
                let row = &x[base + j * inner..base + (j + 1) * inner];
                for (a, v) in acc.iter_mut().zip(row) {
                    *a = combine(*a, v.to_f64());
                }
            }
            for (d, a) in dst.iter_mut().zip(acc) {
                *d = T::from_f64(a);
            }
        }
    };
    if inner == 0 {
        return out;
    }
    if x.len() >= PAR_THRESHOLD && outer > 1 {
        out.par_chunks_mut(inner).enumerate().for_each(block);
    } else {
        out.chunks_mut(inner).enumerate().for_each(block);
    }
    out
}

/// Index of the first maximum along the middle dimension (NaN counts as the maximum).
pub fn argmax<T: WithDType>(x: &[T], (outer, len, inner): DimSplit) -> Vec<i64> {
    let mut out = vec![0i64; outer * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut best = f64::NEG_INFINITY;
            let mut best_j = 0usize;
            for j in 0..len {
                let v = x[(o * len + j) * inner + i].to_f64();
                if v.is_nan() {
                    best_j = j;
                    break;
                }
                if v > best || j == 0 {
                    best = v;
                    best_j = j;
                }
            }
            out[o * inner + i] = best_j as i64;
        }
    }
    out
}

impl ReduceOps for CpuStorage {
    fn reduce(&self, l: &Layout, op: ReduceOp, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(map_float!(&*self.span(l), "reduce", |v| reduce(
            v, op, split
        )))
    }
    fn argmax(&self, l: &Layout, dim: usize) -> Result<Self> {
        let split = l.shape().split_at_dim(dim);
        Ok(CpuStorage::I64(match &*self.span(l) {
            CpuStorage::F16(v) => argmax(v, split),
            CpuStorage::BF16(v) => argmax(v, split),
            CpuStorage::F32(v) => argmax(v, split),
            CpuStorage::F64(v) => argmax(v, split),
            CpuStorage::I64(v) => argmax(v, split),
        }))
    }
}
