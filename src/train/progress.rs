//! The per-epoch progress display on stderr: an `indicatif` bar on a terminal, a plain line every
//! tenth of the epoch elsewhere (CI logs, pipes), or nothing.
//!
//! [`EpochProgress::tick`] runs after every training step, so it stays cheap: a counter, an
//! atomic add, and a redraw that `indicatif` limits to 10 a second. It never reads the device;
//! the trainer passes a host value through [`EpochProgress::set_message`] when it has one.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A live bar (stderr is a terminal).
    Bar,
    /// A plain line at most every tenth of the epoch, no escape codes.
    Lines,
    /// Nothing.
    Off,
}

impl ProgressMode {
    /// `Bar` when stderr is a terminal that can redraw, else `Lines`.
    pub fn detect() -> Self {
        let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
        if std::io::stderr().is_terminal() && !dumb {
            ProgressMode::Bar
        } else {
            ProgressMode::Lines
        }
    }
}

/// Bar redraws a second.
const BAR_HZ: u8 = 10;
/// In `Lines` mode, the least time between two lines (and from the start to the first): a short
/// epoch prints few lines or none, and the trainer's summary line says the rest.
const MIN_LINE_INTERVAL: Duration = Duration::from_secs(1);

/// The progress of one epoch; make one per epoch, [`tick`](Self::tick) after each step, and
/// [`finish`](Self::finish) before printing the epoch's summary.
pub struct EpochProgress {
    epoch: usize,
    epochs: usize,
    steps: u64,
    mode: ProgressMode,
    done: u64,
    /// Shared with the bar's images/s field.
    images: Arc<AtomicU64>,
    start: Instant,
    message: String,
    bar: Option<ProgressBar>,
    /// Lines mode: tenths of the epoch already reported, and when the last line went out.
    tenths_shown: u64,
    last_line: Instant,
    /// What the rate counts: `images`, `tokens`.
    unit: &'static str,
}

impl EpochProgress {
    /// Epoch `epoch` (1-based) of `epochs`, `steps` steps long (0 when not known).
    pub fn new(epoch: usize, epochs: usize, steps: u64, mode: ProgressMode) -> Self {
        let images = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let bar =
            (mode == ProgressMode::Bar).then(|| new_bar(epoch, epochs, steps, &images, "images"));
        EpochProgress {
            epoch,
            epochs,
            steps,
            mode,
            done: 0,
            images,
            start,
            message: String::new(),
            bar,
            tenths_shown: 0,
            last_line: start,
            unit: "images",
        }
    }

    /// One step done, on `images` images.
    /// What the rate counts (default `images`; the GPT job counts `tokens`).
    pub fn with_unit(mut self, unit: &'static str) -> Self {
        self.unit = unit;
        if self.bar.is_some() {
            self.bar = Some(new_bar(
                self.epoch,
                self.epochs,
                self.steps,
                &self.images,
                unit,
            ));
        }
        self
    }

    pub fn tick(&mut self, images: usize) {
        self.done += 1;
        self.images.fetch_add(images as u64, Ordering::Relaxed);
        match self.mode {
            ProgressMode::Off => {}
            ProgressMode::Bar => {
                if let Some(bar) = &self.bar {
                    bar.inc(1);
                }
            }
            ProgressMode::Lines => {
                if self.steps == 0 || self.done >= self.steps {
                    return;
                }
                let tenths = self.done * 10 / self.steps;
                if tenths <= self.tenths_shown {
                    return;
                }
                self.tenths_shown = tenths;
                let now = Instant::now();
                if now.duration_since(self.last_line) < MIN_LINE_INTERVAL {
                    return;
                }
                self.last_line = now;
                let line = progress_line(
                    self.epoch,
                    self.epochs,
                    self.done,
                    self.steps,
                    self.images_per_s(now),
                    &self.message,
                )
                .replace(" images/s", &format!(" {}/s", self.unit));
                write_stderr(&line);
            }
        }
    }

    /// Text shown after the counts, e.g. `"loss 0.4123"`; empty for none.
    pub fn set_message(&mut self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(msg.to_string()),
            None => {
                self.message.clear();
                self.message.push_str(msg);
            }
        }
    }

    /// Prints `line` on stderr without garbling the bar (for a log line in mid-epoch).
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| write_stderr(line)),
            None => write_stderr(line),
        }
    }

    /// Ends the epoch's display: the bar is cleared (the trainer prints the summary itself).
    pub fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    fn images_per_s(&self, now: Instant) -> f64 {
        let secs = now.duration_since(self.start).as_secs_f64();
        self.images.load(Ordering::Relaxed) as f64 / secs
    }
}

fn new_bar(
    epoch: usize,
    epochs: usize,
    steps: u64,
    images: &Arc<AtomicU64>,
    unit: &'static str,
) -> ProgressBar {
    let template = if steps > 0 {
        "epoch {prefix} [{bar:30.cyan/blue}] {pos}/{len} steps  {ips}  ETA {eta}  {msg}"
    } else {
        "epoch {prefix} {pos} steps  {ips}  {msg}"
    };
    let images = Arc::clone(images);
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
        .with_key(
            "ips",
            move |state: &ProgressState, w: &mut dyn std::fmt::Write| {
                let secs = state.elapsed().as_secs_f64();
                let n = images.load(Ordering::Relaxed) as f64;
                if secs > 0.0 {
                    let _ = write!(w, "{} {unit}/s", group_thousands((n / secs).round() as u64));
                }
            },
        );
    let len = (steps > 0).then_some(steps);
    ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr_with_hz(BAR_HZ))
        .with_style(style)
        .with_prefix(format!("{epoch}/{epochs}"))
}

/// One line of `Lines` mode, e.g. `epoch 3/10: 40% (31/78 steps), 5,120 images/s, loss 0.4123`.
/// A non-finite rate (no time elapsed yet) and an empty message are left out; with `steps` 0
/// (unknown) it says how many steps are done.
pub fn progress_line(
    epoch: usize,
    epochs: usize,
    done: u64,
    steps: u64,
    images_per_s: f64,
    message: &str,
) -> String {
    let mut line = match (done.min(steps) * 100).checked_div(steps) {
        Some(pct) => format!("epoch {epoch}/{epochs}: {pct}% ({done}/{steps} steps)"),
        None => format!("epoch {epoch}/{epochs}: {done} steps"),
    };
    if images_per_s.is_finite() && images_per_s >= 0.0 {
        line.push_str(", ");
        line.push_str(&group_thousands(images_per_s.round() as u64));
        line.push_str(" images/s");
    }
    if !message.is_empty() {
        line.push_str(", ");
        line.push_str(message);
    }
    line
}

/// `5120` → `"5,120"`.
pub fn group_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(d);
    }
    out
}

/// A line on stderr; a failed write (a closed pipe) is not worth stopping the training for.
fn write_stderr(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}
