//! Seeded random numbers from Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy
//! as 1, 2, 3", SC'11; `util::philox`): counter-based, so element `i` of a draw depends only on `(seed, i)` and
//! any device, thread or chunking produces the same values.

pub use crate::util::philox::philox4x32;

fn block(seed: u64, i: u64) -> [u32; 4] {
    philox4x32(
        [i as u32, (i >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// 53-bit uniform in [0, 1) from two words.
fn unit(hi: u32, lo: u32) -> f64 {
    (((hi as u64) << 21) ^ (lo as u64 >> 11)) as f64 * (1.0 / (1u64 << 53) as f64)
}

pub fn uniform(seed: u64, n: usize, low: f64, high: f64) -> Vec<f64> {
    uniform_iter(seed, n, low, high).collect()
}

/// [`uniform`]'s values one by one (nothing allocated).
pub fn uniform_iter(seed: u64, n: usize, low: f64, high: f64) -> impl Iterator<Item = f64> {
    (0..n as u64).map(move |i| {
        let b = block(seed, i);
        low + (high - low) * unit(b[0], b[1])
    })
}

/// Box–Muller on each element's own block.
pub fn normal(seed: u64, n: usize, mean: f64, std: f64) -> Vec<f64> {
    // On every core: a billion-parameter model's init is otherwise minutes of one core (each
    // value depends only on its index, so the values are those of one thread).
    use rayon::prelude::*;
    (0..n)
        .into_par_iter()
        .with_min_len(1 << 16)
        .map(|i| normal_at(seed, i as u64, mean, std))
        .collect()
}

/// [`normal`]'s values rounded to f32 (`as f32`, as a cast of them does), made on every core
/// without the f64 vector: parameter init.
pub fn normal_f32(seed: u64, n: usize, mean: f64, std: f64) -> Vec<f32> {
    use rayon::prelude::*;
    (0..n)
        .into_par_iter()
        .with_min_len(1 << 16)
        .map(|i| normal_at(seed, i as u64, mean, std) as f32)
        .collect()
}

/// [`normal`]'s values one by one (nothing allocated).
pub fn normal_iter(seed: u64, n: usize, mean: f64, std: f64) -> impl Iterator<Item = f64> {
    (0..n as u64).map(move |i| normal_at(seed, i, mean, std))
}

fn normal_at(seed: u64, i: u64, mean: f64, std: f64) -> f64 {
    let b = block(seed, i);
    let u1 = 1.0 - unit(b[0], b[1]); // (0, 1]: ln is finite
    let u2 = unit(b[2], b[3]);
    mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// A stream of seeds for code that draws many tensors (parameter init, data shuffling): each
/// call gives a new seed derived from the stream's seed, reproducibly.
#[derive(Clone, Debug)]
pub struct SeedStream {
    seed: u64,
    next: u64,
}

impl SeedStream {
    pub fn new(seed: u64) -> Self {
        SeedStream { seed, next: 0 }
    }

    pub fn next_seed(&mut self) -> u64 {
        let b = philox4x32(
            [self.next as u32, (self.next >> 32) as u32, 0x5eed, 0],
            [self.seed as u32, (self.seed >> 32) as u32],
        );
        self.next += 1;
        ((b[0] as u64) << 32) | b[1] as u64
    }

    /// A uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_seed() % n.max(1) as u64) as usize
    }

    /// A uniform float in [0, 1).
    pub fn unit(&mut self) -> f64 {
        let s = self.next_seed();
        unit((s >> 32) as u32, s as u32)
    }

    /// The stream's state, for checkpoints.
    pub fn state(&self) -> (u64, u64) {
        (self.seed, self.next)
    }

    pub fn from_state((seed, next): (u64, u64)) -> Self {
        SeedStream { seed, next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Random123's published known-answer vector for philox4x32-10 with zero counter and key.
        assert_eq!(
            philox4x32([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
    }

    #[test]
    fn normal_moments() {
        let v = normal(7, 100_000, 1.0, 2.0);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.03, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.03, "std {}", var.sqrt());
    }
}
