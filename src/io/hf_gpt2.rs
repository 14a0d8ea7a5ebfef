//! GPT-2 weights in Hugging Face `transformers`' layout (`GPT2LMHeadModel`'s safetensors), both
//! ways.
//!
//! **Names.** Ours are `transformers`' `GPT2LMHeadModel.state_dict()` names:
//! `transformer.wte.weight`, `transformer.wpe.weight`, per layer `i`
//! `transformer.h.{i}.ln_1.{weight,bias}`, `.attn.c_attn.{weight,bias}`,
//! `.attn.c_proj.{weight,bias}`, `.ln_2.{weight,bias}`, `.mlp.c_fc.{weight,bias}`,
//! `.mlp.c_proj.{weight,bias}`, then `transformer.ln_f.{weight,bias}` and `lm_head.weight`,
//! the token embedding itself (tied).
//!
//! **Layouts.** Our linear weights are `[out, in]` (PyTorch's `nn.Linear`); GPT-2's four
//! projections are `transformers`' `Conv1D`, whose weights are `[in, out]`: `c_attn`,
//! `attn.c_proj`, `c_fc` and `mlp.c_proj` weights are transposed on load and on save (biases,
//! norms and embeddings are the same both sides). Our vocabulary may be padded (50257 to 50304,
//! a multiple of 64, for faster matrix products): the token embedding gets zero rows on load,
//! and the padding is cut on save.
//!
//! **Files.** Loading accepts the names with or without the `transformer.` prefix (the hub's
//! original `gpt2` file has none; `save_pretrained` writes it), any float dtype (converted to
//! F32), and ignores the causal-mask buffers `h.{i}.attn.bias` / `h.{i}.attn.masked_bias` that
//! older versions saved (whatever their dtype). `lm_head.weight`, when present, must equal the
//! token embedding (GPT-2 ties them; an untied head is refused). Saving writes what
//! `save_pretrained` writes: prefixed names, F32, no `lm_head.weight` (tied, so
//! `GPT2LMHeadModel.from_pretrained` restores it), no mask buffers, metadata `format = pt`.
//! Missing, misshaped and unexpected tensors are reported all at once in one
//! [`Error::StateMismatch`] naming the file, each tensor and both shapes.

use std::collections::BTreeMap;
use std::path::Path;

use super::safetensors::{self, NamedTensors};
use crate::{DType, Device, Error, Mismatch, Result, Shape, Tensor};

/// The prefix of every name but `lm_head.weight`.
pub const PREFIX: &str = "transformer.";
/// The tied head's name.
pub const LM_HEAD: &str = "lm_head.weight";
const WTE: &str = "transformer.wte.weight";
const WPE: &str = "transformer.wpe.weight";

/// A GPT-2's sizes, as far as its weights tell them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpt2Dims {
    pub n_layer: usize,
    pub n_embd: usize,
    /// The MLP's hidden width (`4 * n_embd` in every GPT-2).
    pub n_inner: usize,
    /// Rows of the token embedding (the real vocabulary in an HF file, padded or not in ours).
    pub vocab_size: usize,
    /// Rows of the position embedding (the context length).
    pub n_positions: usize,
}

/// Where a weight's layout differs between the two sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Same,
    /// `Conv1D` `[in, out]` there, `[out, in]` here.
    Transposed,
    /// The token embedding: rows padded here.
    Vocab,
}

