//! GPT-2's tokenizer: byte-level BPE over the `r50k_base` ranks (what OpenAI's GPT-2 and
//! Hugging Face's `GPT2Tokenizer` use), through the `tiktoken-rs` crate, which compiles the
//! ranks into the binary: nothing is downloaded at run time.
//!
//! Ids are `u32` in `0..50257`; 50256 is `<|endoftext|>` ([`Gpt2Tokenizer::EOT`]), the
//! separator between documents. [`Gpt2Tokenizer::encode`] treats text literally (the string
//! `<|endoftext|>` inside a document is encoded as ordinary text, never as the special id), so
//! a corpus cannot forge document boundaries.

use tiktoken_rs::CoreBPE;

use crate::{Error, Result};

/// GPT-2's byte-level BPE. Cheap to create and to clone (the ranks are parsed once per
/// process and shared); usable from several threads at once.
#[derive(Clone, Copy)]
pub struct Gpt2Tokenizer {
    bpe: &'static CoreBPE,
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Tokenizer(r50k_base)")
    }
}

impl Default for Gpt2Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Gpt2Tokenizer {
    /// `<|endoftext|>`: separates documents (and ends generated text).
    pub const EOT: u32 = 50256;
    /// The number of ids, `EOT` included. A model may pad its embedding beyond this (to a
    /// multiple of 64: 50304); those rows never appear in data.
    pub const VOCAB_SIZE: usize = 50257;

    pub fn new() -> Gpt2Tokenizer {
        Gpt2Tokenizer {
            bpe: tiktoken_rs::r50k_base_singleton(),
        }
    }

    /// The ids of `text`, taken literally (no special tokens are recognised).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The bytes that `ids` stand for. Any id sequence has one; it need not be UTF-8 (a
    /// character's bytes may be split between ids, as when text is cut at a window's end).
    /// An id outside `0..50257` is an [`Error::InvalidArgument`] naming it and its position.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some((at, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= Self::VOCAB_SIZE)
        {
            return Err(Error::invalid_arg(
                "Gpt2Tokenizer::decode",
                "id",
                format!("{id} (at position {at} of {})", ids.len()),
                format!("ids in 0..{} (GPT-2's vocabulary)", Self::VOCAB_SIZE),
            ));
        }
        self.bpe.decode_bytes(ids).map_err(|e| {
            Error::invalid_arg(
                "Gpt2Tokenizer::decode",
                "id",
                e.token,
                "an id the r50k_base ranks define",
            )
        })
    }

    /// The text that `ids` stand for; bytes that are not valid UTF-8 (a character cut between
    /// ids) become U+FFFD, as `transformers`' `decode` does (`errors="replace"`). For an exact
    /// round trip of such sequences use [`decode_bytes`](Self::decode_bytes).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}
