//! Policy files: a policy read from TOML (the format is in the `policy` module docs) and the
//! shipped `configs/` policies compiled into the library.

use std::path::Path;

use serde::Deserialize;

use super::rules::{allowed, known_ops, OP_LISTS};
use super::{LossScale, OptLevel, Policy};
use crate::config_toml::ConfigText;
use crate::error::{Error, Result};
use crate::tensor::autocast::OpKind;
use crate::tensor::DType;

/// The policy files of `configs/` compiled into the library, by name (the file name without
/// `.toml`); [`Policy::builtin`] parses one.
pub const BUILTIN_POLICIES: &[(&str, &str)] = &[
    ("O0", include_str!("../../../configs/O0.toml")),
    ("O1", include_str!("../../../configs/O1.toml")),
    ("O1_bf16", include_str!("../../../configs/O1_bf16.toml")),
    ("O2", include_str!("../../../configs/O2.toml")),
    ("O2_bf16", include_str!("../../../configs/O2_bf16.toml")),
    ("O3", include_str!("../../../configs/O3.toml")),
    ("O3_bf16", include_str!("../../../configs/O3_bf16.toml")),
];

impl Policy {
    /// One of the policy files shipped in the crate's `configs/` (`"O0"` … `"O3"`, `"O1_bf16"`,
    /// `"O2_bf16"`, `"O3_bf16"`; see [`BUILTIN_POLICIES`]), compiled into the library so that a
    /// program outside this repository gets the same policy as `--policy configs/O2.toml`. Its
    /// `source` is the file's path in the repository (`configs/O2.toml`).
    ///
    /// ```
    /// use mixprec::amp::{OptLevel, Policy};
    ///
    /// let policy = Policy::builtin("O2_bf16")?;
    /// assert_eq!(policy.opt_level, OptLevel::O2);
    /// assert!(Policy::builtin("O4").is_err());
    /// # Ok::<(), mixprec::Error>(())
    /// ```
    pub fn builtin(name: &str) -> Result<Policy> {
        let (_, text) = BUILTIN_POLICIES
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| {
                let names: Vec<&str> = BUILTIN_POLICIES.iter().map(|(n, _)| *n).collect();
                Error::config(
                    "<built-in policies>",
                    "name",
                    format!("{name:?}"),
                    format!("one of {}", names.join(", ")),
                )
            })?;
        Self::parse_toml(text, &format!("configs/{name}.toml"))
    }

    // ---- TOML -------------------------------------------------------------------------------

    /// Reads a policy file (see the module docs for the format).
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Policy> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading the amp policy {}", path.display()), e))?;
        Self::parse_toml(&text, &path.display().to_string())
    }

    /// Parses a policy from TOML text (errors name the file as `<string>`).
    pub fn from_toml_str(text: &str) -> Result<Policy> {
        Self::parse_toml(text, "<string>")
    }

    fn parse_toml(text: &str, file: &str) -> Result<Policy> {
        let doc = ConfigText::parse(text, file)?;
        let f: PolicyFile = doc.deserialize(|k| allowed(k).map(String::from))?;
        let bad = |key: &str, value: String| {
            doc.locate(Error::config(file, key, value, allowed(key).unwrap_or("")))
        };
        let level = OptLevel::parse(&f.opt_level)
            .ok_or_else(|| bad("opt_level", format!("{:?}", f.opt_level)))?;
        let mut p = Policy::opt_level(level);
        p.source = file.to_string();
        let dtype = |key: &str, s: &str, ok: &[DType]| {
            DType::parse(s)
                .filter(|d| ok.contains(d))
                .ok_or_else(|| bad(key, format!("{s:?}")))
        };
        if let Some(h) = &f.half_dtype {
            p.half_dtype = dtype("half_dtype", h, &[DType::F16, DType::BF16])?;
        }
        if let Some(t) = &f.cast_model_type {
            p.cast_model_type = Some(dtype(
                "cast_model_type",
                t,
                &[DType::F32, DType::F16, DType::BF16],
            )?);
        }
        let autocast_key = match (f.autocast, f.patch_torch_functions) {
            (Some(_), Some(v)) => {
                return Err(doc.locate(Error::config(
                    file,
                    "patch_torch_functions",
                    v.to_string(),
                    "only one of `autocast` and `patch_torch_functions` (apex's name for it); `autocast` is given too",
                )))
            }
            (Some(_), None) => "autocast",
            (None, Some(_)) => "patch_torch_functions",
            (None, None) => "",
        };
        p.autocast = f.autocast.or(f.patch_torch_functions);
        p.keep_batchnorm_fp32 = f.keep_batchnorm_fp32;
        p.master_weights = f.master_weights;
        p.loss_scale = match f.loss_scale {
            None => None,
            Some(LossScaleToml::Number(v)) => Some(LossScale::Static(v)),
            Some(LossScaleToml::Name(s)) if s == "dynamic" => Some(LossScale::Dynamic),
            Some(LossScaleToml::Name(s)) => return Err(bad("loss_scale", format!("{s:?}"))),
        };
        macro_rules! set {
            ($($field:ident),*) => {$(
                if let Some(v) = f.$field {
                    p.$field = v;
                }
            )*};
        }
        set!(
            init_scale,
            scale_window,
            growth_factor,
            backoff_factor,
            max_loss_scale,
            num_losses,
            verbosity,
            report_interval
        );
        p.min_loss_scale = f.min_loss_scale;
        if let Some(ops) = &f.ops {
            for (list, class) in OP_LISTS {
                for name in ops.list(list) {
                    let op = OpKind::from_name(name).ok_or_else(|| {
                        doc.locate(Error::config(
                            file,
                            format!("ops.{list}"),
                            format!("{name:?}"),
                            format!("`{name}` is not an op; {}", known_ops()),
                        ))
                    })?;
                    p.op_classes.push((op, class));
                }
            }
        }
        p.validate().map_err(|e| match e {
            // Name the key as the file spells it.
            Error::Config {
                file,
                at,
                key,
                value,
                allowed,
            } if key == "autocast" => doc.locate(Error::Config {
                file,
                at,
                key: autocast_key.into(),
                value,
                allowed,
            }),
            e => doc.locate(e),
        })?;
        Ok(p)
    }
}

