//! The on-disk cache of chosen convolution plans, beside the kernel cache
//! (`$MIXPREC_CUDNN_PLAN_CACHE`, else `~/.cache/mixprec/cudnn-plans`), so that a second process
//! starts at full speed without timing anything.
//!
//! One small JSON file per plan, named by a hash of its key and holding the key itself: the GPU
//! (name, compute capability, SM count), the driver and cuDNN versions, the choice rules (API,
//! runtime-compiled engines, this file's format), the geometry, memory format, dtype, direction
//! and TF32 setting. It records what was chosen (a graph engine id with its knob choices, or a
//! legacy algorithm with its math type), the workspace, the measured time and how many
//! candidates were timed. Files are replaced atomically (temp file + rename), so processes that
//! tune the same plan at once, like DDP ranks, each leave a whole file. A file that is
//! unreadable, corrupt, of another key or format, or that no longer rebuilds is ignored with a
//! log line and the plan is chosen again; the cache never makes a convolution fail.
//!
//! `MIXPREC_CUDNN_PLAN_CACHE=0` turns it off; `MIXPREC_CUDNN_RETUNE=1` times every plan again
//! and rewrites its file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::conv_plan::Dir;
use super::registry::fnv1a;
use crate::backend::Conv2dParams;
use crate::base::DType;

/// The version of this file format and of the choice rules behind the entries: a change to
/// either makes older entries stale.
/// 2: Winograd and FFT refused for f32 without TF32.
pub(super) const FORMAT: u32 = 2;

/// What was chosen, enough to rebuild it without timing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "api", rename_all = "lowercase")]
pub(super) enum Choice {
    /// A graph-API engine configuration: the engine's global index and its knob choices as
    /// (knob type, value).
    Graph { engine: i64, knobs: Vec<(u32, i64)> },
    /// A legacy algorithm and the math type it runs with (cuDNN's numbers).
    Legacy { algo: i64, math: i64 },
    /// Our own kernel (`conv_direct.rs`), as it describes itself with its launch shape.
    Direct { kernel: String },
}

/// One cached plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Entry {
    pub(super) format: u32,
    pub(super) key: String,
    pub(super) choice: Choice,
    pub(super) workspace: usize,
    /// The chosen plan's median time when it was timed (ms).
    pub(super) time_ms: f32,
    pub(super) graph_candidates: usize,
    pub(super) legacy_candidates: usize,
    pub(super) graph_timed: usize,
    pub(super) legacy_timed: usize,
    /// What runs, as the logs and `conv_plans` describe it (for a reader of the file).
    pub(super) algorithm: String,
}

/// Where the cache is and how it is used this time.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum CacheUse {
    Off,
    /// Read entries and write new ones.
    ReadWrite(PathBuf),
    /// Choose every plan again and rewrite its entry (`MIXPREC_CUDNN_RETUNE=1`).
    WriteOnly(PathBuf),
}

impl CacheUse {
    pub(super) fn from_env() -> CacheUse {
        let dir = match std::env::var_os("MIXPREC_CUDNN_PLAN_CACHE") {
            Some(v) if v.is_empty() || v == "0" || v == "off" => return CacheUse::Off,
            Some(v) => PathBuf::from(v),
            None => match std::env::var_os("HOME") {
                Some(h) => PathBuf::from(h).join(".cache/mixprec/cudnn-plans"),
                None => return CacheUse::Off,
            },
        };
        if super::device::env_on("MIXPREC_CUDNN_RETUNE") {
            CacheUse::WriteOnly(dir)
        } else {
            CacheUse::ReadWrite(dir)
        }
    }

    pub(super) fn dir(&self) -> Option<&Path> {
        match self {
            CacheUse::Off => None,
            CacheUse::ReadWrite(d) | CacheUse::WriteOnly(d) => Some(d),
        }
    }
}

/// The key of one plan: `device` identifies the GPU, driver and cuDNN (see `conv.rs`), `rules`
/// the choice rules in force.
pub(super) fn key(
    device: &str,
    rules: &str,
    p: &Conv2dParams,
    dtype: DType,
    dir: Dir,
    tf32: bool,
) -> String {
    format!(
        "{device};{rules};format {FORMAT}|{dir:?} {dtype} tf32={tf32} {}|n={} c={} h={} w={} k={} r={} s={} \
         stride={}x{} pad={}x{} dil={}x{} groups={}",
        p.format.name(),
        p.n,
        p.c_in,
        p.h,
        p.w,
        p.c_out,
        p.kh,
        p.kw,
        p.stride.0,
        p.stride.1,
        p.padding.0,
        p.padding.1,
        p.dilation.0,
        p.dilation.1,
        p.groups
    )
}

/// The file of `key` in `dir`.
pub(super) fn path(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{:016x}.json", fnv1a(&[key.as_bytes()])))
}

/// Why a file is not a usable entry for `key`.
fn parse(bytes: &[u8], key: &str) -> std::result::Result<Entry, String> {
    let e: Entry = serde_json::from_slice(bytes).map_err(|e| format!("not a plan entry: {e}"))?;
    if e.format != FORMAT {
        return Err(format!("format {} (this build writes {FORMAT})", e.format));
    }
    if e.key != key {
        return Err(format!("written for another plan ({})", e.key));
    }
    if !e.time_ms.is_finite() || e.time_ms < 0.0 {
        return Err(format!("time {} ms", e.time_ms));
    }
    Ok(e)
}

