//! Stopping a run on SIGINT / SIGTERM at a step boundary that every rank agrees on.
//!
//! The signal only sets a flag ([`crate::distributed::signals`]); the loop reads it between
//! steps. One process stops at the next step boundary. Several processes vote through the
//! control plane (a small host gather, no device work) at steps every rank knows in advance:
//! rank 0 proposes how many steps until the next vote so that votes come about every
//! [`VOTE_SECONDS`], and every rank takes rank 0's proposal from the gathered votes. Any rank's
//! signal stops them all after the same step, so that rank 0's checkpoint holds a state every
//! rank reached and no rank waits in a collective for one that left.

use std::time::Instant;

use crate::distributed::signals;
use crate::error::Result;

use super::distributed::Ranks;

/// About how often the ranks vote on stopping (seconds of training between votes).
pub const VOTE_SECONDS: f64 = 0.25;
/// The most steps between two votes.
const MAX_EVERY: u64 = 1000;

/// The stop vote of one rank; see the module doc.
pub struct StopVote {
    /// The step after which the next vote is held.
    next: u64,
    since: Instant,
    since_step: u64,
}

impl StopVote {
    /// A vote held after each of the first steps from `step` on, until the step time is known.
    pub fn new(step: u64) -> StopVote {
        StopVote {
            next: step + 1,
            since: Instant::now(),
            since_step: step,
        }
    }

    /// After `step` steps: the signal that stops every rank here, if any (without a group:
    /// this process's). Cheap between votes (one atomic load, or nothing).
    pub fn poll(&mut self, ranks: &Ranks, step: u64) -> Result<Option<i32>> {
        if ranks.group.is_none() {
            return Ok(signals::pending());
        }
        if step < self.next {
            return Ok(None);
        }
        self.vote(ranks, step)
    }

    /// Votes now (every rank must call it at the same point: the end of an epoch).
    pub fn vote(&mut self, ranks: &Ranks, step: u64) -> Result<Option<i32>> {
        let Some(g) = &ranks.group else {
            return Ok(signals::pending());
        };
        let steps = step.saturating_sub(self.since_step).max(1);
        let per_step = self.since.elapsed().as_secs_f64() / steps as f64;
        let every = if per_step > 0.0 {
            ((VOTE_SECONDS / per_step) as u64).clamp(1, MAX_EVERY)
        } else {
            MAX_EVERY
        };
        let mine = signals::pending().unwrap_or(0);
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&(mine as i64).to_le_bytes());
        bytes.extend_from_slice(&every.to_le_bytes());
        let all = g.all_gather_bytes(&bytes)?;
        let field = |b: &[u8], i: usize| -> u64 {
            b.get(8 * i..8 * i + 8)
                .and_then(|s| s.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let every = all.first().map_or(1, |b| field(b, 1)).clamp(1, MAX_EVERY);
        self.next = step + every;
        self.since = Instant::now();
        self.since_step = step;
        let stop = all
            .iter()
            .map(|b| field(b, 0) as i64 as i32)
            .find(|&s| s != 0);
        Ok(stop)
    }
}
