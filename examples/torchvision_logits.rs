//! Loads torchvision's weights into mixprec's ResNet and compares the eval logits with
//! PyTorch's: the end-to-end check that a model moves between the two unchanged.
//!
//!     python3 benches/torchvision_interop.py /tmp/tv      # torch + torchvision: the two files
//!     cargo run --release --example torchvision_logits -- \
//!         --weights /tmp/tv/resnet18.safetensors --io /tmp/tv/resnet18_io.safetensors
//!
//! Options:
//!     --weights FILE           a torchvision state dict as safetensors (required)
//!     --io FILE                `x` and torch's `logits` (required)
//!     --arch resnet18|resnet34|resnet50   (default resnet18; the classes come from fc.weight)
//!     --device cpu|cuda[:N]    (default cpu)
//!
//! Prints the max relative error (max |ours - torch| / max |torch|) and the relative L2 error,
//! and exits with status 1 when the relative L2 error is 1e-3 or more.

use std::path::PathBuf;
use std::process::ExitCode;

use mixprec::io::{load_weights, safetensors};
use mixprec::nn::{Module, ResNet};
use mixprec::{Device, Error, Result, Tensor};

const OP: &str = "torchvision_logits";
const TOLERANCE: f64 = 1e-3;

struct Args {
    weights: PathBuf,
    io: PathBuf,
    arch: String,
    device: Device,
}

fn parse_device(d: &str) -> Result<Device> {
    if d == "cpu" {
        return Ok(Device::Cpu);
    }
    match d
        .strip_prefix("cuda")
        .map(|r| r.trim_start_matches(':'))
        .map(|r| if r.is_empty() { Ok(0) } else { r.parse() })
    {
        Some(Ok(i)) => Device::cuda(i),
        _ => Err(Error::invalid_arg(OP, "--device", d, "cpu, cuda or cuda:N")),
    }
}

fn parse_args() -> Result<Args> {
    let (mut weights, mut io, mut arch, mut device) = (None, None, "resnet18".to_string(), None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| Error::invalid_arg(OP, "option", &flag, "a value after it"))?;
        match flag.as_str() {
            "--weights" => weights = Some(PathBuf::from(value)),
            "--io" => io = Some(PathBuf::from(value)),
            "--arch" => arch = value,
            "--device" => device = Some(parse_device(&value)?),
            _ => {
                return Err(Error::invalid_arg(
                    OP,
                    "option",
                    flag,
                    "--weights FILE, --io FILE, --arch NAME, --device cpu|cuda[:N]",
                ))
            }
        }
    }
    let need = |v: Option<PathBuf>, f: &str| {
        v.ok_or_else(|| Error::invalid_arg(OP, "option", f, "required"))
    };
    Ok(Args {
        weights: need(weights, "--weights")?,
        io: need(io, "--io")?,
        arch,
        device: device.unwrap_or(Device::Cpu),
    })
}

fn get(tensors: &[(String, Tensor)], name: &str, file: &std::path::Path) -> Result<Tensor> {
    tensors
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.clone())
        .ok_or_else(|| Error::DataFormat {
            path: file.display().to_string(),
            format: "safetensors",
            detail: format!("no tensor `{name}`"),
        })
}

fn run() -> Result<bool> {
    let a = parse_args()?;
    // The number of classes is the file's: torchvision's fc is [classes, features].
    let (w, _) = safetensors::read(&a.weights)?;
    let classes = get(&w, "fc.weight", &a.weights)?.dims()[0];
    drop(w);
    let model = match a.arch.as_str() {
        "resnet18" => ResNet::resnet18(classes, &a.device, 0)?,
        "resnet34" => ResNet::resnet34(classes, &a.device, 0)?,
        "resnet50" => ResNet::resnet50(classes, &a.device, 0)?,
        other => {
            return Err(Error::invalid_arg(
                OP,
                "--arch",
                other,
                "resnet18, resnet34 or resnet50",
            ))
        }
    };
    load_weights(&model, &a.weights)?;
    model.eval();

    let (io, _) = safetensors::read(&a.io)?;
    let x = get(&io, "x", &a.io)?.to_device(a.device)?;
    let want = get(&io, "logits", &a.io)?.to_vec_f64()?;
    let t = std::time::Instant::now();
    let got = mixprec::with_no_grad(|| model.forward(&x))?.to_vec_f64()?;
    let secs = t.elapsed().as_secs_f64();
    if got.len() != want.len() {
        return Err(Error::DataFormat {
            path: a.io.display().to_string(),
            format: "safetensors",
            detail: format!(
                "`logits` has {} values, the model gives {}",
                want.len(),
                got.len()
            ),
        });
    }
    let max_ref = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    let d2: f64 = got.iter().zip(&want).map(|(g, w)| (g - w) * (g - w)).sum();
    let w2: f64 = want.iter().map(|w| w * w).sum();
    let rel_l2 = (d2 / w2).sqrt();
    println!(
        "{}: {} parameters, {classes} classes, input {:?} on {}, forward {secs:.2} s",
        a.arch,
        model.num_parameters(),
        x.dims(),
        a.device
    );
    println!(
        "max relative error {:.3e} (max |diff| {max_diff:.3e}, max |torch| {max_ref:.4}); relative L2 error {rel_l2:.3e}",
        max_diff / max_ref
    );
    let ok = rel_l2 < TOLERANCE;
    println!(
        "{}: relative L2 error {} {TOLERANCE:e}",
        if ok { "ok" } else { "FAIL" },
        if ok { "<" } else { ">=" }
    );
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("torchvision_logits: {e}");
            ExitCode::from(2)
        }
    }
}