/// The entry for `key`, if the cache holds a usable one. An absent file is a plain miss; any
/// other problem is logged and counts as a miss.
pub(super) fn load(dir: &Path, key: &str) -> Option<Entry> {
    let file = path(dir, key);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!(
                "cuDNN plan cache: cannot read {}: {e}; choosing the plan again",
                file.display()
            );
            return None;
        }
    };
    match parse(&bytes, key) {
        Ok(e) => Some(e),
        Err(why) => {
            log::warn!(
                "cuDNN plan cache: ignoring {}: {why}; choosing the plan again",
                file.display()
            );
            None
        }
    }
}

/// Writes `entry` (atomically; a failure is logged: it only costs a new choice next time).
pub(super) fn store(dir: &Path, entry: &Entry) {
    let file = path(dir, &entry.key);
    let write = || -> crate::base::error::Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| crate::base::error::Error::io(format!("creating {}", dir.display()), e))?;
        crate::util::write_atomic(&file, |w| {
            serde_json::to_writer_pretty(&mut *w, entry).map_err(|e| {
                crate::base::error::Error::io(
                    format!("writing {}", file.display()),
                    std::io::Error::other(e),
                )
            })
        })
    };
    if let Err(e) = write() {
        log::warn!("cuDNN plan cache: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::MemoryFormat;

    fn params(format: MemoryFormat) -> Conv2dParams {
        Conv2dParams {
            n: 256,
            c_in: 512,
            h: 28,
            w: 28,
            c_out: 1024,
            kh: 1,
            kw: 1,
            stride: (2, 2),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
            format,
        }
    }

    fn entry(key: &str) -> Entry {
        Entry {
            format: FORMAT,
            key: key.into(),
            choice: Choice::Graph {
                engine: 73,
                knobs: vec![(0, 1), (13, 64), (25, 308281491)],
            },
            workspace: 308281491,
            time_ms: 0.27,
            graph_candidates: 9,
            legacy_candidates: 3,
            graph_timed: 9,
            legacy_timed: 3,
            algorithm: "graph engine 73 [TENSOR_CORE]".into(),
        }
    }

    /// A fresh directory under the system's temp dir.
    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "mixprec-plan-cache-{name}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn keys_tell_plans_apart() {
        let dev = "NVIDIA H200 sm90 132 SMs driver 13000 cudnn 91000";
        let p = params(MemoryFormat::Contiguous);
        let k = key(
            dev,
            "api fastest",
            &p,
            DType::BF16,
            Dir::BackwardData,
            false,
        );
        let others = [
            key(dev, "api fastest", &p, DType::F16, Dir::BackwardData, false),
            key(dev, "api fastest", &p, DType::BF16, Dir::Forward, false),
            key(dev, "api fastest", &p, DType::BF16, Dir::BackwardData, true),
            key(dev, "api legacy", &p, DType::BF16, Dir::BackwardData, false),
            key(
                "NVIDIA H100 sm90 132 SMs driver 13000 cudnn 91000",
                "api fastest",
                &p,
                DType::BF16,
                Dir::BackwardData,
                false,
            ),
            key(
                dev,
                "api fastest",
                &params(MemoryFormat::ChannelsLast),
                DType::BF16,
                Dir::BackwardData,
                false,
            ),
            key(
                dev,
                "api fastest",
                &Conv2dParams { n: 128, ..p },
                DType::BF16,
                Dir::BackwardData,
                false,
            ),
        ];
        for o in &others {
            assert_ne!(&k, o);
            assert_ne!(path(Path::new("/c"), &k), path(Path::new("/c"), o));
        }
    }

    #[test]
    fn an_entry_round_trips() {
        let dir = temp_dir("roundtrip");
        let e = entry("the key");
        assert_eq!(load(&dir, "the key"), None, "empty cache");
        store(&dir, &e);
        assert_eq!(load(&dir, "the key"), Some(e.clone()));
        let legacy = Entry {
            choice: Choice::Legacy { algo: 1, math: 1 },
            ..entry("another key")
        };
        store(&dir, &legacy);
        assert_eq!(load(&dir, "another key"), Some(legacy));
        assert_eq!(load(&dir, "the key"), Some(e));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unusable_files_are_misses() {
        let dir = temp_dir("corrupt");
        let k = "k";
        let file = path(&dir, k);
        for bad in [
            &b""[..],
            b"{",
            b"\x00\xff garbage",
            b"{\"format\": 1}",
            b"[1, 2, 3]",
        ] {
            std::fs::write(&file, bad).unwrap();
            assert_eq!(load(&dir, k), None, "{:?}", String::from_utf8_lossy(bad));
        }
        // Another plan's entry under this file name (a hash collision), or another format.
        std::fs::write(&file, serde_json::to_vec(&entry("other")).unwrap()).unwrap();
        assert_eq!(load(&dir, k), None);
        let old = Entry {
            format: FORMAT + 1,
            ..entry(k)
        };
        std::fs::write(&file, serde_json::to_vec(&old).unwrap()).unwrap();
        assert_eq!(load(&dir, k), None);
        // A directory in the file's place cannot be read: a miss too.
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        assert_eq!(load(&dir, k), None);
        // And writing over it fails quietly.
        store(&dir, &entry(k));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn concurrent_writers_leave_a_whole_file() {
        let dir = temp_dir("concurrent");
        std::thread::scope(|s| {
            for t in 0..8 {
                let dir = &dir;
                s.spawn(move || {
                    for _ in 0..20 {
                        store(
                            dir,
                            &Entry {
                                time_ms: t as f32,
                                ..entry("shared")
                            },
                        );
                        // Readers see some writer's whole entry, never a torn one.
                        assert!(load(dir, "shared").is_some());
                    }
                });
            }
        });
        assert!(load(&dir, "shared").is_some());
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