/// Every tensor of a GPT-2 with `d`'s sizes: our name, the kind, and the shape in HF's layout
/// (with `d.vocab_size` rows of the token embedding). In `state_dict()` order, `lm_head` left
/// out.
fn hf_layout(d: &Gpt2Dims) -> Vec<(String, Kind, Vec<usize>)> {
    let (c, i) = (d.n_embd, d.n_inner);
    let mut out = vec![
        (WTE.to_string(), Kind::Vocab, vec![d.vocab_size, c]),
        (WPE.to_string(), Kind::Same, vec![d.n_positions, c]),
    ];
    for l in 0..d.n_layer {
        let p = |s: &str| format!("{PREFIX}h.{l}.{s}");
        out.extend([
            (p("ln_1.weight"), Kind::Same, vec![c]),
            (p("ln_1.bias"), Kind::Same, vec![c]),
            (p("attn.c_attn.weight"), Kind::Transposed, vec![c, 3 * c]),
            (p("attn.c_attn.bias"), Kind::Same, vec![3 * c]),
            (p("attn.c_proj.weight"), Kind::Transposed, vec![c, c]),
            (p("attn.c_proj.bias"), Kind::Same, vec![c]),
            (p("ln_2.weight"), Kind::Same, vec![c]),
            (p("ln_2.bias"), Kind::Same, vec![c]),
            (p("mlp.c_fc.weight"), Kind::Transposed, vec![c, i]),
            (p("mlp.c_fc.bias"), Kind::Same, vec![i]),
            (p("mlp.c_proj.weight"), Kind::Transposed, vec![i, c]),
            (p("mlp.c_proj.bias"), Kind::Same, vec![c]),
        ]);
    }
    out.push((format!("{PREFIX}ln_f.weight"), Kind::Same, vec![c]));
    out.push((format!("{PREFIX}ln_f.bias"), Kind::Same, vec![c]));
    out
}

/// The names of our GPT-2's tensors with `n_layer` layers, in `state_dict()` order, the tied
/// `lm_head.weight` last.
pub fn gpt2_names(n_layer: usize) -> Vec<String> {
    let d = Gpt2Dims {
        n_layer,
        n_embd: 1,
        n_inner: 1,
        vocab_size: 1,
        n_positions: 1,
    };
    let mut names: Vec<String> = hf_layout(&d).into_iter().map(|(n, _, _)| n).collect();
    names.push(LM_HEAD.to_string());
    names
}

/// `h.{i}.attn.bias` / `h.{i}.attn.masked_bias` (prefixed or not): causal-mask buffers, not
/// weights.
fn is_mask_buffer(name: &str) -> bool {
    let n = name.strip_prefix(PREFIX).unwrap_or(name);
    let Some(rest) = n.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && (tail == "attn.bias" || tail == "attn.masked_bias")
}

/// The layer index of a (prefixed) `transformer.h.{i}.` name.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix(PREFIX)?.strip_prefix("h.")?;
    rest.split_once('.')?.0.parse().ok()
}

fn mismatch(context: &str, problems: Vec<Mismatch>) -> Error {
    Error::StateMismatch {
        context: context.to_string(),
        problems,
    }
}

/// The sizes of the GPT-2 in `t` (our names): vocabulary and width from the token embedding,
/// context from the position embedding, depth from the highest layer index, MLP width from
/// layer 0's `c_fc` (`[in, out]` when `hf`, `[out, in]` otherwise; 4 × width without it).
fn dims_of(
    context: &str,
    t: &BTreeMap<String, Tensor>,
    hf: bool,
) -> std::result::Result<Gpt2Dims, Error> {
    let two_d = |name: &str| -> std::result::Result<[usize; 2], Mismatch> {
        match t.get(name) {
            None => Err(Mismatch::Missing {
                name: name.to_string(),
                shape: Shape::new(vec![0, 0]),
                dtype: DType::F32,
            }),
            Some(x) if x.dims().len() != 2 => Err(Mismatch::Layout {
                name: name.to_string(),
                detail: format!("a 2-d embedding expected, shape {:?} found", x.dims()),
            }),
            Some(x) => Ok([x.dims()[0], x.dims()[1]]),
        }
    };
    let (wte, wpe) = (two_d(WTE), two_d(WPE));
    let (Ok([vocab_size, n_embd]), Ok([n_positions, _])) = (&wte, &wpe) else {
        let problems = [wte.err(), wpe.err()].into_iter().flatten().collect();
        return Err(mismatch(context, problems));
    };
    let n_layer = t
        .keys()
        .filter_map(|n| layer_of(n))
        .max()
        .map_or(0, |l| l + 1);
    let fc = t.get(&format!("{PREFIX}h.0.mlp.c_fc.weight"));
    let n_inner = match fc.map(|w| w.dims()) {
        Some([a, b]) => {
            if hf {
                *b
            } else {
                *a
            }
        }
        _ => 4 * n_embd,
    };
    Ok(Gpt2Dims {
        n_layer,
        n_embd: *n_embd,
        n_inner,
        vocab_size: *vocab_size,
        n_positions: *n_positions,
    })
}

