//! The README runs as written: every Rust snippet in it is a piece of an example (which
//! `cargo test --all-targets` compiles), every `--flag` it names is one the command it belongs to
//! takes, every file it names exists, and nothing in the docs points outside the repository.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The user-facing documents: README.md and docs/*.md.
fn documents() -> Vec<(String, String)> {
    let mut docs = vec![("README.md".to_string(), read("README.md"))];
    let mut names: Vec<String> = fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".md"))
        .collect();
    names.sort();
    for n in names {
        let rel = format!("docs/{n}");
        let text = read(&rel);
        docs.push((rel, text));
    }
    docs
}

/// The fenced code blocks of a Markdown text whose info string is `lang`: (first line number,
/// lines).
fn code_blocks(text: &str, lang: &str) -> Vec<(usize, Vec<String>)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, Vec<String>)> = None;
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match (&mut current, fence) {
            (None, true) => {
                let info = line.trim_start().trim_start_matches('`').trim();
                current = Some((i + 2, Vec::new()));
                if info != lang {
                    current.as_mut().unwrap().0 = 0; // a block of another language: skipped
                }
            }
            (Some(_), true) => {
                let (start, lines) = current.take().unwrap();
                if start > 0 {
                    blocks.push((start, lines));
                }
            }
            (Some((_, lines)), false) => lines.push(line.to_string()),
            (None, false) => {}
        }
    }
    assert!(current.is_none(), "an unclosed code block");
    blocks
}

/// Lines without their indentation or trailing spaces, blank lines dropped.
fn normalised<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    lines
        .into_iter()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn every_rust_snippet_of_the_readme_is_in_an_example() {
    let examples: Vec<(PathBuf, String)> = fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .map(|p| {
            let text = fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect();
    let readme = read("README.md");
    let blocks = code_blocks(&readme, "rust");
    assert!(!blocks.is_empty(), "README.md has no ```rust block");
    for (line, block) in blocks {
        let want = normalised(block.iter().map(String::as_str));
        let found = examples.iter().any(|(_, text)| {
            let have = normalised(text.lines());
            have.windows(want.len()).any(|w| w == want.as_slice())
        });
        assert!(
            found,
            "README.md:{line}: this ```rust block is not a piece of any examples/*.rs (keep it \
             identical, indentation aside, to the example it comes from, which CI compiles)"
        );
    }
}

/// Every `--flag` token of a text (a word that starts with two dashes and a letter).
fn flags(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i + 2 < bytes.len() {
        let starts = bytes[i] == b'-'
            && bytes[i + 1] == b'-'
            && bytes[i + 2].is_ascii_lowercase()
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'-'));
        if starts {
            let mut j = i + 2;
            while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == b'-') {
                j += 1;
            }
            out.insert(text[i..j].to_string());
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The long flags of a job (`examples/train_resnet.rs`, `examples/train_gpt.rs`): its `Cli`
/// struct's fields after `#[arg(long ...)]`, with clap's naming (`batch_size` →
/// `--batch-size`), and clap's own.
/// Whether a line of a clap struct declares a field (`name: Type,`), not an attribute, its
/// continuation lines or a doc comment.
fn is_field(line: &str) -> bool {
    line.split_once(':').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
    })
}

fn job_flags(example: &str) -> BTreeSet<String> {
    let src = read(example);
    let mut out: BTreeSet<String> = ["--help", "--version"].map(String::from).into();
    let mut lines = src.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("#[arg(long") {
            let field = lines
                .by_ref()
                .map(str::trim)
                .find(|l| is_field(l))
                .expect("a field after #[arg(long)]");
            let name = field.split(':').next().unwrap().trim();
            out.insert(format!("--{}", name.replace('_', "-")));
        }
    }
    assert!(out.contains("--batch-size"), "{example}'s flags not found");
    out
}

/// The flags `scripts/gpu-stage` takes (its `case` arms).
fn gpu_stage_flags() -> BTreeSet<String> {
    let src = read("scripts/gpu-stage");
    src.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("--") && l.contains(')'))
        .flat_map(|l| {
            l[..l.find(')').unwrap()]
                .split('|')
                .map(|f| f.trim().to_string())
                .collect::<Vec<_>>()
        })
        .filter(|f| f.starts_with("--"))
        .collect()
}

