//! GPT data: the GPT-2 tokenizer, token shards (format, validation), a folder tokenized into
//! train/val shards (and the bundled Shakespeare), and the window loader (order, ranks,
//! shuffle, resume).

use std::path::{Path, PathBuf};

use mixprec::data::token_corpus::{bundled_corpus_dir, read_manifest, shard_name, MANIFEST};
use mixprec::data::token_shards::{SHARD_HEADER_BYTES, SHARD_MAGIC};
use mixprec::data::{
    prepare_token_shards, tokenize_dir, write_token_shard, CorpusOptions, Gpt2Tokenizer,
    TokenLoader, TokenLoaderConfig, TokenLoaderState, TokenShard, TokenSplit,
};
use mixprec::{DType, Device, Error};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-gpt-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---- tokenizer ---------------------------------------------------------------------------------

#[test]
fn tokenizer_matches_gpt2_ids() {
    let tok = Gpt2Tokenizer::new();
    assert_eq!(tok.encode("Hello world"), vec![15496, 995]);
    assert_eq!(tok.decode(&[15496, 995]).unwrap(), "Hello world");
    assert_eq!(Gpt2Tokenizer::EOT, 50256);
    assert_eq!(Gpt2Tokenizer::VOCAB_SIZE, 50257);
    assert_eq!(tok.decode(&[Gpt2Tokenizer::EOT]).unwrap(), "<|endoftext|>");
    assert!(tok.encode("").is_empty());
}

#[test]
fn tokenizer_round_trips() {
    let tok = Gpt2Tokenizer::new();
    let texts = [
        "To be, or not to be: that is the question.",
        "héllo wörld — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어 🦀🎉👩‍👩‍👧",
        "  leading and trailing spaces   ",
        "\t\ttabs\n\n\nnewlines\r\n\r\ncrlf \u{a0}nbsp\u{2003}em-space\u{200b}zero-width",
        "\u{0}\u{1}\u{1f}\u{7f}\u{80}\u{9f} control characters, \u{fffd}, \u{10ffff}",
        "e\u{301} combining, \u{202e}rtl override\u{202c}, ﷽",
        "<|endoftext|> is plain text here",
        "1234567890 3.14159 -0.0 1e-9 0xdeadbeef",
    ];
    for s in texts {
        let ids = tok.encode(s);
        assert!(
            ids.iter()
                .all(|&i| (i as usize) < Gpt2Tokenizer::VOCAB_SIZE - 1),
            "{s:?}"
        );
        assert_eq!(tok.decode(&ids).unwrap(), s, "{s:?} -> {ids:?}");
        assert_eq!(tok.decode_bytes(&ids).unwrap(), s.as_bytes());
    }
    // The special token's text is never the special id.
    assert!(!tok.encode("<|endoftext|>").contains(&Gpt2Tokenizer::EOT));
}

#[test]
fn tokenizer_decodes_cut_characters() {
    let tok = Gpt2Tokenizer::new();
    let ids = tok.encode("🦀");
    assert!(
        ids.len() > 1,
        "the crab takes several byte-level ids: {ids:?}"
    );
    let first = tok.decode_bytes(&ids[..1]).unwrap();
    assert!(std::str::from_utf8(&first).is_err());
    assert!(tok.decode(&ids[..1]).unwrap().contains('\u{fffd}'));
    let mut joined = Vec::new();
    for i in &ids {
        joined.extend(tok.decode_bytes(&[*i]).unwrap());
    }
    assert_eq!(joined, "🦀".as_bytes());
}

#[test]
fn tokenizer_refuses_ids_out_of_range() {
    let tok = Gpt2Tokenizer::new();
    for bad in [50257u32, 50304, u32::MAX] {
        let e = tok.decode(&[15496, bad]).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{msg}");
        assert!(
            msg.contains(&bad.to_string()) && msg.contains("position 1"),
            "{msg}"
        );
        assert!(msg.contains("0..50257"), "{msg}");
    }
}

// ---- shards ------------------------------------------------------------------------------------

