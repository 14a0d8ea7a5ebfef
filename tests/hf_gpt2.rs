//! GPT-2 weights in Hugging Face's layout: a tiny synthetic `GPT2LMHeadModel` file (2 layers,
//! width 8) loaded into our names (Conv1D weights transposed, vocabulary padded), saved back
//! and reloaded bit for bit; the variants real files have (no prefix, mask buffers, half
//! dtypes, a tied `lm_head.weight`); and the errors.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mixprec::io::hf_gpt2::{gpt2_names, load_hf_gpt2, save_hf_gpt2, to_hf, Gpt2Dims};
use mixprec::io::safetensors;
use mixprec::{DType, Device, Error, Tensor};

const L: usize = 2;
const C: usize = 8;
const V: usize = 50;
const P: usize = 16;
const PAD: usize = 64;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mixprec-hf-gpt2-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// HF names (no prefix) and shapes of the tiny model.
fn hf_shapes() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("wte.weight".to_string(), vec![V, C]),
        ("wpe.weight".to_string(), vec![P, C]),
    ];
    for l in 0..L {
        for (s, shape) in [
            ("ln_1.weight", vec![C]),
            ("ln_1.bias", vec![C]),
            ("attn.c_attn.weight", vec![C, 3 * C]),
            ("attn.c_attn.bias", vec![3 * C]),
            ("attn.c_proj.weight", vec![C, C]),
            ("attn.c_proj.bias", vec![C]),
            ("ln_2.weight", vec![C]),
            ("ln_2.bias", vec![C]),
            ("mlp.c_fc.weight", vec![C, 4 * C]),
            ("mlp.c_fc.bias", vec![4 * C]),
            ("mlp.c_proj.weight", vec![4 * C, C]),
            ("mlp.c_proj.bias", vec![C]),
        ] {
            v.push((format!("h.{l}.{s}"), shape));
        }
    }
    v.push(("ln_f.weight".to_string(), vec![C]));
    v.push(("ln_f.bias".to_string(), vec![C]));
    v
}