/// Flags of other programs the README shows, by program.
const OTHER_PROGRAMS: &[(&str, &[&str])] = &[
    (
        "cargo",
        &["--release", "--example", "--all-targets", "--test", "--doc"],
    ),
    (
        "torchrun",
        &[
            "--standalone",
            "--nproc-per-node",
            "--no-python",
            "--nnodes",
            "--node-rank",
        ],
    ),
    ("srun", &["--nodes", "--ntasks-per-node", "--gpus-per-task"]),
    (
        "examples/torchvision_logits.rs",
        &["--weights", "--io", "--arch", "--device"],
    ),
];

#[test]
fn every_flag_in_the_readme_is_a_real_one() {
    let mut known = job_flags("examples/train_resnet.rs");
    known.extend(job_flags("examples/train_gpt.rs"));
    known.extend(gpu_stage_flags());
    for (_, fs) in OTHER_PROGRAMS {
        known.extend(fs.iter().map(|f| f.to_string()));
    }
    let logits = read("examples/torchvision_logits.rs");
    for f in ["--weights", "--io", "--arch"] {
        assert!(
            logits.contains(&format!("\"{f}\"")),
            "torchvision_logits lost {f}"
        );
    }
    let unknown: Vec<String> = flags(&read("README.md"))
        .into_iter()
        .filter(|f| !known.contains(f))
        .collect();
    assert!(
        unknown.is_empty(),
        "README.md names flags that neither train_resnet, train_gpt, scripts/gpu-stage nor the listed \
         programs take: {unknown:?}"
    );
}

/// Repository paths a document names in backticks or links (`configs/O2.toml`, `docs/gpu.md`).
fn repo_paths(text: &str) -> BTreeSet<String> {
    const TOP: &[&str] = &[
        "configs/",
        "benches/",
        "scripts/",
        "examples/",
        "docs/",
        "tests/",
        "data/",
        "kernels/",
        "src/",
    ];
    let mut out = BTreeSet::new();
    for piece in text.split(['`', '(', ')', ' ', '\n', '"']) {
        let p = piece.trim_end_matches(['.', ',', ':', ';']);
        let p = p.split('#').next().unwrap();
        // A `:` marks a place in a file inside an error message (`configs/my.toml:2:12`), a
        // user's file rather than the repository's.
        if TOP.iter().any(|t| p.starts_with(t))
            && !p.contains(['*', '<', '…', '{', ':'])
            && !p.contains("NAME")
            && !p.contains("DIR")
        {
            out.insert(p.to_string());
        }
    }
    out
}

#[test]
fn every_file_the_docs_name_exists() {
    for (doc, text) in documents() {
        let base = Path::new(&doc).parent().unwrap();
        for p in repo_paths(&text) {
            let at_root = root().join(&p);
            let relative = root().join(base).join(&p);
            assert!(
                at_root.exists() || relative.exists(),
                "{doc} names `{p}`, which is not in the repository"
            );
        }
        // Markdown links to files: [text](path) relative to the document.
        for link in text.split("](").skip(1) {
            let target = link.split(')').next().unwrap().split('#').next().unwrap();
            if target.is_empty() || target.contains("://") {
                continue;
            }
            assert!(
                root().join(base).join(target).exists(),
                "{doc} links to `{target}`, which does not exist"
            );
        }
    }
}

#[test]
fn nothing_points_outside_the_repository() {
    let mut files = documents();
    for rel in ["scripts/gpu-stage", "benches/RESULTS.md", "ARCHITECTURE.md"] {
        files.push((rel.to_string(), read(rel)));
    }
    for entry in fs::read_dir(root().join("benches")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|x| x == "sh" || x == "py") {
            let rel = format!("benches/{}", p.file_name().unwrap().to_string_lossy());
            files.push((rel.clone(), read(&rel)));
        }
    }
    for (name, text) in files {
        for bad in ["../shared", "shared/tools", "shared/anchors"] {
            assert!(
                !text.contains(bad),
                "{name} points outside the repository: `{bad}`"
            );
        }
    }
}

#[test]
fn the_flag_scanner_and_block_reader_work() {
    let f = flags("run `x --epochs 3 --batch-size=4` not a-b--c, nor ---x; `--opt-level O1`");
    let want: BTreeSet<String> = ["--batch-size", "--epochs", "--opt-level"]
        .map(String::from)
        .into();
    assert_eq!(f, want);
    let md = "a\n```rust\nlet x = 1;\n```\n```sh\nls\n```\n";
    assert_eq!(
        code_blocks(md, "rust"),
        vec![(3, vec!["let x = 1;".to_string()])]
    );
}