#[test]
fn shard_layout_is_llm_c_s() {
    let d = temp_dir("layout");
    let p = d.join("s.bin");
    let tokens: Vec<u16> = vec![0, 1, 50256, 65535, 7, 300];
    write_token_shard(&p, &tokens).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(bytes.len(), SHARD_HEADER_BYTES + 2 * tokens.len());
    let field = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!((field(0), field(1), field(2)), (20240520, 1, 6));
    assert!(bytes[12..1024].iter().all(|&b| b == 0));
    assert_eq!(&bytes[1024..1028], &[0, 0, 1, 0]);
    assert_eq!(&bytes[1028..1032], &[0x50, 0xc4, 0xff, 0xff]); // 50256 = 0xc450

    let s = TokenShard::open(&p).unwrap();
    assert_eq!(s.len(), 6);
    assert_eq!(s.to_vec(), tokens);
    assert_eq!(s.get(2), Some(50256));
    assert_eq!(s.get(6), None);
    let mut out = [0i64; 3];
    s.read_into(3, &mut out).unwrap();
    assert_eq!(out, [65535, 7, 300]);
    let e = s.read_into(4, &mut out).unwrap_err().to_string();
    assert!(e.contains("4..7") && e.contains("0..6"), "{e}");
    assert_eq!(s.first_out_of_vocab(50257), Some((3, 65535)));
    assert_eq!(s.first_out_of_vocab(65536), None);

    // An empty shard is valid.
    write_token_shard(&p, &[]).unwrap();
    assert!(TokenShard::open(&p).unwrap().is_empty());
}

#[test]
fn shard_header_errors_are_clear() {
    let d = temp_dir("errors");
    let good = d.join("good.bin");
    write_token_shard(&good, &[1, 2, 3, 4]).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let case = |name: &str, b: Vec<u8>, want: &[&str]| {
        let p = d.join(name);
        std::fs::write(&p, b).unwrap();
        let e = TokenShard::open(&p).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::DataFormat { .. }), "{name}: {msg}");
        assert!(msg.contains(name), "{name}: {msg}");
        for w in want {
            assert!(msg.contains(w), "{name}: `{w}` not in: {msg}");
        }
    };
    let mut b = bytes.clone();
    b[0] ^= 1;
    case("magic.bin", b, &["magic", &SHARD_MAGIC.to_string()]);
    let mut b = bytes.clone();
    b[4] = 2;
    case("v2.bin", b, &["version 2", "u32"]);
    let mut b = bytes.clone();
    b[4] = 7;
    case("v7.bin", b, &["version 7"]);
    case(
        "cut.bin",
        bytes[..bytes.len() - 1].to_vec(),
        &["truncated", "4 tokens", "1032 bytes", "1031 bytes"],
    );
    let mut b = bytes.clone();
    b.extend([0, 0]);
    case("long.bin", b, &["trailing bytes", "1034 bytes"]);
    case("tiny.bin", bytes[..100].to_vec(), &["100 bytes", "header"]);
    let mut b = bytes.clone();
    b[8..12].copy_from_slice(&(-5i32).to_le_bytes());
    case("negative.bin", b, &["negative"]);
    let missing = TokenShard::open(&d.join("absent.bin")).unwrap_err();
    assert!(matches!(missing, Error::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("absent.bin"));
}

// ---- corpus folders ----------------------------------------------------------------------------

/// A folder of small documents: two plain, one gzip'd, one nested, one hidden, one not text.
fn small_corpus(name: &str) -> (PathBuf, Vec<&'static str>) {
    let d = temp_dir(name).join("src");
    std::fs::create_dir_all(d.join("sub")).unwrap();
    let docs = [
        "First document. It is short.\n",
        "Second: with ünïcödé and\nnew lines.\n",
        "Third, gzip'd.",
        "Fourth, in a sub-folder.",
    ];
    std::fs::write(d.join("a.txt"), docs[0]).unwrap();
    std::fs::write(d.join("b.txt"), docs[1]).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, docs[2].as_bytes()).unwrap();
    std::fs::write(d.join("c.txt.gz"), gz.finish().unwrap()).unwrap();
    std::fs::write(d.join("sub/d.txt"), docs[3]).unwrap();
    std::fs::write(d.join(".hidden.txt"), "skipped").unwrap();
    std::fs::write(d.join("notes.md"), "skipped").unwrap();
    (d, docs.to_vec())
}

fn read_split(
    out: &Path,
    m: &mixprec::data::token_corpus::CorpusManifest,
    s: TokenSplit,
) -> Vec<u16> {
    m.shard_paths(out, s)
        .iter()
        .flat_map(|p| TokenShard::open(p).unwrap().to_vec())
        .collect()
}

