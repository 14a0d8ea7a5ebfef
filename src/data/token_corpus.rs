//! A folder of text files tokenized once into train and val token shards
//! ([`token_shards`](super::token_shards)).
//!
//! - **Documents**: every `.txt` or `.txt.gz` file under the folder (recursively; names
//!   starting with `.` are skipped) is one document, read as UTF-8 (a file that is not is an
//!   error naming it). Files are taken in the order of their paths relative to the folder
//!   (byte order), so the result does not depend on the file system.
//! - **Token stream**: each document is preceded by `<|endoftext|>` (50256), as llm.c's and
//!   GPT-2's data are: a model learns where a document starts, and a window that crosses a
//!   boundary sees the separator.
//! - **Split**: the last `val_fraction` of the stream's tokens (rounded down) are val, the rest
//!   train: with the default 0.1 and the bundled Shakespeare, the val set is the end of the
//!   last plays by name, text the model never trains on.
//! - **Shards**: `train_000000.bin`, `train_000001.bin`, ... of at most `shard_tokens` tokens
//!   each, then `val_000000.bin`, ...; older shards of those names beyond the new count are
//!   removed.
//! - **Manifest**: `corpus.json`, written last, records the source files (relative path, size,
//!   CRC-32), the options and the shards. [`prepare_token_shards`] reuses shards whose
//!   manifest matches the folder and options, and tokenizes again otherwise; the manifest is
//!   removed before any shard is rewritten, so an interrupted run is never taken as complete.
//!
//! The whole stream is held in memory as u16 while it is cut (2 bytes a token: 1 GB for 500M
//! tokens); corpora larger than memory can be made into shards of the same format by llm.c's
//! scripts.

use std::io::Read;
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::token_shards::write_token_shard;
use super::tokenizer::Gpt2Tokenizer;
use crate::io::write_atomic;
use crate::{Error, Result};

/// The manifest's file name in a shard folder.
pub const MANIFEST: &str = "corpus.json";
const MANIFEST_VERSION: u32 = 1;

/// Which part of a corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenSplit {
    Train,
    Val,
}

impl TokenSplit {
    /// The shard name prefix: `train` or `val`.
    pub fn name(self) -> &'static str {
        match self {
            TokenSplit::Train => "train",
            TokenSplit::Val => "val",
        }
    }
}

impl std::fmt::Display for TokenSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a folder is cut into shards.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CorpusOptions {
    /// The fraction of tokens (the end of the stream) that go to val, in `[0, 1)`.
    pub val_fraction: f64,
    /// The most tokens per shard (llm.c's fineweb shards hold 100M).
    pub shard_tokens: usize,
}

impl Default for CorpusOptions {
    fn default() -> Self {
        CorpusOptions {
            val_fraction: 0.1,
            shard_tokens: 100_000_000,
        }
    }
}

impl CorpusOptions {
    fn check(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(Error::invalid_arg(
                "tokenize_dir",
                "val_fraction",
                self.val_fraction,
                "a fraction in [0, 1)",
            ));
        }
        if self.shard_tokens == 0 || self.shard_tokens > super::token_shards::SHARD_MAX_TOKENS {
            return Err(Error::invalid_arg(
                "tokenize_dir",
                "shard_tokens",
                self.shard_tokens,
                format!(
                    "1..={} tokens per shard",
                    super::token_shards::SHARD_MAX_TOKENS
                ),
            ));
        }
        Ok(())
    }
}

/// One source file as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// Relative to the folder, with `/` separators.
    pub path: String,
    pub bytes: u64,
    /// CRC-32 of the file's bytes as stored (compressed, for `.txt.gz`).
    pub crc32: u32,
}

/// What a folder became: the manifest's contents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CorpusManifest {
    pub version: u32,
    pub tokenizer: String,
    pub options: CorpusOptions,
    pub sources: Vec<SourceFile>,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// Shard file names (in the shard folder), in order.
    pub train_shards: Vec<String>,
    pub val_shards: Vec<String>,
}

impl CorpusManifest {
    /// The shard paths of `split` under `dir` (the folder the manifest is in).
    pub fn shard_paths(&self, dir: &Path, split: TokenSplit) -> Vec<PathBuf> {
        let names = match split {
            TokenSplit::Train => &self.train_shards,
            TokenSplit::Val => &self.val_shards,
        };
        names.iter().map(|n| dir.join(n)).collect()
    }
}

const TOKENIZER: &str = "gpt2 (r50k_base)";

