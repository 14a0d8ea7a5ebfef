//! The dropout family's operands and its mask rule, which every backend follows exactly, so a
//! seed and offset give the same mask on the CPU and on the GPU.
//!
//! A generator's state is two values (I64 storage holding the bits of two u64s): the seed and
//! the offset, the number of values drawn so far. It lives where the tensors live (device memory
//! for CUDA): a captured step reads it and advances it on the device, so every replay draws a
//! new mask. Value `i` of a draw at `(seed, offset)` is dropout_word `e mod 4` of the Philox 4x32-10
//! block for counter `[lo(e/4), hi(e/4), DROPOUT_TAG, 0]` and key `[lo(seed), hi(seed)]`, with
//! `e = offset + i`; the value is kept when that dropout_word is at least [`DropoutParams::threshold`].

/// The third counter dropout_word of dropout's Philox blocks ("drop"): streams of other uses of the same
/// seed (parameter init, data order) never meet it.
pub const DROPOUT_TAG: u32 = 0x6472_6f70;

/// Dropout of `n` values with drop probability `p` (in [0, 1]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutParams {
    pub n: usize,
    pub p: f64,
}

impl DropoutParams {
    /// A value is kept when its 32-bit dropout_word is ≥ this: `round(p·2³²)` (2³² drops everything).
    pub fn threshold(&self) -> u64 {
        (self.p * 4_294_967_296.0)
            .round()
            .clamp(0.0, 4_294_967_296.0) as u64
    }

    /// What a kept value is multiplied by: `1/(1 − p)`, and 0 when everything is dropped.
    pub fn scale(&self) -> f64 {
        if self.p < 1.0 {
            1.0 / (1.0 - self.p)
        } else {
            0.0
        }
    }
}

/// The counter-based bits of value `i` of a draw at `(seed, offset)` (the rule above).
pub fn dropout_word(seed: u64, offset: u64, i: u64) -> u32 {
    let e = offset.wrapping_add(i);
    let b = e / 4;
    let block = crate::util::philox::philox4x32(
        [b as u32, (b >> 32) as u32, DROPOUT_TAG, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    block[(e % 4) as usize]
}

use crate::backend::BackendStorage;
use crate::base::error::Result;
use crate::base::{Layout, Shape};

/// Dropout by the rule above (dense layouts: over the span, the result keeping the strides).
pub trait DropoutOps: BackendStorage {
    /// `self` masked by the draw at `state` (a generator state: 2 I64 values, the seed and the
    /// offset) and scaled by `1/(1 − p)`; advances the state past `p.n` values in place and
    /// returns the output and the state as it was (the draw's, for the backward).
    fn dropout(&self, l: &Layout, state: &mut Self, p: &DropoutParams) -> Result<(Self, Self)>;
    /// Called on the output's gradient with the forward's saved state: the same mask applied.
    fn dropout_backward(&self, l: &Layout, saved: &Self, p: &DropoutParams) -> Result<Self>;
}

/// The layout of a generator state (2 values).
pub fn dropout_state_layout() -> Layout {
    Layout::contiguous(Shape::new(vec![2]))
}
