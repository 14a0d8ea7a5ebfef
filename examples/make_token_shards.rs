//! Tokenizes a folder of `.txt` / `.txt.gz` files with GPT-2's tokenizer into train and val
//! token shards (llm.c's format; see `mixprec::data::token_shards`), or reuses the shards when
//! the folder has not changed, then prints what it made and the start of the first val batch.
//!
//!     cargo run --release --example make_token_shards [SOURCE_DIR] [OUT_DIR] [VAL_FRACTION]
//!
//! SOURCE_DIR defaults to the bundled Shakespeare (`data/shakespeare`), OUT_DIR to
//! `target/token-shards/shakespeare`, VAL_FRACTION to 0.1 (the last tenth of the tokens).

use std::path::PathBuf;
use std::time::Instant;

use mixprec::data::token_corpus::bundled_corpus_dir;
use mixprec::data::{
    prepare_token_shards, CorpusOptions, Gpt2Tokenizer, TokenLoader, TokenLoaderConfig, TokenSplit,
};
use mixprec::{Device, Error};

fn main() -> mixprec::Result<()> {
    let mut args = std::env::args().skip(1);
    let src = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(bundled_corpus_dir);
    let out = args.next().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/token-shards/shakespeare"
        ))
    });
    let mut opts = CorpusOptions::default();
    if let Some(f) = args.next() {
        opts.val_fraction = f.parse().map_err(|_| {
            Error::invalid_arg("make_token_shards", "VAL_FRACTION", f, "a number in [0, 1)")
        })?;
    }
    let start = Instant::now();
    let (m, reused) = prepare_token_shards(&src, &out, &opts)?;
    println!(
        "{} {} documents from {}: {} train tokens in {} shard(s), {} val tokens in {} shard(s), \
         in {} ({:.1} s)",
        if reused { "reused" } else { "tokenized" },
        m.sources.len(),
        src.display(),
        m.train_tokens,
        m.train_shards.len(),
        m.val_tokens,
        m.val_shards.len(),
        out.display(),
        start.elapsed().as_secs_f64()
    );
    if m.val_tokens > 65 {
        let mut val = TokenLoader::open(&out, TokenSplit::Val, TokenLoaderConfig::new(1, 64))?;
        let (x, _) = val.next_batch(Device::Cpu)?;
        let ids: Vec<u32> = x.to_vec::<i64>()?.iter().map(|&t| t as u32).collect();
        println!("val starts: {:?}", Gpt2Tokenizer::new().decode(&ids)?);
    }
    Ok(())
}