/// The `.txt` / `.txt.gz` files under `dir`, by relative path (`/`-separated), sorted.
pub fn text_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> Result<()> {
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        for e in entries {
            let e = e.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let p = e.path();
            let ty = e
                .file_type()
                .map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
            // Follow links to files and folders alike (a corpus folder may link its parts).
            let is_dir = ty.is_dir() || (ty.is_symlink() && p.is_dir());
            if is_dir {
                walk(root, &p, out)?;
            } else if name.ends_with(".txt") || name.ends_with(".txt.gz") {
                let rel = p
                    .strip_prefix(root)
                    .unwrap_or(&p)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("/");
                out.push((rel, p));
            }
        }
        Ok(())
    }
    if !dir.is_dir() {
        return Err(Error::invalid_arg(
            "tokenize_dir",
            "dir",
            dir.display(),
            "a folder of .txt (or .txt.gz) files",
        ));
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// A file's bytes as stored.
fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// A document's text: the file's bytes, gunzipped for `.txt.gz`, as UTF-8.
fn document_text(path: &Path, stored: &[u8]) -> Result<String> {
    let bad = |detail: String| Error::DataFormat {
        path: path.display().to_string(),
        format: "text document",
        detail,
    };
    let bytes = if path.to_string_lossy().ends_with(".gz") {
        let mut out = Vec::new();
        MultiGzDecoder::new(stored)
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gzip: {e}")))?;
        out
    } else {
        stored.to_vec()
    };
    String::from_utf8(bytes).map_err(|e| {
        bad(format!(
            "not UTF-8 (invalid bytes at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Tokenizes every text file under `src` and writes train/val shards and the manifest to
/// `out` (created if needed), as the module doc says. A folder with no text files, or one
/// whose tokens do not make a train split, is an error.
pub fn tokenize_dir(src: &Path, out: &Path, opts: &CorpusOptions) -> Result<CorpusManifest> {
    opts.check()?;
    let files = text_files(src)?;
    if files.is_empty() {
        return Err(Error::invalid_arg(
            "tokenize_dir",
            "dir",
            src.display(),
            "a folder with at least one .txt or .txt.gz file",
        ));
    }
    let tok = Gpt2Tokenizer::new();
    let docs: Vec<(SourceFile, Vec<u32>)> = files
        .par_iter()
        .map(|(rel, path)| {
            let stored = read_file(path)?;
            let text = document_text(path, &stored)?;
            let source = SourceFile {
                path: rel.clone(),
                bytes: stored.len() as u64,
                crc32: crc32fast::hash(&stored),
            };
            Ok((source, tok.encode(&text)))
        })
        .collect::<Result<_>>()?;
    let total: usize = docs.iter().map(|(_, t)| t.len() + 1).sum();
    let mut stream: Vec<u16> = Vec::with_capacity(total);
    let mut sources = Vec::with_capacity(docs.len());
    for (source, ids) in docs {
        stream.push(Gpt2Tokenizer::EOT as u16);
        // GPT-2's ids are below 50257, so they fit u16.
        stream.extend(ids.into_iter().map(|t| t as u16));
        sources.push(source);
    }
    let val_tokens = (stream.len() as f64 * opts.val_fraction).floor() as usize;
    let train_tokens = stream.len() - val_tokens;
    let (train, val) = stream.split_at(train_tokens);

    std::fs::create_dir_all(out)
        .map_err(|e| Error::io(format!("creating {}", out.display()), e))?;
    let manifest_path = out.join(MANIFEST);
    match std::fs::remove_file(&manifest_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(Error::io(
                format!("removing {}", manifest_path.display()),
                e,
            ))
        }
        _ => {}
    }
    let train_shards = write_split(out, TokenSplit::Train, train, opts.shard_tokens)?;
    let val_shards = write_split(out, TokenSplit::Val, val, opts.shard_tokens)?;
    let manifest = CorpusManifest {
        version: MANIFEST_VERSION,
        tokenizer: TOKENIZER.to_string(),
        options: *opts,
        sources,
        train_tokens,
        val_tokens,
        train_shards,
        val_shards,
    };
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::io("encoding corpus.json", std::io::Error::other(e)))?;
    write_atomic(&manifest_path, |w| {
        w.write_all(&json)
            .map_err(|e| Error::io(format!("writing {}", manifest_path.display()), e))
    })?;
    Ok(manifest)
}

/// The shard file name of `split`'s `i`-th shard.
pub fn shard_name(split: TokenSplit, i: usize) -> String {
    format!("{}_{i:06}.bin", split.name())
}

/// Writes `tokens` as `split`'s shards and removes older shards of the split past them.
fn write_split(
    out: &Path,
    split: TokenSplit,
    tokens: &[u16],
    shard_tokens: usize,
) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for (i, chunk) in tokens.chunks(shard_tokens).enumerate() {
        let name = shard_name(split, i);
        write_token_shard(&out.join(&name), chunk)?;
        names.push(name);
    }
    for i in names.len().. {
        let stale = out.join(shard_name(split, i));
        match std::fs::remove_file(&stale) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => return Err(Error::io(format!("removing {}", stale.display()), e)),
        }
    }
    Ok(names)
}

/// The manifest in `dir`, or `None` when there is none or it cannot be parsed (then the
/// shards are made again).
pub fn read_manifest(dir: &Path) -> Option<CorpusManifest> {
    let bytes = std::fs::read(dir.join(MANIFEST)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The shards of `src` in `out`: reused when `out`'s manifest records the same files (paths,
/// sizes, CRC-32s), the same options and this tokenizer, and every shard it lists is there;
/// made by [`tokenize_dir`] otherwise. Returns the manifest and whether shards were reused.
pub fn prepare_token_shards(
    src: &Path,
    out: &Path,
    opts: &CorpusOptions,
) -> Result<(CorpusManifest, bool)> {
    opts.check()?;
    if let Some(m) = read_manifest(out) {
        let current = || -> Result<bool> {
            if m.version != MANIFEST_VERSION || m.tokenizer != TOKENIZER || m.options != *opts {
                return Ok(false);
            }
            let files = text_files(src)?;
            if files.len() != m.sources.len() {
                return Ok(false);
            }
            for ((rel, path), s) in files.iter().zip(&m.sources) {
                if *rel != s.path {
                    return Ok(false);
                }
                let stored = read_file(path)?;
                if stored.len() as u64 != s.bytes || crc32fast::hash(&stored) != s.crc32 {
                    return Ok(false);
                }
            }
            let all = m.train_shards.iter().chain(&m.val_shards);
            Ok(all.into_iter().all(|n| out.join(n).is_file()))
        };
        if current()? {
            return Ok((m, true));
        }
    }
    Ok((tokenize_dir(src, out, opts)?, false))
}

/// The folder of the corpus that ships with the crate: Shakespeare's plays as gzip'd text
/// (`data/shakespeare/`, see its README for the source and license).
pub fn bundled_corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare")
}
