//! Dropout by the mask rule of `backend::dropout` (Philox 4x32-10 words from the generator
//! state), the same masks as the CUDA kernels'. The backward is the same map with the forward's
//! saved state.

use rayon::prelude::*;

use super::{CpuStorage, Elem, PAR_THRESHOLD};
use crate::backend::{dropout_state_layout, dropout_word, DropoutOps, DropoutParams, DROPOUT_TAG};
use crate::base::error::{Error, Result};
use crate::base::Layout;
use crate::util::philox::philox4x32;

/// Values per Philox block.
const WORDS: usize = 4;

/// `y = x·scale` where kept, else 0, for the draw at `(seed, offset)`; rounded once to `T`.
pub fn apply<T: Elem>(x: &[T], seed: u64, offset: u64, p: &DropoutParams) -> Vec<T> {
    let thr = p.threshold();
    let scale = T::acc(p.scale());
    let zero = T::from_acc(T::Acc::default());
    let key = [seed as u32, (seed >> 32) as u32];
    // Chunks of values that start on a Philox block boundary draw each block once.
    let head = ((WORDS as u64 - offset % WORDS as u64) % WORDS as u64).min(x.len() as u64) as usize;
    let mut y = vec![zero; x.len()];
    let one = |w: u32, v: T| {
        if w as u64 >= thr {
            T::from_acc(v.to_acc() * scale)
        } else {
            zero
        }
    };
    for i in 0..head {
        y[i] = one(dropout_word(seed, offset, i as u64), x[i]);
    }
    let first_block = (offset + head as u64) / WORDS as u64;
    let body = |(k, (dst, src)): (usize, (&mut [T], &[T]))| {
        let b = first_block + k as u64;
        let words = philox4x32([b as u32, (b >> 32) as u32, DROPOUT_TAG, 0], key);
        for (j, (d, s)) in dst.iter_mut().zip(src).enumerate() {
            *d = one(words[j], *s);
        }
    };
    let (yt, xt) = (&mut y[head..], &x[head..]);
    if xt.len() >= PAR_THRESHOLD {
        yt.par_chunks_mut(WORDS)
            .zip(xt.par_chunks(WORDS))
            .enumerate()
            .for_each(body);
    } else {
        yt.chunks_mut(WORDS)
            .zip(xt.chunks(WORDS))
            .enumerate()
            .for_each(body);
    }
    y
}

/// The generator state's `(seed, offset)`: two I64 values holding u64 bits.
pub fn state_of(op: &'static str, state: &CpuStorage, l: &Layout) -> Result<(u64, u64)> {
    let s = state.span(l);
    let v = s.as_i64(op)?;
    if v.len() != 2 {
        return Err(Error::invalid_arg(
            op,
            "generator state",
            format!("{} value(s)", v.len()),
            "2 values: the seed and the offset",
        ));
    }
    Ok((v[0] as u64, v[1] as u64))
}

/// [`apply`] over a dense span, with the state read from `state`; the result keeps the strides.
pub fn dropout(
    x: &CpuStorage,
    l: &Layout,
    state: &CpuStorage,
    sl: &Layout,
    p: &DropoutParams,
) -> Result<CpuStorage> {
    let (seed, offset) = state_of("dropout", state, sl)?;
    Ok(super::map_float!(&*x.span(l), "dropout", |v| apply(
        v, seed, offset, p
    )))
}

/// Advances the state's offset past `n` values (in place) and returns the state as it was (the
/// draw's, for the backward).
pub fn advance(state: &mut CpuStorage, n: usize) -> Result<CpuStorage> {
    match state {
        CpuStorage::I64(v) if v.len() == 2 => {
            let saved = CpuStorage::I64(v.clone());
            v[1] = (v[1] as u64).wrapping_add(n as u64) as i64;
            Ok(saved)
        }
        other => Err(Error::invalid_arg(
            "dropout_advance",
            "generator state",
            format!(
                "{} of {} value(s)",
                crate::backend::BackendStorage::dtype(other),
                crate::backend::BackendStorage::len(other)
            ),
            "2 i64 values: the seed and the offset",
        )),
    }
}

impl DropoutOps for CpuStorage {
    fn dropout(&self, l: &Layout, state: &mut Self, p: &DropoutParams) -> Result<(Self, Self)> {
        let y = dropout(self, l, state, &dropout_state_layout(), p)?;
        Ok((y, advance(state, p.n)?))
    }
    fn dropout_backward(&self, l: &Layout, saved: &Self, p: &DropoutParams) -> Result<Self> {
        dropout(self, l, saved, &dropout_state_layout(), p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_follow_the_rule_at_any_offset_and_keep_about_1_minus_p() {
        let p = DropoutParams { n: 1000, p: 0.3 };
        let x = vec![1.0f32; 1000];
        for offset in [0u64, 1, 2, 3, 4, 4097] {
            let y = apply(&x, 42, offset, &p);
            for (i, v) in y.iter().enumerate() {
                let keep = dropout_word(42, offset, i as u64) as u64 >= p.threshold();
                assert_eq!(
                    *v,
                    if keep { (1.0 / 0.7) as f32 } else { 0.0 },
                    "{offset} {i}"
                );
            }
        }
        // The parallel path (block-aligned chunks) agrees with the rule too.
        let big = DropoutParams { n: 100_003, p: 0.5 };
        let xb = vec![1.0f32; big.n];
        let y = apply(&xb, 7, 3, &big);
        let kept = y.iter().filter(|v| **v != 0.0).count() as f64 / big.n as f64;
        assert!((kept - 0.5).abs() < 0.01, "{kept}");
        for i in [0usize, 1, 5, 50_000, 100_002] {
            let keep = dropout_word(7, 3, i as u64) as u64 >= big.threshold();
            assert_eq!(y[i] != 0.0, keep);
        }
        assert!(apply(&x, 1, 0, &DropoutParams { n: 1000, p: 1.0 })
            .iter()
            .all(|v| *v == 0.0));
        assert_eq!(apply(&x, 1, 0, &DropoutParams { n: 1000, p: 0.0 }), x);
    }

    #[test]
    fn advance_returns_the_draws_state() {
        let mut s = CpuStorage::I64(vec![9, 10]);
        let saved = advance(&mut s, 7).unwrap();
        assert_eq!(saved, CpuStorage::I64(vec![9, 10]));
        assert_eq!(s, CpuStorage::I64(vec![9, 17]));
        assert!(advance(&mut CpuStorage::I64(vec![1]), 1).is_err());
    }
}
