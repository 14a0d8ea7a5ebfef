//! The per-op twin against PyTorch (issue 42's first acceptance check). PyTorch's side runs
//! first and writes, per op, seeded inputs, upstream gradients, its own results and an f64
//! reference in each of f32, f16 and bf16 (see `benches/torch_op_twin.py`); this example reads
//! them, runs each op forward and backward on the device in each dtype through mixprec's public
//! API, and reports for every output and input gradient the relative L2 error
//! `‖a − ref‖ / ‖ref‖` of ours and of PyTorch's against the f64 reference:
//!
//! ```text
//! python3 benches/torch_op_twin.py DIR [--device cuda|cpu] [--small]
//! cargo run --release --example op_twin -- DIR [cuda|cpu]
//! ```
//!
//! Verdicts: at f32, PASS when ours is within fp32 rounding of the reference, a relative L2
//! error at most 2^-14 (1024 units of f32 roundoff u = 2^-24: room for reductions over
//! thousands of terms, yet TF32 or any half type lands well above it); at f16/bf16, PASS when
//! ours is no further from the reference than PyTorch's, `ours ≤ torch × (1 + 2%)` (the slack
//! covers ties in the final rounding of two implementations that both round once; the ratio and
//! the strict comparison are printed too). Dropout cannot be compared (the masks come from
//! different generators): it is checked on its own (p = 0 the identity; at p = 0.1 the kept
//! fraction within 5σ of 0.9, kept values and gradients scaled by 1/(1 − p) to the dtype's
//! rounding, the gradient zero exactly where the output is).
//!
//! One JSON line per row on stdout, then a table; the exit status is 1 if any row fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mixprec::nn::{cross_entropy_with, CrossEntropyConfig, Reduction};
use mixprec::tensor::SdpaOptions;
use mixprec::{DType, Device, DropoutGenerator, Error, Result, Tensor};
use serde_json::json;

/// The ops in the order they are reported; a file missing from DIR is skipped with a note.
const OPS: &[&str] = &[
    "layer_norm",
    "rms_norm",
    "gelu",
    "gelu_tanh",
    "silu",
    "softmax",
    "log_softmax",
    "embedding",
    "linear",
    "bmm",
    "sdpa_causal",
    "sdpa",
    "sdpa_mask",
    "cross_entropy",
];

const DTYPES: [(&str, DType); 3] = [
    ("f32", DType::F32),
    ("f16", DType::F16),
    ("bf16", DType::BF16),
];

/// The f32 bound on the relative L2 error: 2^-14 = 1024·u, u = 2^-24.
const F32_BOUND: f64 = 1.0 / 16384.0;
/// How much further than PyTorch's a half result may be (a fraction of torch's error).
const HALF_SLACK: f64 = 0.02;
const EPS: f64 = 1e-5;

/// One compared quantity.
struct Row {
    op: String,
    dtype: &'static str,
    what: String,
    ours: f64,
    torch: f64,
    criterion: String,
    pass: bool,
    note: String,
}

impl Row {
    fn compared(op: &str, dtype: &'static str, what: &str, ours: f64, torch: f64) -> Row {
        let (criterion, pass) = if dtype == "f32" {
            ("ours <= 2^-14".to_string(), ours <= F32_BOUND)
        } else {
            (
                "ours <= torch x 1.02".to_string(),
                ours <= torch * (1.0 + HALF_SLACK),
            )
        };
        Row {
            op: op.into(),
            dtype,
            what: what.into(),
            ours,
            torch,
            criterion,
            pass: pass && ours.is_finite(),
            note: String::new(),
        }
    }

    fn failed(op: &str, dtype: &'static str, what: &str, why: String) -> Row {
        Row {
            op: op.into(),
            dtype,
            what: what.into(),
            ours: f64::NAN,
            torch: f64::NAN,
            criterion: "runs".into(),
            pass: false,
            note: why,
        }
    }

    fn ratio(&self) -> f64 {
        if self.torch == 0.0 {
            if self.ours == 0.0 {
                1.0
            } else {
                f64::INFINITY
            }
        } else {
            self.ours / self.torch
        }
    }

    fn json(&self) -> String {
        let num = |v: f64| if v.is_finite() { json!(v) } else { json!(null) };
        json!({
            "op": self.op,
            "dtype": self.dtype,
            "quantity": self.what,
            "ours_rel_err": num(self.ours),
            "torch_rel_err": num(self.torch),
            "ratio": num(self.ratio()),
            "strictly_no_worse": self.ours <= self.torch,
            "criterion": self.criterion,
            "pass": self.pass,
            "note": self.note,
        })
        .to_string()
    }
}

