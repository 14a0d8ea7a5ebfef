//! One record per epoch, kept in memory and written to two files as the run goes:
//! `metrics.csv` (for spreadsheets and a quick `column -t`) and `metrics.jsonl` (one JSON object a
//! line, the machine-readable copy that `--resume` reads back with [`read_jsonl`]).
//!
//! Non-finite values (a diverged run's NaN loss) are kept: the CSV writes `NaN`/`inf`, and the
//! JSON lines write them as the strings `"NaN"`, `"inf"`, `"-inf"`, since JSON has no number for
//! them (serde_json would write `null` and then fail to read it back as an `f64`).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// File names inside the run directory.
pub const CSV_FILE: &str = "metrics.csv";
pub const JSONL_FILE: &str = "metrics.jsonl";

/// The CSV header, in [`EpochRecord`]'s field order.
pub const CSV_HEADER: &str = "epoch,step,train_loss,train_accuracy,test_loss,test_accuracy,lr,\
images_per_s,epoch_seconds,loss_scale,skipped_steps";

/// What one epoch of training produced. Accuracies are fractions in `[0, 1]` (the plot shows
/// them as percentages).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// 1-based.
    pub epoch: usize,
    /// Optimizer steps taken since the start of the run, at the end of this epoch.
    pub step: u64,
    #[serde(with = "json_f64")]
    pub train_loss: f64,
    /// `None` when the trainer did not measure it (it costs a device read per step).
    #[serde(with = "json_opt_f64", default)]
    pub train_accuracy: Option<f64>,
    #[serde(with = "json_f64")]
    pub test_loss: f64,
    #[serde(with = "json_f64")]
    pub test_accuracy: f64,
    /// The learning rate at the end of the epoch.
    #[serde(with = "json_f64")]
    pub lr: f64,
    #[serde(with = "json_f64")]
    pub images_per_s: f64,
    #[serde(with = "json_f64")]
    pub epoch_seconds: f64,
    /// The AMP loss scale at the end of the epoch (1 when no scaling is used).
    #[serde(with = "json_f64")]
    pub loss_scale: f64,
    /// Steps skipped in this epoch because the scaled gradients overflowed.
    pub skipped_steps: u64,
}

impl EpochRecord {
    /// The record as one CSV row (no newline), fields in [`CSV_HEADER`]'s order; an absent train
    /// accuracy is an empty field.
    pub fn csv_row(&self) -> String {
        let train_accuracy = self
            .train_accuracy
            .map(|a| a.to_string())
            .unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{}",
            self.epoch,
            self.step,
            self.train_loss,
            train_accuracy,
            self.test_loss,
            self.test_accuracy,
            self.lr,
            self.images_per_s,
            self.epoch_seconds,
            self.loss_scale,
            self.skipped_steps
        )
    }

    /// The record as one JSON object (no newline).
    pub fn json_line(&self) -> String {
        // Every field is a number, a string or null: serializing cannot fail.
        serde_json::to_string(self).expect("EpochRecord serializes to JSON")
    }
}

/// Writes the per-epoch files of one run and keeps the history in memory (for the plot).
#[derive(Debug)]
pub struct MetricsWriter {
    csv: File,
    jsonl: File,
    csv_path: PathBuf,
    jsonl_path: PathBuf,
    history: Vec<EpochRecord>,
}

impl MetricsWriter {
    /// Starts a run's files in `dir` (created if missing): `metrics.csv` with its header and an
    /// empty `metrics.jsonl`, replacing any from an earlier run.
    pub fn create(dir: &Path) -> Result<Self> {
        Self::resume(dir, &[])
    }

    /// Continues a run: rewrites both files in `dir` with `history` (the records read back from
    /// the checkpointed run), so that epochs logged after the checkpoint disappear, then appends.
    /// Each file is replaced atomically: a failure leaves the old one in place.
    pub fn resume(dir: &Path, history: &[EpochRecord]) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating directory {}", dir.display()), e))?;
        let csv_path = dir.join(CSV_FILE);
        let jsonl_path = dir.join(JSONL_FILE);

