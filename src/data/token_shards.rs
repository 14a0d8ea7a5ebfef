//! Token shards: one binary file of token ids, llm.c's layout, so shards made by llm.c's data
//! scripts (`dev/data/*.py`: tinyshakespeare, fineweb, ...) are read as they are and ours are
//! read by them.
//!
//! ```text
//! offset  size            content (all little-endian)
//! 0       4               magic   i32 = 20240520
//! 4       4               version i32 = 1 (u16 tokens)
//! 8       4               count   i32 = the number of tokens, 0..=2^31-1
//! 12      1012            reserved: zero when written, ignored when read
//! 1024    2 * count       the tokens, u16 each
//! ```
//!
//! The file is exactly `1024 + 2 * count` bytes; anything else is an error (a truncated copy,
//! a file with trailing bytes). Version 2 (llm.c's u32 tokens, for vocabularies past 65536) is
//! refused with an error that says so. In numpy:
//! `np.memmap(path, dtype="<u2", mode="r", offset=1024)`.
//!
//! [`TokenShard::open`] maps the file (memmap2) instead of reading it: a 100M-token shard costs
//! no memory up front, and the pages a loader touches are cached by the kernel. Shards are
//! written by [`write_token_shard`] atomically (temp file + rename), so a mapped shard is never
//! rewritten underneath a reader: a new write replaces the directory entry, and the old mapping
//! keeps the old file.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::io::write_atomic;
use crate::{Error, Result};

/// The first header field of every shard.
pub const SHARD_MAGIC: i32 = 20240520;
/// The header version of u16 tokens.
pub const SHARD_VERSION: i32 = 1;
/// Header size in bytes (256 little-endian i32).
pub const SHARD_HEADER_BYTES: usize = 1024;
/// The most tokens one shard holds (the count is an i32).
pub const SHARD_MAX_TOKENS: usize = i32::MAX as usize;

const FORMAT: &str = "token shard";

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format: FORMAT,
        detail: detail.into(),
    }
}

/// The 1024-byte header of a shard of `count` tokens.
fn header(count: usize) -> [u8; SHARD_HEADER_BYTES] {
    let mut h = [0u8; SHARD_HEADER_BYTES];
    h[0..4].copy_from_slice(&SHARD_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&SHARD_VERSION.to_le_bytes());
    h[8..12].copy_from_slice(&(count as i32).to_le_bytes());
    h
}

/// Writes `tokens` as a shard at `path`, atomically (an existing file is replaced only once the
/// new one is complete and synced). More than [`SHARD_MAX_TOKENS`] tokens is an error.
pub fn write_token_shard(path: &Path, tokens: &[u16]) -> Result<()> {
    if tokens.len() > SHARD_MAX_TOKENS {
        return Err(Error::invalid_arg(
            "write_token_shard",
            "tokens",
            format!("{} tokens", tokens.len()),
            format!("at most {SHARD_MAX_TOKENS} tokens per shard (the count is an i32)"),
        ));
    }
    write_atomic(path, |w: &mut dyn Write| {
        let ctx = || format!("writing token shard {}", path.display());
        w.write_all(&header(tokens.len()))
            .map_err(|e| Error::io(ctx(), e))?;
        let mut block = Vec::with_capacity(1 << 16);
        for chunk in tokens.chunks(1 << 15) {
            block.clear();
            block.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            w.write_all(&block).map_err(|e| Error::io(ctx(), e))?;
        }
        Ok(())
    })
}

/// One shard, mapped read-only; tokens are read from the mapping on demand, never copied as a
/// whole.
#[derive(Debug)]
pub struct TokenShard {
    path: PathBuf,
    map: Mmap,
    len: usize,
}

impl TokenShard {
    /// Maps `path` and checks its header: the magic, the version and that the file's size is
    /// exactly the header's count of tokens. Each failure is an [`Error::DataFormat`] that
    /// names the file and what was found.
    pub fn open(path: &Path) -> Result<TokenShard> {
        let file = File::open(path)
            .map_err(|e| Error::io(format!("opening token shard {}", path.display()), e))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io(format!("reading the size of {}", path.display()), e))?
            .len();
        if size < SHARD_HEADER_BYTES as u64 {
            return Err(bad(
                path,
                format!("{size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header"),
            ));
        }
        // SAFETY: the mapping is read-only and shards are only ever replaced by rename (see
        // the module doc), never written in place, so the bytes do not change while mapped.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::io(format!("mapping token shard {}", path.display()), e))?;
        let field = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
        let (magic, version, count) = (field(0), field(1), field(2));
        if magic != SHARD_MAGIC {
            return Err(bad(
                path,
                format!(
                    "magic {magic} (bytes {:02x?}), expected {SHARD_MAGIC}: not a token shard",
                    &map[0..4]
                ),
            ));
        }
        if version != SHARD_VERSION {
            let what = if version == 2 {
                " (u32 tokens, llm.c's layout for large vocabularies; GPT-2's fits u16: \
                 write version 1)"
            } else {
                ""
            };
            return Err(bad(
                path,
                format!("version {version}{what}; this reader takes version {SHARD_VERSION}"),
            ));
        }
        if count < 0 {
            return Err(bad(path, format!("negative token count {count}")));
        }
        let expected = SHARD_HEADER_BYTES as u64 + 2 * count as u64;
        if size != expected {
            let how = if size < expected {
                "truncated"
            } else {
                "trailing bytes"
            };
            return Err(bad(
                path,
                format!(
                    "{how}: the header says {count} tokens ({expected} bytes), the file has \
                     {size} bytes"
                ),
            ));
        }
        Ok(TokenShard {
            path: path.to_path_buf(),
            map,
            len: count as usize,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The token data: `2 * len()` little-endian bytes.
    pub fn token_bytes(&self) -> &[u8] {
        &self.map[SHARD_HEADER_BYTES..]
    }

    /// Token `i`; `None` past the end.
    pub fn get(&self, i: usize) -> Option<u16> {
        let b = self.token_bytes().get(2 * i..2 * i + 2)?;
        Some(u16::from_le_bytes([b[0], b[1]]))
    }

    /// Tokens `start..start + out.len()` into `out` (as `i64`, the dtype embeddings take). A
    /// range past the end is an [`Error::InvalidArgument`].
    pub fn read_into(&self, start: usize, out: &mut [i64]) -> Result<()> {
        let end = start.checked_add(out.len()).filter(|&e| e <= self.len);
        let Some(end) = end else {
            return Err(Error::invalid_arg(
                "TokenShard::read_into",
                "range",
                format!("{start}..{}", start.saturating_add(out.len())),
                format!("a range within 0..{} ({})", self.len, self.path.display()),
            ));
        };
        let bytes = &self.token_bytes()[2 * start..2 * end];
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u16::from_le_bytes([b[0], b[1]]) as i64;
        }
        Ok(())
    }

    /// All tokens, copied (for tests and small shards).
    pub fn to_vec(&self) -> Vec<u16> {
        self.token_bytes()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// The first token `>= vocab_size` and its position, if any: ids an embedding of
    /// `vocab_size` rows cannot look up. Reads the whole shard once.
    pub fn first_out_of_vocab(&self, vocab_size: usize) -> Option<(usize, u16)> {
        self.token_bytes()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .enumerate()
            .find(|&(_, t)| t as usize >= vocab_size)
    }
}