/// `‖a − r‖ / ‖r‖` in f64 (`‖a − r‖` when `r` is zero); infinite on a size mismatch.
fn rel_l2(a: &Tensor, r: &Tensor) -> Result<f64> {
    let (a, r) = (a.to_vec_f64()?, r.to_vec_f64()?);
    if a.len() != r.len() {
        return Ok(f64::INFINITY);
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(&r) {
        num += (x - y) * (x - y);
        den += y * y;
    }
    Ok(if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    })
}

/// The tensors of one op's file, by name.
struct OpFile {
    op: String,
    tensors: BTreeMap<String, Tensor>,
    grads: Vec<String>,
}

impl OpFile {
    fn read(path: &Path) -> Result<OpFile> {
        let (named, meta) = mixprec::io::safetensors::read(path)?;
        let get = |k: &str| meta.get(k).cloned().unwrap_or_default();
        Ok(OpFile {
            op: get("op"),
            grads: get("grads")
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            tensors: named.into_iter().collect(),
        })
    }

    fn get(&self, key: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| {
            Error::invalid_arg(
                "op_twin",
                "file",
                format!("no tensor `{key}` for {}", self.op),
                "a file written by benches/torch_op_twin.py",
            )
        })
    }

    /// The names under `prefix` (e.g. `f16.in.`), without it.
    fn names(&self, prefix: &str) -> Vec<String> {
        self.tensors
            .keys()
            .filter_map(|k| k.strip_prefix(prefix).map(String::from))
            .collect()
    }
}

/// The op's outputs on `inputs` (named as PyTorch's side names them), and the attention path.
fn forward(op: &str, i: &BTreeMap<String, Tensor>) -> Result<(Vec<(String, Tensor)>, String)> {
    let g = |k: &str| {
        i.get(k).ok_or_else(|| {
            Error::invalid_arg(
                "op_twin",
                "inputs",
                format!("no `{k}` for {op}"),
                "the op's inputs",
            )
        })
    };
    let last = |t: &Tensor| t.dims().last().copied().unwrap_or(1);
    let mut path = String::new();
    let y = match op {
        "layer_norm" => {
            let x = g("x")?;
            x.layer_norm(&[last(x)], Some(g("weight")?), Some(g("bias")?), EPS)?
        }
        "rms_norm" => {
            let x = g("x")?;
            x.rms_norm(&[last(x)], Some(g("weight")?), EPS)?
        }
        "gelu" => g("x")?.gelu()?,
        "gelu_tanh" => g("x")?.gelu_tanh()?,
        "silu" => g("x")?.silu()?,
        "softmax" => g("x")?.softmax(-1)?,
        "log_softmax" => g("x")?.log_softmax(-1)?,
        "embedding" => g("ids")?.embedding(g("weight")?, None)?,
        "linear" => g("x")?.linear(g("weight")?, Some(g("bias")?))?,
        "bmm" => g("a")?.matmul(g("b")?)?,
        "sdpa_causal" | "sdpa" | "sdpa_mask" => {
            let opts = SdpaOptions {
                causal: op == "sdpa_causal",
                mask: if op == "sdpa_mask" {
                    Some(g("mask")?)
                } else {
                    None
                },
                ..Default::default()
            };
            let (q, k, v) = (g("q")?, g("k")?, g("v")?);
            path = format!("{:?}", q.attention_path(k, v, &opts));
            q.scaled_dot_product_attention(k, v, &opts)?
        }
        "cross_entropy" => {
            let cfg = CrossEntropyConfig {
                reduction: Reduction::Mean,
                label_smoothing: 0.1,
                ignore_index: Some(-100),
            };
            let loss = cross_entropy_with(g("logits")?, g("targets")?, cfg)?;
            return Ok((vec![("loss".into(), loss)], path));
        }
        other => return Err(Error::invalid_arg("op_twin", "op", other, OPS.join(", "))),
    };
    Ok((vec![("y".into(), y)], path))
}