/// Distinct values per tensor and element, so a wrong transpose or name shows.
fn hf_model(prefix: &str) -> Vec<(String, Tensor)> {
    hf_shapes()
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n)
                .map(|i| k as f32 * 1000.0 + i as f32 * 0.25 - 3.0)
                .collect();
            (
                format!("{prefix}{name}"),
                Tensor::from_vec(vals, shape, Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn write_hf(path: &std::path::Path, tensors: &[(String, Tensor)]) {
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::write(path, tensors, &meta).unwrap();
}

fn get<'a>(t: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &t.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .1
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn load_transposes_pads_and_ties() {
    let hf = hf_model("");
    let path = temp("plain.safetensors");
    write_hf(&path, &hf);
    let (ours, dims) = load_hf_gpt2(&path, PAD).unwrap();
    assert_eq!(
        dims,
        Gpt2Dims {
            n_layer: L,
            n_embd: C,
            n_inner: 4 * C,
            vocab_size: V,
            n_positions: P
        }
    );
    let names: Vec<_> = ours.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, gpt2_names(L));
    assert_eq!(names[0], "transformer.wte.weight");
    assert_eq!(names.last().unwrap(), "lm_head.weight");
    for (_, t) in &ours {
        assert_eq!(t.dtype(), DType::F32);
    }
    // Conv1D [in, out] -> Linear [out, in].
    for (s, (i, o)) in [
        ("attn.c_attn.weight", (C, 3 * C)),
        ("attn.c_proj.weight", (C, C)),
        ("mlp.c_fc.weight", (C, 4 * C)),
        ("mlp.c_proj.weight", (4 * C, C)),
    ] {
        let theirs = get(&hf, &format!("h.1.{s}")).to_vec_f32().unwrap();
        let mine = get(&ours, &format!("transformer.h.1.{s}"));
        assert_eq!(mine.dims(), &[o, i], "{s}");
        let mine = mine.to_vec_f32().unwrap();
        for a in 0..i {
            for b in 0..o {
                assert_eq!(
                    mine[b * i + a].to_bits(),
                    theirs[a * o + b].to_bits(),
                    "{s}"
                );
            }
        }
    }
    // Everything else as it is.
    assert_eq!(
        bits(get(&ours, "transformer.h.0.attn.c_attn.bias")),
        bits(get(&hf, "h.0.attn.c_attn.bias"))
    );
    assert_eq!(
        bits(get(&ours, "transformer.wpe.weight")),
        bits(get(&hf, "wpe.weight"))
    );
    assert_eq!(
        bits(get(&ours, "transformer.ln_f.bias")),
        bits(get(&hf, "ln_f.bias"))
    );
    // Padded rows are zero; the head is the embedding.
    let wte = get(&ours, "transformer.wte.weight");
    assert_eq!(wte.dims(), &[PAD, C]);
    let w = bits(wte);
    assert_eq!(w[..V * C], bits(get(&hf, "wte.weight"))[..]);
    assert!(w[V * C..].iter().all(|&b| b == 0));
    assert_eq!(bits(get(&ours, "lm_head.weight")), w);
}

#[test]
fn save_and_reload_are_bitwise() {
    let hf = hf_model("transformer.");
    let path = temp("prefixed.safetensors");
    write_hf(&path, &hf);
    let (ours, _) = load_hf_gpt2(&path, PAD).unwrap();
    let out = temp("saved.safetensors");
    save_hf_gpt2(&out, &ours, V).unwrap();
    let (saved, meta) = safetensors::read(&out).unwrap();
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    // Exactly HF's tensors: prefixed names, no head, no mask buffers, the same bits.
    let mut want: Vec<_> = hf.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    let got: Vec<_> = saved.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(got, want);
    for (n, t) in &saved {
        assert_eq!(t.dims(), get(&hf, n).dims(), "{n}");
        assert_eq!(bits(t), bits(get(&hf, n)), "{n}");
    }
    let (again, _) = load_hf_gpt2(&out, PAD).unwrap();
    assert_eq!(again.len(), ours.len());
    for ((n0, t0), (n1, t1)) in ours.iter().zip(&again) {
        assert_eq!(n0, n1);
        assert_eq!(t0.dims(), t1.dims(), "{n0}");
        assert_eq!(bits(t0), bits(t1), "{n0}");
    }
    // Without the head, and with an unpadded vocabulary, the same file.
    let no_head: Vec<_> = ours
        .iter()
        .filter(|(n, _)| n != "lm_head.weight")
        .cloned()
        .collect();
    let hf2 = to_hf(&no_head, V, "test").unwrap();
    for (n, t) in hf2 {
        assert_eq!(bits(&t), bits(get(&hf, &n)), "{n}");
    }
    let (unpadded, _) = load_hf_gpt2(&out, V).unwrap();
    assert_eq!(get(&unpadded, "transformer.wte.weight").dims(), &[V, C]);
}

#[test]
fn real_file_variants_load() {
    // Mask buffers (F32 and BOOL), a tied head, F16 and BF16 weights.
    let mut hf = hf_model("");
    let wte = get(&hf, "wte.weight").clone();
    hf.push(("lm_head.weight".to_string(), wte));
    let mut st: Vec<(String, Vec<u8>, Vec<usize>, ::safetensors::Dtype)> = Vec::new();
    for (i, (n, t)) in hf.iter().enumerate() {
        let (dt, bytes) = match i % 3 {
            0 => (
                ::safetensors::Dtype::F32,
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            1 => (
                ::safetensors::Dtype::F16,
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
            _ => (
                ::safetensors::Dtype::BF16,
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
        };
        st.push((n.clone(), bytes, t.dims().to_vec(), dt));
    }
    // The tied head must hold the embedding's values in whatever dtype it is stored in: store
    // both as F32.
    for e in st.iter_mut() {
        if e.0 == "wte.weight" || e.0 == "lm_head.weight" {
            e.3 = ::safetensors::Dtype::F32;
            e.1 = get(&hf, "wte.weight")
                .to_vec_f32()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
        }
    }
    for l in 0..L {
        st.push((
            format!("h.{l}.attn.bias"),
            vec![1u8; P * P],
            vec![1, 1, P, P],
            ::safetensors::Dtype::BOOL,
        ));
        st.push((
            format!("h.{l}.attn.masked_bias"),
            (-1e4f32).to_le_bytes().to_vec(),
            vec![],
            ::safetensors::Dtype::F32,
        ));
    }
    let views: Vec<(String, ::safetensors::tensor::TensorView)> = st
        .iter()
        .map(|(n, b, s, d)| {
            (
                n.clone(),
                ::safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let path = temp("variants.safetensors");
    std::fs::write(&path, ::safetensors::serialize(views, None).unwrap()).unwrap();
    let (ours, dims) = load_hf_gpt2(&path, PAD).unwrap();
    assert_eq!(dims.n_layer, L);
    assert_eq!(ours.len(), gpt2_names(L).len());
    for (n, t) in &ours {
        assert_eq!(t.dtype(), DType::F32, "{n}");
    }
    // A half-stored tensor arrives with its half values.
    let (_, (name, _)) = hf
        .iter()
        .enumerate()
        .find(|(i, (n, t))| i % 3 == 1 && t.dims().len() == 1 && n.starts_with("h."))
        .unwrap();
    let want: Vec<f32> = get(&hf, name)
        .to_vec_f32()
        .unwrap()
        .iter()
        .map(|v| half::f16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(
        get(&ours, &format!("transformer.{name}"))
            .to_vec_f32()
            .unwrap(),
        want
    );
}

fn mismatch_text(e: Error) -> String {
    assert!(matches!(e, Error::StateMismatch { .. }), "{e}");
    e.to_string()
}

#[test]
fn load_errors_name_tensors_and_shapes() {
    // Missing and misshaped (an [out, in] weight in an HF file) and unexpected, all at once.
    let mut hf = hf_model("");
    hf.retain(|(n, _)| n != "h.1.mlp.c_fc.bias");
    for (n, t) in hf.iter_mut() {
        if n == "h.0.attn.c_attn.weight" {
            *t = t.transpose(0, 1).unwrap().contiguous().unwrap();
        }
    }
    hf.push((
        "h.0.attn.extra".to_string(),
        Tensor::zeros(vec![3], DType::F32, Device::Cpu).unwrap(),
    ));
    let path = temp("bad.safetensors");
    write_hf(&path, &hf);
    let msg = mismatch_text(load_hf_gpt2(&path, PAD).unwrap_err());
    assert!(msg.contains("bad.safetensors"), "{msg}");
    assert!(
        msg.contains("missing `transformer.h.1.mlp.c_fc.bias`") && msg.contains("[32]"),
        "{msg}"
    );
    assert!(
        msg.contains("`transformer.h.0.attn.c_attn.weight`: shape [8, 24] expected, [24, 8] found"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected `transformer.h.0.attn.extra`"),
        "{msg}"
    );

    // No embeddings at all.
    let hf: Vec<_> = hf_model("")
        .into_iter()
        .filter(|(n, _)| !n.starts_with("w"))
        .collect();
    write_hf(&path, &hf);
    let msg = mismatch_text(load_hf_gpt2(&path, PAD).unwrap_err());
    assert!(
        msg.contains("missing `transformer.wte.weight`") && msg.contains("wpe"),
        "{msg}"
    );

    // An untied head.
    let mut hf = hf_model("");
    hf.push((
        "lm_head.weight".to_string(),
        Tensor::zeros(vec![V, C], DType::F32, Device::Cpu).unwrap(),
    ));
    write_hf(&path, &hf);
    let msg = mismatch_text(load_hf_gpt2(&path, PAD).unwrap_err());
    assert!(
        msg.contains("lm_head.weight") && msg.contains("tied"),
        "{msg}"
    );

    // Both spellings of a name.
    let mut hf = hf_model("");
    hf.push((
        "transformer.ln_f.bias".to_string(),
        get(&hf_model(""), "ln_f.bias").clone(),
    ));
    write_hf(&path, &hf);
    let msg = mismatch_text(load_hf_gpt2(&path, PAD).unwrap_err());
    assert!(msg.contains("given twice"), "{msg}");

    // A padded vocabulary smaller than the file's.
    write_hf(&path, &hf_model(""));
    let e = load_hf_gpt2(&path, V - 1).unwrap_err().to_string();
    assert!(
        e.contains("padded_vocab") && e.contains("49") && e.contains("50"),
        "{e}"
    );
    // Not a file.
    let e = load_hf_gpt2(&temp("absent.safetensors"), PAD)
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
}

#[test]
fn save_errors_name_tensors_and_shapes() {
    let path = temp("plain-for-save.safetensors");
    write_hf(&path, &hf_model(""));
    let (ours, _) = load_hf_gpt2(&path, PAD).unwrap();
    let out = temp("not-written.safetensors");

    let e = save_hf_gpt2(&out, &ours, PAD + 1).unwrap_err().to_string();
    assert!(
        e.contains("vocab_size") && e.contains("65") && e.contains("1..=64"),
        "{e}"
    );

    let mut bad = ours.clone();
    for (n, t) in bad.iter_mut() {
        if n == "transformer.h.1.mlp.c_proj.weight" {
            *t = t.transpose(0, 1).unwrap().contiguous().unwrap();
        }
    }
    bad.retain(|(n, _)| n != "transformer.ln_f.weight");
    let msg = mismatch_text(save_hf_gpt2(&out, &bad, V).unwrap_err());
    assert!(
        msg.contains("`transformer.h.1.mlp.c_proj.weight`: shape [8, 32] expected, [32, 8] found"),
        "{msg}"
    );
    assert!(msg.contains("missing `transformer.ln_f.weight`"), "{msg}");

    let mut untied = ours.clone();
    for (n, t) in untied.iter_mut() {
        if n == "lm_head.weight" {
            *t = Tensor::zeros(vec![PAD, C], DType::F32, Device::Cpu).unwrap();
        }
    }
    let msg = mismatch_text(save_hf_gpt2(&out, &untied, V).unwrap_err());
    assert!(msg.contains("lm_head.weight"), "{msg}");

    let mut twice = ours.clone();
    twice.push(ours[1].clone());
    let e = save_hf_gpt2(&out, &twice, V).unwrap_err().to_string();
    assert!(e.contains("distinct names"), "{e}");
    assert!(!out.exists());

    // Half-precision tensors of ours are written as F32.
    let half: Vec<_> = ours
        .iter()
        .map(|(n, t)| (n.clone(), t.to_dtype(DType::BF16).unwrap()))
        .collect();
    save_hf_gpt2(&out, &half, V).unwrap();
    let (saved, _) = safetensors::read(&out).unwrap();
    assert!(saved.iter().all(|(_, t)| t.dtype() == DType::F32));
}
