//! Divergence: a run whose loss or gradients stay non-finite. Every such step is skipped by the
//! AMP optimizer (its overflow check sees the Inf/NaN gradients that a non-finite loss gives;
//! the dynamic loss scale halves each time), so the run would go on "training" with a
//! collapsing loss scale and a NaN loss, and exit 0.
//!
//! The watch reads the loss scaler's counters (a host read, so not every step: every
//! `limit / 2` steps and at each epoch's end) and counts the steps since the last read; when
//! every one of at least `limit` consecutive steps was skipped, the run has diverged. The
//! stop comes within 1.5 × `limit` steps of the first skipped step, and no run that has a
//! clean step in every `limit / 2` is stopped.

/// Watches the skipped-step count of a run; see the module documentation.
#[derive(Clone, Debug)]
pub struct DivergenceWatch {
    /// Consecutive skipped steps that mean divergence (0: never).
    limit: u64,
    /// Steps between reads.
    interval: u64,
    /// The step and skipped total of the last read.
    at_step: u64,
    at_skipped: u64,
    /// Steps known to be skipped in a row, ending at the last read, and the first of them.
    streak: u64,
    streak_start: u64,
}

impl DivergenceWatch {
    /// Starts watching at `step`, where the scaler had skipped `skipped_total` steps in all.
    pub fn new(limit: u64, step: u64, skipped_total: u64) -> Self {
        DivergenceWatch {
            limit,
            interval: (limit / 2).max(1),
            at_step: step,
            at_skipped: skipped_total,
            streak: 0,
            streak_start: step,
        }
    }

    /// Whether the scaler should be read after step `step` (1-based count of steps done).
    pub fn due(&self, step: u64) -> bool {
        self.limit > 0 && step >= self.at_step + self.interval
    }

    /// Takes a read of the scaler after `step` steps (`skipped_total` skipped in all, the
    /// scale now `scale`); `Some(why)` when the run has diverged.
    pub fn observe(&mut self, step: u64, skipped_total: u64, scale: f64) -> Option<String> {
        let steps = step.saturating_sub(self.at_step);
        let skipped = skipped_total.saturating_sub(self.at_skipped);
        if steps == 0 {
            return None;
        }
        if skipped >= steps {
            if self.streak == 0 {
                self.streak_start = self.at_step + 1;
            }
            self.streak += steps;
        } else {
            // Some step since the last read was clean; where the skips after it begin is not
            // known, so the count starts again (never an early stop).
            self.streak = 0;
        }
        self.at_step = step;
        self.at_skipped = skipped_total;
        (self.limit > 0 && self.streak >= self.limit).then(|| {
            format!(
                "all {} steps from step {} to {step} were skipped for a non-finite loss or \
                 non-finite gradients (the loss scale is now {}; divergence_steps = {})",
                self.streak,
                self.streak_start,
                crate::error::fmt_number(scale),
                self.limit
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads every `interval` steps of a run whose step `s` is skipped when `skip(s)`.
    fn first_stop(limit: u64, steps: u64, skip: impl Fn(u64) -> bool) -> Option<u64> {
        let mut w = DivergenceWatch::new(limit, 0, 0);
        let mut skipped = 0;
        for s in 1..=steps {
            skipped += skip(s) as u64;
            if w.due(s) && w.observe(s, skipped, 1.0).is_some() {
                return Some(s);
            }
        }
        None
    }

    #[test]
    fn stops_within_one_and_a_half_limits_and_never_early() {
        // Skipping from step 31 on: at least 100 skipped steps, at most 150, before the stop.
        let stop = first_stop(100, 1000, |s| s > 30).unwrap();
        assert!((130..=180).contains(&stop), "{stop}");
        // One clean step every 49 steps: never a stop.
        assert_eq!(first_stop(100, 5000, |s| s % 49 != 0), None);
        // Limit 0: never.
        assert_eq!(first_stop(0, 1000, |_| true), None);
        // Limit 1: the first read of a skipped step.
        assert_eq!(first_stop(1, 10, |s| s >= 3), Some(3));
    }
}