/// Runs one op in one dtype and compares every output and gradient.
fn compare(f: &OpFile, name: &'static str, dev: Device) -> Result<Vec<Row>> {
    let op = f.op.as_str();
    let mut inputs = BTreeMap::new();
    for k in f.names(&format!("{name}.in.")) {
        let t = f.get(&format!("{name}.in.{k}"))?.to_device(dev)?;
        let t = if f.grads.contains(&k) {
            t.to_variable()
        } else {
            t
        };
        inputs.insert(k, t);
    }
    let (outs, path) = forward(op, &inputs)?;
    // Σ out·gy, so that each output's gradient is exactly PyTorch's upstream gradient.
    let mut total: Option<Tensor> = None;
    for (k, y) in &outs {
        let gy = f
            .get(&format!("{name}.gy.{k}"))?
            .to_device(dev)?
            .to_dtype(y.dtype())?;
        let s = y.mul(&gy)?.to_dtype(DType::F32)?.sum_all()?;
        total = Some(match total {
            None => s,
            Some(t) => t.add(&s)?,
        });
    }
    if let Some(t) = total {
        t.backward()?;
    }
    let mut rows = Vec::new();
    let row = |what: &str, ours: &Tensor, key: &str| -> Result<Row> {
        let e_ours = rel_l2(ours, f.get(&format!("{name}.ref.{key}"))?)?;
        let e_torch = rel_l2(
            f.get(&format!("{name}.torch.{key}"))?,
            f.get(&format!("{name}.ref.{key}"))?,
        )?;
        let mut row = Row::compared(op, name, what, e_ours, e_torch);
        if !path.is_empty() {
            row.note = format!("path {path}");
        }
        Ok(row)
    };
    for (k, y) in &outs {
        rows.push(row(k, y, k)?);
    }
    for k in &f.grads {
        let key = format!("grad.{k}");
        match inputs.get(k).and_then(|t| t.grad()) {
            Some(g) => rows.push(row(&key, &g, &key)?),
            None => rows.push(Row::failed(op, name, &key, "no gradient".into())),
        }
    }
    Ok(rows)
}

/// Dropout on its own in dtype `dt`: p = 0 the identity, p = 0.1 the kept fraction, the scaling
/// and the backward's mask.
fn dropout_rows(name: &'static str, dt: DType, dims: &[usize], dev: Device) -> Result<Vec<Row>> {
    let op = "dropout";
    let gen = DropoutGenerator::new(1234, dev)?;
    let x = Tensor::randn(dims.to_vec(), 0.0, 1.0, 5, dt, dev)?.to_variable();
    let gy = Tensor::randn(dims.to_vec(), 0.0, 1.0, 6, dt, dev)?;
    let mut rows = Vec::new();
    let check = |what: &str, ok: bool, value: f64, criterion: &str, note: String| Row {
        op: op.into(),
        dtype: name,
        what: what.into(),
        ours: value,
        torch: f64::NAN,
        criterion: criterion.into(),
        pass: ok,
        note,
    };

    // p = 0: the same values, and the gradient passes unchanged.
    let y0 = x.dropout(0.0, &gen)?;
    y0.mul(&gy)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
    let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
        let (a, b) = (a.to_vec_f64()?, b.to_vec_f64()?);
        Ok(a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()))
    };
    let g0 = x
        .grad()
        .ok_or_else(|| Error::invalid_arg(op, "x", "no gradient at p = 0", "a gradient"))?;
    let id = same(&y0, &x)? && same(&g0, &gy)?;
    rows.push(check(
        "p=0 identity",
        id,
        if id { 0.0 } else { 1.0 },
        "y == x, dx == dy bitwise",
        String::new(),
    ));
    x.zero_grad();

    // p = 0.1.
    let p = 0.1;
    let y = x.dropout(p, &gen)?;
    y.mul(&gy)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
    let g = x
        .grad()
        .ok_or_else(|| Error::invalid_arg(op, "x", "no gradient at p = 0.1", "a gradient"))?;
    let (xv, yv, gv, gyv) = (
        x.to_vec_f64()?,
        y.to_vec_f64()?,
        g.to_vec_f64()?,
        gy.to_vec_f64()?,
    );
    let n = xv.len() as f64;
    let kept = yv.iter().filter(|v| **v != 0.0).count() as f64;
    let sigma = (p * (1.0 - p) / n).sqrt();
    let frac = kept / n;
    rows.push(check(
        "kept fraction",
        ((frac - (1.0 - p)) / sigma).abs() <= 5.0,
        frac,
        "|kept - 0.9| <= 5 sigma",
        format!("{kept} of {n}, sigma {sigma:.2e}"),
    ));
    // The dtype's unit roundoff: kept values are x/(1 − p) rounded once (twice the unit for the
    // scale's own rounding in f32).
    // Relative to the smallest normal value at least: below it (f16's subnormals) the dtype
    // keeps fewer digits.
    let (u, tiny) = match dt {
        DType::F16 => (2f64.powi(-11), 2f64.powi(-14)),
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-126)),
        _ => (2f64.powi(-24), 2f64.powi(-126)),
    };
    let bound = 2.0 * u;
    let (mut worst_y, mut worst_g, mut mask_ok) = (0.0f64, 0.0f64, true);
    for i in 0..xv.len() {
        let dropped = yv[i] == 0.0 && xv[i] != 0.0;
        if dropped {
            mask_ok &= gv[i] == 0.0;
            continue;
        }
        mask_ok &= gv[i] != 0.0 || gyv[i] == 0.0;
        let want = xv[i] / (1.0 - p);
        worst_y = worst_y.max((yv[i] - want).abs() / want.abs().max(tiny));
        let want_g = gyv[i] / (1.0 - p);
        worst_g = worst_g.max((gv[i] - want_g).abs() / want_g.abs().max(tiny));
    }
    rows.push(check(
        "kept y = x/(1-p)",
        worst_y <= bound,
        worst_y,
        "max rel dev <= 2u",
        format!("u = {u:.1e}, relative to max(|value|, smallest normal)"),
    ));
    rows.push(check(
        "kept dx = dy/(1-p)",
        worst_g <= bound,
        worst_g,
        "max rel dev <= 2u",
        format!("u = {u:.1e}"),
    ));
    rows.push(check(
        "dx mask = y mask",
        mask_ok,
        if mask_ok { 0.0 } else { 1.0 },
        "dx == 0 exactly where y == 0",
        String::new(),
    ));
    Ok(rows)
}