        let mut csv = String::with_capacity(128 * (history.len() + 1));
        csv.push_str(CSV_HEADER);
        csv.push('\n');
        let mut jsonl = String::with_capacity(256 * history.len());
        for r in history {
            csv.push_str(&r.csv_row());
            csv.push('\n');
            jsonl.push_str(&r.json_line());
            jsonl.push('\n');
        }
        super::write_atomic(&csv_path, csv.as_bytes())?;
        super::write_atomic(&jsonl_path, jsonl.as_bytes())?;

        Ok(MetricsWriter {
            csv: open_append(&csv_path)?,
            jsonl: open_append(&jsonl_path)?,
            csv_path,
            jsonl_path,
            history: history.to_vec(),
        })
    }

    /// Appends one CSV row and one JSON line, each written whole and flushed, and keeps the
    /// record in [`history`](Self::history).
    pub fn append(&mut self, r: &EpochRecord) -> Result<()> {
        append_line(&mut self.csv, &self.csv_path, &r.csv_row())?;
        append_line(&mut self.jsonl, &self.jsonl_path, &r.json_line())?;
        self.history.push(r.clone());
        Ok(())
    }

    /// Every record of the run so far: the resumed history, then the appended ones.
    pub fn history(&self) -> &[EpochRecord] {
        &self.history
    }

    pub fn csv_path(&self) -> &Path {
        &self.csv_path
    }

    pub fn jsonl_path(&self) -> &Path {
        &self.jsonl_path
    }
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| Error::io(format!("opening {} for appending", path.display()), e))
}

fn append_line(file: &mut File, path: &Path, line: &str) -> Result<()> {
    let mut buf = String::with_capacity(line.len() + 1);
    buf.push_str(line);
    buf.push('\n');
    file.write_all(buf.as_bytes())
        .and_then(|()| file.flush())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Reads a `metrics.jsonl` back, one record per non-blank line. A line that is not a record is
/// an [`Error::DataFormat`] naming the file and the 1-based line number.
pub fn read_jsonl(path: &Path) -> Result<Vec<EpochRecord>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(line).map_err(|e| Error::DataFormat {
            path: path.display().to_string(),
            format: "metrics JSONL",
            detail: format!("line {}: {e}", i + 1),
        })?;
        records.push(record);
    }
    Ok(records)
}

/// An `f64` in JSON: a number when finite, else `"NaN"`, `"inf"` or `"-inf"`. Reads numbers,
/// those strings, and `null` (as NaN, which is what other writers make of a NaN).
mod json_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_str(non_finite_str(*v))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<Repr>::deserialize(d)?
            .map(Repr::value)
            .transpose()?
            .unwrap_or(f64::NAN))
    }

    pub(super) fn non_finite_str(v: f64) -> &'static str {
        if v.is_nan() {
            "NaN"
        } else if v > 0.0 {
            "inf"
        } else {
            "-inf"
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Repr {
        Number(f64),
        Text(String),
    }

    impl Repr {
        pub(super) fn value<E: serde::de::Error>(self) -> Result<f64, E> {
            match self {
                Repr::Number(v) => Ok(v),
                Repr::Text(t) => match t.parse::<f64>() {
                    Ok(v) if !v.is_finite() => Ok(v),
                    _ => Err(E::custom(format!(
                        "expected a number, \"NaN\", \"inf\" or \"-inf\", found \"{t}\""
                    ))),
                },
            }
        }
    }
}

/// An `Option<f64>` in JSON: `null` for `None`, else as [`json_f64`].
mod json_opt_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::json_f64::{non_finite_str, Repr};

    pub fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match *v {
            None => s.serialize_none(),
            Some(v) if v.is_finite() => s.serialize_f64(v),
            Some(v) => s.serialize_str(non_finite_str(v)),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Option::<Repr>::deserialize(d)?.map(Repr::value).transpose()
    }
}