/// Whether two tensors hold the same F32 values, bit for bit.
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    let (a, b) = (a.to_vec_f32()?, b.to_vec_f32()?);
    Ok(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

/// Checks `t` (our names) against `layout` with the shapes `shape_of` gives each entry:
/// missing, misshaped, non-float and unexpected tensors (`lm_head.weight` aside), all at once.
fn check_tensors(
    context: &str,
    t: &BTreeMap<String, Tensor>,
    layout: &[(String, Kind, Vec<usize>)],
    shape_of: impl Fn(Kind, &[usize]) -> Vec<usize>,
) -> Result<()> {
    let mut problems = Vec::new();
    for (name, kind, hf_shape) in layout {
        let want = Shape::new(shape_of(*kind, hf_shape));
        match t.get(name) {
            None => problems.push(Mismatch::Missing {
                name: name.clone(),
                shape: want,
                dtype: DType::F32,
            }),
            Some(x) if x.dims() != want.dims() => problems.push(Mismatch::Shape {
                name: name.clone(),
                expected: want,
                found: x.shape().clone(),
            }),
            Some(x) if !x.dtype().is_float() => problems.push(Mismatch::DType {
                name: name.clone(),
                expected: DType::F32,
                found: x.dtype(),
            }),
            Some(_) => {}
        }
    }
    let known: std::collections::HashSet<&str> =
        layout.iter().map(|(n, _, _)| n.as_str()).collect();
    for (name, x) in t {
        if name != LM_HEAD && !known.contains(name.as_str()) {
            problems.push(Mismatch::Unexpected {
                name: name.clone(),
                shape: x.shape().clone(),
                dtype: x.dtype(),
            });
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(mismatch(context, problems))
    }
}

/// `t` as F32, contiguous, on the CPU.
fn f32_cpu(t: &Tensor) -> Result<Tensor> {
    let t = if t.dtype() == DType::F32 {
        t.clone()
    } else {
        t.to_dtype(DType::F32)?
    };
    t.to_device(Device::Cpu)?.contiguous()
}

/// Checks that `lm_head.weight`, when `t` has it, is the token embedding (`wte`, F32 CPU).
fn check_tied(context: &str, t: &BTreeMap<String, Tensor>, wte: &Tensor) -> Result<()> {
    if let Some(head) = t.get(LM_HEAD) {
        if !same_bits(&f32_cpu(head)?, wte)? {
            return Err(mismatch(
                context,
                vec![Mismatch::Layout {
                    name: LM_HEAD.to_string(),
                    detail: format!(
                        "differs from {WTE} (shape {:?} vs {:?}): GPT-2's head is tied to the \
                         token embedding, an untied head cannot be loaded",
                        head.dims(),
                        wte.dims()
                    ),
                }],
            ));
        }
    }
    Ok(())
}

/// HF-named tensors (prefixed or not; mask buffers already dropped) → ours, F32 on the CPU,
/// the token embedding padded to `padded_vocab` rows (at least the file's vocabulary), in
/// `state_dict()` order with `lm_head.weight` (the token embedding) last. `context` names the
/// source in errors.
pub fn from_hf(
    tensors: NamedTensors,
    padded_vocab: usize,
    context: &str,
) -> Result<(NamedTensors, Gpt2Dims)> {
    let mut t = BTreeMap::new();
    let mut problems = Vec::new();
    for (name, x) in tensors {
        if is_mask_buffer(&name) {
            continue;
        }
        let ours = if name == LM_HEAD || name.starts_with(PREFIX) {
            name
        } else {
            format!("{PREFIX}{name}")
        };
        if let Some(prev) = t.insert(ours.clone(), x) {
            problems.push(Mismatch::Unexpected {
                name: format!("{ours} (given twice: with and without `{PREFIX}`)"),
                shape: prev.shape().clone(),
                dtype: prev.dtype(),
            });
        }
    }
    if !problems.is_empty() {
        return Err(mismatch(context, problems));
    }
    let dims = dims_of(context, &t, true)?;
    let layout = hf_layout(&dims);
    check_tensors(context, &t, &layout, |_, s| s.to_vec())?;
    if padded_vocab < dims.vocab_size {
        return Err(Error::invalid_arg(
            "hf_gpt2::from_hf",
            "padded_vocab",
            padded_vocab,
            format!(
                "at least the file's vocabulary, {} ({context})",
                dims.vocab_size
            ),
        ));
    }
    let wte_file = f32_cpu(&t[WTE])?;
    check_tied(context, &t, &wte_file)?;
    let mut out = Vec::with_capacity(layout.len() + 1);
    for (name, kind, _) in &layout {
        let x = f32_cpu(&t[name])?;
        let x = match kind {
            Kind::Same => x,
            Kind::Transposed => x.transpose(0, 1)?.contiguous()?,
            Kind::Vocab if padded_vocab > dims.vocab_size => {
                let pad = Tensor::zeros(
                    vec![padded_vocab - dims.vocab_size, dims.n_embd],
                    DType::F32,
                    Device::Cpu,
                )?;
                Tensor::cat(&[&x, &pad], 0)?
            }
            Kind::Vocab => x,
        };
        out.push((name.clone(), x));
    }
    let wte = out[0].1.clone();
    out.push((LM_HEAD.to_string(), wte));
    Ok((out, dims))
}

/// Ours → HF-named tensors as `save_pretrained` writes them: F32 CPU, Conv1D weights
/// transposed, the token embedding cut to `vocab_size` rows, no `lm_head.weight`. Our tensors
/// may be on any device and of any float dtype; `lm_head.weight` may be absent, and when
/// present must equal the token embedding.
pub fn to_hf(tensors: &NamedTensors, vocab_size: usize, context: &str) -> Result<NamedTensors> {
    let t: BTreeMap<String, Tensor> = tensors.iter().cloned().collect();
    if t.len() != tensors.len() {
        return Err(Error::invalid_arg(
            "hf_gpt2::to_hf",
            "tensors",
            format!("{} tensors with {} distinct names", tensors.len(), t.len()),
            format!("each name once ({context})"),
        ));
    }
    let ours = dims_of(context, &t, false)?;
    if vocab_size == 0 || vocab_size > ours.vocab_size {
        return Err(Error::invalid_arg(
            "hf_gpt2::to_hf",
            "vocab_size",
            vocab_size,
            format!("1..={} (the rows of {WTE}; {context})", ours.vocab_size),
        ));
    }
    let layout = hf_layout(&ours);
    check_tensors(context, &t, &layout, |kind, s| match kind {
        Kind::Transposed => vec![s[1], s[0]],
        _ => s.to_vec(),
    })?;
    let wte = f32_cpu(&t[WTE])?;
    check_tied(context, &t, &wte)?;
    let mut out = Vec::with_capacity(layout.len());
    for (name, kind, _) in &layout {
        let x = match kind {
            Kind::Same => f32_cpu(&t[name])?,
            Kind::Transposed => f32_cpu(&t[name])?.transpose(0, 1)?.contiguous()?,
            Kind::Vocab => wte.narrow(0, 0, vocab_size)?.contiguous()?,
        };
        out.push((name.clone(), x));
    }
    Ok(out)
}

/// Loads an HF GPT-2 safetensors file into our names and layout (see the module doc), F32 on
/// the CPU, the token embedding padded to `padded_vocab` rows.
pub fn load_hf_gpt2(path: &Path, padded_vocab: usize) -> Result<(NamedTensors, Gpt2Dims)> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let (tensors, _) = safetensors::parse_some(path, &bytes, &|n| !is_mask_buffer(n))?;
    from_hf(
        tensors,
        padded_vocab,
        &format!("load_hf_gpt2 {}", path.display()),
    )
}

/// Saves our GPT-2 tensors as an HF `GPT2LMHeadModel` safetensors file (see the module doc)
/// with `vocab_size` rows of the token embedding (50257 for GPT-2's tokenizer), atomically.
pub fn save_hf_gpt2(path: &Path, tensors: &NamedTensors, vocab_size: usize) -> Result<()> {
    let hf = to_hf(
        tensors,
        vocab_size,
        &format!("save_hf_gpt2 {}", path.display()),
    )?;
    let mut meta = BTreeMap::new();
    // `from_pretrained` refuses safetensors files without it.
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::write(path, &hf, &meta)
}