fn main() {
    let _ = env_logger::try_init();
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next().map(PathBuf::from) else {
        eprintln!("usage: op_twin DIR [cuda|cpu]   (DIR written by benches/torch_op_twin.py)");
        std::process::exit(2);
    };
    let dev = match args.next().as_deref() {
        None | Some("cuda") => match Device::cuda(0) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("op_twin: no CUDA device ({e}); pass `cpu` to run on the CPU");
                std::process::exit(2);
            }
        },
        Some("cpu") => Device::Cpu,
        Some(other) => {
            eprintln!("op_twin: unknown device `{other}` (cuda or cpu)");
            std::process::exit(2);
        }
    };
    let mut rows = Vec::new();
    let mut dropout_dims = vec![4096, 768];
    for op in OPS {
        let path = dir.join(format!("{op}.safetensors"));
        if !path.exists() {
            eprintln!("op_twin: {} missing, {op} skipped", path.display());
            continue;
        }
        let f = match OpFile::read(&path) {
            Ok(f) => f,
            Err(e) => {
                rows.push(Row::failed(op, "-", "read", e.to_string()));
                continue;
            }
        };
        if *op == "layer_norm" {
            if let Ok(x) = f.get("f32.in.x") {
                dropout_dims = x.dims().to_vec();
            }
        }
        let start = rows.len();
        for (name, _) in DTYPES {
            match compare(&f, name, dev) {
                Ok(r) => rows.extend(r),
                Err(e) => rows.push(Row::failed(op, name, "run", e.to_string())),
            }
        }
        for r in &rows[start..] {
            println!("{}", r.json());
        }
    }
    for (name, dt) in DTYPES {
        match dropout_rows(name, dt, &dropout_dims, dev) {
            Ok(r) => {
                for row in &r {
                    println!("{}", row.json());
                }
                rows.extend(r);
            }
            Err(e) => {
                let r = Row::failed("dropout", name, "run", e.to_string());
                println!("{}", r.json());
                rows.push(r);
            }
        }
    }
    print_table(&rows, dev);
    if rows.is_empty() || rows.iter().any(|r| !r.pass) {
        std::process::exit(1);
    }
}

fn print_table(rows: &[Row], dev: Device) {
    println!();
    println!("per-op twin on {dev:?}: relative L2 error against torch's f64 reference");
    println!(
        "{:<14} {:<5} {:<20} {:>10} {:>10} {:>7}  {:<6} criterion / note",
        "op", "dtype", "quantity", "ours", "torch", "ratio", ""
    );
    let e = |v: f64| {
        if v.is_nan() {
            "-".to_string()
        } else {
            format!("{v:.3e}")
        }
    };
    for r in rows {
        println!(
            "{:<14} {:<5} {:<20} {:>10} {:>10} {:>7}  {:<6} {}{}{}",
            r.op,
            r.dtype,
            r.what,
            e(r.ours),
            e(r.torch),
            if r.torch.is_nan() {
                "-".into()
            } else {
                format!("{:.3}", r.ratio())
            },
            if r.pass { "PASS" } else { "FAIL" },
            r.criterion,
            if r.note.is_empty() { "" } else { "; " },
            r.note
        );
    }
    let failed = rows.iter().filter(|r| !r.pass).count();
    println!(
        "{} rows, {} pass, {failed} fail (f32: ours <= 2^-14 = {F32_BOUND:.2e}; f16/bf16: ours <= torch x {})",
        rows.len(),
        rows.len() - failed,
        1.0 + HALF_SLACK
    );
}