/// A policy file as written (every key but `opt_level` optional; [`Policy::parse_toml`] turns
/// it into a [`Policy`] and checks it).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    opt_level: String,
    half_dtype: Option<String>,
    cast_model_type: Option<String>,
    autocast: Option<bool>,
    patch_torch_functions: Option<bool>,
    keep_batchnorm_fp32: Option<bool>,
    master_weights: Option<bool>,
    loss_scale: Option<LossScaleToml>,
    init_scale: Option<f64>,
    scale_window: Option<u64>,
    growth_factor: Option<f64>,
    backoff_factor: Option<f64>,
    min_loss_scale: Option<f64>,
    max_loss_scale: Option<f64>,
    num_losses: Option<usize>,
    verbosity: Option<u8>,
    report_interval: Option<u64>,
    ops: Option<OpsFile>,
}
/// A policy file's `[ops]` table: op names by the class they move to.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpsFile {
    half: Option<Vec<String>>,
    float: Option<Vec<String>>,
    promote: Option<Vec<String>>,
    passthrough: Option<Vec<String>>,
}

impl OpsFile {
    /// The names of list `list` (one of [`OP_LISTS`]).
    fn list(&self, list: &str) -> &[String] {
        let l = match list {
            "half" => &self.half,
            "float" => &self.float,
            "promote" => &self.promote,
            _ => &self.passthrough,
        };
        l.as_deref().unwrap_or(&[])
    }
}

/// `loss_scale = "dynamic"` or a number (an integer is a number too).
#[derive(Deserialize)]
#[serde(untagged)]
enum LossScaleToml {
    Number(f64),
    Name(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every policy file in `configs/` (those whose name starts with `O`) is built in, and the
    /// built-in policy is the one the file gives.
    #[test]
    fn every_shipped_policy_is_built_in_and_equals_its_file() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('O') && n.ends_with(".toml"))
            .map(|n| n.trim_end_matches(".toml").to_string())
            .collect();
        files.sort();
        let mut names: Vec<String> = BUILTIN_POLICIES
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        names.sort();
        assert_eq!(files, names, "configs/O*.toml and BUILTIN_POLICIES differ");
        for name in &names {
            let builtin = Policy::builtin(name).unwrap();
            let mut file = Policy::from_toml_file(dir.join(format!("{name}.toml"))).unwrap();
            assert_eq!(builtin.source, format!("configs/{name}.toml"));
            file.source = builtin.source.clone();
            assert_eq!(builtin, file, "{name}");
            assert_eq!(builtin.opt_level.as_str(), &name[..2]);
        }
    }

    #[test]
    fn an_unknown_builtin_name_is_an_error_listing_the_names() {
        let e = Policy::builtin("O4").unwrap_err().to_string();
        assert!(e.contains("\"O4\"") && e.contains("O2_bf16"), "{e}");
    }
}