#[test]
fn corpus_documents_split_and_shards() {
    let (src, docs) = small_corpus("corpus");
    let out = src.parent().unwrap().join("shards");
    let opts = CorpusOptions {
        val_fraction: 0.25,
        shard_tokens: 7,
    };
    let m = tokenize_dir(&src, &out, &opts).unwrap();
    let tok = Gpt2Tokenizer::new();
    let mut stream: Vec<u16> = Vec::new();
    for d in &docs {
        stream.push(50256);
        stream.extend(tok.encode(d).iter().map(|&t| t as u16));
    }
    let names: Vec<_> = m.sources.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(names, ["a.txt", "b.txt", "c.txt.gz", "sub/d.txt"]);
    let val = stream.len() / 4;
    assert_eq!((m.train_tokens, m.val_tokens), (stream.len() - val, val));
    let train = read_split(&out, &m, TokenSplit::Train);
    let valt = read_split(&out, &m, TokenSplit::Val);
    assert_eq!([train.clone(), valt].concat(), stream);
    assert_eq!(m.train_shards.len(), train.len().div_ceil(7));
    assert_eq!(m.train_shards[0], "train_000000.bin");
    for p in m.shard_paths(&out, TokenSplit::Train) {
        assert!(TokenShard::open(&p).unwrap().len() <= 7);
    }
    let text = tok
        .decode(&train.iter().map(|&t| t as u32).collect::<Vec<_>>())
        .unwrap();
    assert!(text.starts_with("<|endoftext|>First document."), "{text}");
    assert!(text.contains("<|endoftext|>Second: with ünïcödé"), "{text}");

    // Same folder and options: reused. Another split: remade, and the extra shards removed.
    let (again, reused) = prepare_token_shards(&src, &out, &opts).unwrap();
    assert!(reused);
    assert_eq!(again, m);
    let bigger = CorpusOptions {
        val_fraction: 0.25,
        shard_tokens: 1000,
    };
    let (m2, reused) = prepare_token_shards(&src, &out, &bigger).unwrap();
    assert!(!reused);
    assert_eq!(m2.train_shards, ["train_000000.bin"]);
    assert!(!out.join(shard_name(TokenSplit::Train, 1)).exists());
    // A changed document: remade.
    std::fs::write(src.join("a.txt"), "Changed.").unwrap();
    let (m3, reused) = prepare_token_shards(&src, &out, &bigger).unwrap();
    assert!(!reused);
    assert!(m3.train_tokens < m2.train_tokens);
    assert_eq!(read_manifest(&out).unwrap(), m3);
}

#[test]
fn corpus_errors_are_clear() {
    let d = temp_dir("corpus-errors");
    let opts = CorpusOptions::default();
    let e = tokenize_dir(&d, &d.join("out"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains(".txt"), "{e}");
    let e = tokenize_dir(&d.join("absent"), &d.join("out"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent"), "{e}");
    std::fs::write(d.join("bad.txt"), b"ok \xff\xfe bad").unwrap();
    let e = tokenize_dir(&d, &d.join("out"), &opts).unwrap_err();
    assert!(matches!(e, Error::DataFormat { .. }), "{e}");
    assert!(
        e.to_string().contains("bad.txt") && e.to_string().contains("UTF-8"),
        "{e}"
    );
    std::fs::remove_file(d.join("bad.txt")).unwrap();
    std::fs::write(d.join("bad.txt.gz"), b"not gzip").unwrap();
    let e = tokenize_dir(&d, &d.join("out"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.txt.gz") && e.contains("gzip"), "{e}");
    for bad in [1.0, -0.1, f64::NAN] {
        let o = CorpusOptions {
            val_fraction: bad,
            ..opts
        };
        let e = tokenize_dir(&d, &d.join("out"), &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("val_fraction"), "{e}");
    }
    let o = CorpusOptions {
        shard_tokens: 0,
        ..opts
    };
    let e = tokenize_dir(&d, &d.join("out"), &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shard_tokens"), "{e}");
}

#[test]
fn bundled_shakespeare_tokenizes() {
    let src = bundled_corpus_dir();
    let out = temp_dir("shakespeare");
    let m = tokenize_dir(&src, &out, &CorpusOptions::default()).unwrap();
    assert_eq!(m.sources.len(), 38);
    assert!(m.sources.iter().any(|s| s.path == "hamlet.txt.gz"));
    let total = m.train_tokens + m.val_tokens;
    assert!((1_000_000..2_000_000).contains(&total), "{total} tokens");
    assert_eq!(m.val_tokens, total / 10);
    assert!(out.join(MANIFEST).is_file());
    let mut loader =
        TokenLoader::open(&out, TokenSplit::Val, TokenLoaderConfig::new(4, 64)).unwrap();
    let (x, _) = loader.next_batch(Device::Cpu).unwrap();
    let ids: Vec<u32> = x
        .to_vec::<i64>()
        .unwrap()
        .iter()
        .map(|&t| t as u32)
        .collect();
    let text = Gpt2Tokenizer::new().decode(&ids).unwrap();
    assert!(
        text.chars().filter(|c| c.is_alphabetic()).count() > 100,
        "{text}"
    );
}

// ---- loader ------------------------------------------------------------------------------------

/// Shards of consecutive token values (token i is i mod 50000), so a window's first token says
/// where it starts.
fn counting_shards(name: &str, lens: &[usize]) -> PathBuf {
    let d = temp_dir(name);
    let mut next = 0usize;
    for (i, &n) in lens.iter().enumerate() {
        let t: Vec<u16> = (next..next + n).map(|v| (v % 50000) as u16).collect();
        next += n;
        write_token_shard(&d.join(shard_name(TokenSplit::Train, i)), &t).unwrap();
    }
    d
}

fn rows(x: &mixprec::Tensor) -> Vec<Vec<i64>> {
    let t = x.dims()[1];
    x.to_vec::<i64>()
        .unwrap()
        .chunks(t)
        .map(|r| r.to_vec())
        .collect()
}

#[test]
fn loader_sequential_matches_llm_c() {
    // 2 shards: 33 tokens (4 windows of T+1 = 9 at T = 8) and 20 (2 windows).
    let d = counting_shards("seq", &[33, 20]);
    let cfg = TokenLoaderConfig::new(2, 8);
    let mut l = TokenLoader::open(&d, TokenSplit::Train, cfg).unwrap();
    assert_eq!(l.windows(), 6);
    assert_eq!(l.batches_per_epoch(), 3);
    let (x, y) = l.next_batch(Device::Cpu).unwrap();
    assert_eq!(x.dtype(), DType::I64);
    assert_eq!(x.dims(), &[2, 8]);
    assert_eq!(y.dims(), &[2, 8]);
    // llm.c: B*T+1 consecutive tokens, x = buf[:-1], y = buf[1:].
    let buf: Vec<i64> = (0..17).collect();
    assert_eq!(x.to_vec::<i64>().unwrap(), buf[..16]);
    assert_eq!(y.to_vec::<i64>().unwrap(), buf[1..]);
    let (x, _) = l.next_batch(Device::Cpu).unwrap();
    assert_eq!(rows(&x)[0][0], 16);
    assert_eq!(rows(&x)[1][0], 24);
    // The third batch: shard 1's windows (shard 0's last token, 32, is never a window start).
    let (x, y) = l.next_batch(Device::Cpu).unwrap();
    assert_eq!(rows(&x)[0][0], 33);
    assert_eq!(rows(&y)[1], (42..50).collect::<Vec<i64>>());
    assert_eq!(l.state(), TokenLoaderState { epoch: 1, batch: 0 });
    let (x, _) = l.next_batch(Device::Cpu).unwrap();
    assert_eq!(rows(&x)[0][0], 0);
}

#[test]
fn loader_ranks_are_disjoint_and_cover_the_epoch() {
    let d = counting_shards("ranks", &[8 * 50 + 1, 8 * 31 + 1]);
    for shuffle in [None, Some(7u64)] {
        let world = 3;
        let mut seen = Vec::new();
        let mut per_rank = Vec::new();
        for rank in 0..world {
            let mut cfg = TokenLoaderConfig::new(4, 8).ranks(rank, world);
            cfg.shuffle_seed = shuffle;
            let mut l = TokenLoader::open(&d, TokenSplit::Train, cfg).unwrap();
            assert_eq!(l.windows(), 81);
            assert_eq!(l.batches_per_epoch(), 81 / 4 / 3);
            per_rank.push(l.batches_per_epoch());
            for b in 0..l.batches_per_epoch() {
                let (x, y) = l.next_batch(Device::Cpu).unwrap();
                for (rx, ry) in rows(&x).iter().zip(rows(&y)) {
                    assert_eq!(&rx[1..], &ry[..7]);
                    seen.push(rx[0]);
                }
                let global = b * world + rank;
                if shuffle.is_none() && (global + 1) * 4 <= 50 {
                    // Within shard 0, as llm.c: rank r's batch b starts (b·world + r)·B·T in.
                    assert_eq!(rows(&x)[0][0], (global * 4 * 8) as i64);
                }
            }
        }
        let n = seen.len();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), n, "a window served twice ({shuffle:?})");
        assert_eq!(n, 6 * 4 * 3);
        assert!(seen.iter().all(|s| s % 8 == 0 || (s - 401) % 8 == 0));
    }
}

#[test]
fn loader_shuffle_is_seeded_per_epoch() {
    let d = counting_shards("shuffle", &[8 * 64 + 1]);
    let open = |seed| {
        TokenLoader::open(
            &d,
            TokenSplit::Train,
            TokenLoaderConfig::new(2, 8).shuffle(seed),
        )
        .unwrap()
    };
    let a = open(1);
    assert_eq!(a.epoch_order(0), open(1).epoch_order(0));
    assert_ne!(a.epoch_order(0), open(2).epoch_order(0));
    assert_ne!(a.epoch_order(0), a.epoch_order(1));
    let mut o = a.epoch_order(3);
    assert_ne!(o, (0..64).collect::<Vec<_>>());
    o.sort();
    assert_eq!(o, (0..64).collect::<Vec<_>>());
}

#[test]
fn loader_resumes_exactly() {
    let d = counting_shards("resume", &[8 * 20 + 1, 8 * 9 + 1]);
    let cfg = TokenLoaderConfig::new(3, 8).shuffle(11).ranks(1, 2);
    let mut a = TokenLoader::open(&d, TokenSplit::Train, cfg).unwrap();
    let per = a.batches_per_epoch();
    assert_eq!(per, 29 / 3 / 2);
    let mut saved = None;
    let mut after = Vec::new();
    for step in 0..3 * per {
        if step == per + 1 {
            saved = Some(serde_json::to_string(&a.state()).unwrap());
        }
        let (x, y) = a.next_batch(Device::Cpu).unwrap();
        if saved.is_some() {
            after.push((x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap()));
        }
    }
    let state: TokenLoaderState = serde_json::from_str(&saved.unwrap()).unwrap();
    assert_eq!(state, TokenLoaderState { epoch: 1, batch: 1 });
    let mut b = TokenLoader::open(&d, TokenSplit::Train, cfg).unwrap();
    b.set_state(state).unwrap();
    for (x0, y0) in after {
        let (x, y) = b.next_batch(Device::Cpu).unwrap();
        assert_eq!(x.to_vec::<i64>().unwrap(), x0);
        assert_eq!(y.to_vec::<i64>().unwrap(), y0);
    }
    let e = b
        .set_state(TokenLoaderState {
            epoch: 0,
            batch: per as u64,
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("batches per epoch"), "{e}");
    b.reset();
    assert_eq!(b.state(), TokenLoaderState::default());
}

#[test]
fn loader_errors_are_clear() {
    let d = counting_shards("loader-errors", &[100]);
    let open = |cfg| TokenLoader::open(&d, TokenSplit::Train, cfg);
    let e = open(TokenLoaderConfig::new(0, 8)).unwrap_err().to_string();
    assert!(e.contains("batch_size"), "{e}");
    let e = open(TokenLoaderConfig::new(1, 0)).unwrap_err().to_string();
    assert!(e.contains("seq_len"), "{e}");
    let e = open(TokenLoaderConfig::new(1, 8).ranks(2, 2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 of 2"), "{e}");
    // 100 tokens hold 12 windows at T = 8: 4 ranks x 4 windows is too many.
    let e = open(TokenLoaderConfig::new(4, 8).ranks(0, 4))
        .unwrap_err()
        .to_string();
    assert!(e.contains("12 window") && e.contains("100 token"), "{e}");
    let e = open(TokenLoaderConfig::new(1, 8).vocab_size(50)).unwrap_err();
    assert!(matches!(e, Error::DataFormat { .. }), "{e}");
    assert!(e.to_string().contains("token 50 at position 50"), "{e}");
    let e = TokenLoader::open(&d, TokenSplit::Val, TokenLoaderConfig::new(1, 8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("val"), "{e}");
}

#[test]
fn loader_finds_llm_c_shard_names() {
    // llm.c's folders: `tinyshakespeare_val.bin`, `fineweb_train_000001.bin`, no manifest.
    let d = temp_dir("llm-c-names");
    write_token_shard(&d.join("tinyshakespeare_val.bin"), &[1; 17]).unwrap();
    write_token_shard(&d.join("fineweb_train_000002.bin"), &[3; 17]).unwrap();
    write_token_shard(&d.join("fineweb_train_000001.bin"), &[2; 9]).unwrap();
    write_token_shard(&d.join("other.bin"), &[4; 17]).unwrap();
    let cfg = TokenLoaderConfig::new(1, 8);
    let val = TokenLoader::open(&d, TokenSplit::Val, cfg).unwrap();
    assert_eq!(val.shards().len(), 1);
    let mut train = TokenLoader::open(&d, TokenSplit::Train, cfg).unwrap();
    let names: Vec<_> = train
        .shards()
        .iter()
        .map(|s| s.path().file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    );
    assert_eq!(train.windows(), 1 + 2);
    let (x, _) = train.next_batch(Device::Cpu).unwrap();
    assert_eq!(x.to_vec::<i64>().unwrap(), vec![2; 8]);
}
