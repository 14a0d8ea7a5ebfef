//! safetensors files: an 8-byte little-endian header length, a JSON header (each tensor's dtype,
//! shape and byte range, plus an optional `__metadata__` map of strings), then the raw
//! little-endian data. This is what `safetensors.torch.save_file` writes and what PyTorch and
//! Hugging Face load.
//!
//! The header is described with the `safetensors` crate's types and files are parsed and
//! validated by it; what this file adds is the conversion from and to [`Tensor`]s, an atomic
//! write, and errors that name the file and the tensor.
//!
//! Supported dtypes: F16, BF16, F32, F64 and I64 (mixprec's own). Files with other dtypes
//! (BOOL, U8, I32, F8 variants, ...) are refused with an error naming the tensor.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::backend::cpu::CpuStorage;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Shape, Storage, Tensor, WithDType};

use crate::util::write_atomic;

/// The dtypes mixprec reads and writes, as safetensors names them.
pub const SUPPORTED_DTYPES: &str = "F16, BF16, F32, F64, I64";

/// Tensors by name (`Vec<(String, Tensor)>`).
pub type NamedTensors = Vec<(String, Tensor)>;

/// The header's `__metadata__`: strings by key (`BTreeMap<String, String>`).
pub type Metadata = BTreeMap<String, String>;

const FORMAT: &str = "safetensors";
const METADATA_KEY: &str = "__metadata__";

fn to_st(d: DType) -> Dtype {
    match d {
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
    }
}

/// The safetensors name of a dtype (`F32`, `BF16`, ...).
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::I64 => "I64",
    }
}

fn from_st(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format: FORMAT,
        detail: detail.into(),
    }
}

// ---- writing -----------------------------------------------------------------------------------

/// Writes `tensors` (any device, any mixprec dtype; copied to the host one at a time) and
/// `metadata` to `path` as a safetensors file, atomically (see [`write_atomic`]): on any error
/// an existing `path` is left as it was. A name given twice, or the reserved `__metadata__`, is
/// an error. Tensors are laid out as the `safetensors` crate and Python package do (by dtype
/// alignment, then by name), so the bytes are the same as theirs for the same tensors.
pub fn write(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let mut order: Vec<&(String, Tensor)> = tensors.iter().collect();
    order.sort_by(|(ln, lt), (rn, rt)| {
        to_st(rt.dtype())
            .cmp(&to_st(lt.dtype()))
            .then_with(|| ln.cmp(rn))
    });
    let mut seen = std::collections::HashSet::with_capacity(order.len());
    if let Some((name, _)) = order.iter().find(|(n, _)| !seen.insert(n.as_str())) {
        return Err(Error::invalid_arg(
            "safetensors::write",
            "tensors",
            format!("`{name}` given twice (writing {})", path.display()),
            "each name once",
        ));
    }
    if order.iter().any(|(n, _)| n == METADATA_KEY) {
        return Err(Error::invalid_arg(
            "safetensors::write",
            "tensors",
            format!(
                "a tensor named `{METADATA_KEY}` (writing {})",
                path.display()
            ),
            "names other than the header's reserved `__metadata__`",
        ));
    }
    let header = header_bytes(&order, metadata)?;
    write_atomic(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|_| w.write_all(&header))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        for (name, t) in &order {
            write_data(w, t).map_err(|e| match e {
                Error::Io { source, .. } => Error::io(
                    format!("writing {}: tensor `{name}`", path.display()),
                    source,
                ),
                e => e,
            })?;
        }
        Ok(())
    })
}

/// The JSON header, padded with spaces to a multiple of 8 bytes (so that the data starts
/// aligned, as the format's writers do). Keys are sorted, so equal inputs give equal bytes.
fn header_bytes(
    order: &[&(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let json_err = |e: serde_json::Error| Error::invalid_arg("safetensors::write", "header", e, "");
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            METADATA_KEY.to_string(),
            serde_json::to_value(metadata).map_err(json_err)?,
        );
    }
    let mut offset = 0usize;
    for (name, t) in order {
        let len = t.elem_count() * t.dtype().size_in_bytes();
        let info = TensorInfo {
            dtype: to_st(t.dtype()),
            shape: t.dims().to_vec(),
            data_offsets: (offset, offset + len),
        };
        offset += len;
        map.insert(name.clone(), serde_json::to_value(info).map_err(json_err)?);
    }
    let mut bytes = serde_json::to_vec(&map).map_err(json_err)?;
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    Ok(bytes)
}

/// Writes `t`'s values little-endian, in blocks (the host copy of a device tensor is made once).
fn write_data(w: &mut dyn Write, t: &Tensor) -> Result<()> {
    with_le_bytes(t, w).map_err(|e| match e {
        Error::Io { source, .. } => Error::io("writing tensor data", source),
        e => e,
    })
}

/// Feeds `t`'s values, little-endian (the bytes a safetensors file holds), to `w` in blocks.
fn with_le_bytes(t: &Tensor, w: &mut dyn Write) -> Result<()> {
    // Files hold logical (row-major) tensors, whatever the memory format.
    let t = t.compact()?;
    let guard = t.storage();
    let host;
    let cpu = match &*guard {
        Storage::Cpu(s) => s,
        other => {
            host = other.to_cpu()?;
            &host
        }
    };
    let io = |e| Error::io("tensor data", e);
    match cpu {
        CpuStorage::F16(v) => put(w, v, |x| x.to_le_bytes()).map_err(io),
        CpuStorage::BF16(v) => put(w, v, |x| x.to_le_bytes()).map_err(io),
        CpuStorage::F32(v) => put(w, v, |x| x.to_le_bytes()).map_err(io),
        CpuStorage::F64(v) => put(w, v, |x| x.to_le_bytes()).map_err(io),
        CpuStorage::I64(v) => put(w, v, |x| x.to_le_bytes()).map_err(io),
    }
}

/// The CRC-32 (IEEE, as zlib's) of the bytes `t` occupies in a safetensors file: what a
/// checkpoint records per tensor and checks at load.
pub fn data_crc32(t: &Tensor) -> Result<u32> {
    struct Crc(crc32fast::Hasher);
    impl Write for Crc {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.update(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut crc = Crc(crc32fast::Hasher::new());
    with_le_bytes(t, &mut crc)?;
    Ok(crc.0.finalize())
}

/// The `__metadata__` of a safetensors file, reading only its header (not the tensor data).
pub fn read_metadata(path: &Path) -> Result<Metadata> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(path, format!("no 8-byte header length: {e}")))?;
    let n = u64::from_le_bytes(len);
    // The format's own limit: a larger header is not a safetensors file.
    const MAX_HEADER: u64 = 100_000_000;
    if n > MAX_HEADER {
        return Err(bad(
            path,
            format!("header length {n} is over the format's limit"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(path, format!("the {n}-byte header is cut short: {e}")))?;
    let map: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(path, format!("invalid header: {e}")))?;
    match map.get(METADATA_KEY) {
        None => Ok(Metadata::new()),
        Some(m) => serde_json::from_value(m.clone())
            .map_err(|e| bad(path, format!("invalid `{METADATA_KEY}`: {e}"))),
    }
}

fn put<T: Copy, const N: usize>(
    w: &mut dyn Write,
    values: &[T],
    le: impl Fn(T) -> [u8; N],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(N * values.len().min(1 << 16));
    for block in values.chunks(1 << 16) {
        buf.clear();
        for &x in block {
            buf.extend_from_slice(&le(x));
        }
        w.write_all(&buf)?;
    }
    Ok(())
}

// ---- reading -----------------------------------------------------------------------------------

/// Reads a safetensors file: CPU tensors **sorted by name** (whatever order the file stores
/// them in) and the header's `__metadata__` (empty when absent). A truncated or corrupt file,
/// an unsupported dtype or a byte range that does not match a tensor's shape and dtype is an
/// [`Error::DataFormat`] naming the file (and the tensor when the header names one).
pub fn read(path: &Path) -> Result<(NamedTensors, Metadata)> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    parse(path, &bytes)
}

/// [`read`] on the bytes of a file (`path` names it in errors).
pub fn parse(path: &Path, bytes: &[u8]) -> Result<(NamedTensors, Metadata)> {
    parse_some(path, bytes, &|_| true)
}

/// [`parse`] of the tensors whose names `keep` accepts; the others are not converted, so their
/// dtype may be one mixprec does not read (the BOOL attention masks of some Hugging Face files).
pub fn parse_some(
    path: &Path,
    bytes: &[u8],
    keep: &dyn Fn(&str) -> bool,
) -> Result<(NamedTensors, Metadata)> {
    let (n, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| bad(path, describe(&e, bytes)))?;
    let mut infos: Vec<(String, &TensorInfo)> = header.tensors().into_iter().collect();
    infos.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(infos.len());
    for (name, info) in infos {
        if !keep(&name) {
            continue;
        }
        // The parser checked that the ranges tile the data exactly; `get` keeps that a check.
        let (s, e) = info.data_offsets;
        let data = 8usize
            .checked_add(n)
            .and_then(|start| bytes.get(start..))
            .and_then(|d| d.get(s..e))
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor `{name}`: byte range {s}..{e} outside the file"),
                )
            })?;
        let Some(dtype) = from_st(info.dtype) else {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: dtype {:?} is not supported (supported: {SUPPORTED_DTYPES})",
                    info.dtype
                ),
            ));
        };
        let shape = Shape::new(info.shape.clone());
        let want = shape
            .checked_elem_count()
            .and_then(|n| n.checked_mul(dtype.size_in_bytes()));
        if want != Some(data.len()) {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: {} bytes of data for a {dtype} tensor of shape {:?}",
                    data.len(),
                    shape.dims()
                ),
            ));
        }
        let t = match dtype {
            DType::F16 => from_le(data, shape, f16::from_le_bytes),
            DType::BF16 => from_le(data, shape, bf16::from_le_bytes),
            DType::F32 => from_le(data, shape, f32::from_le_bytes),
            DType::F64 => from_le(data, shape, f64::from_le_bytes),
            DType::I64 => from_le(data, shape, i64::from_le_bytes),
        }
        .map_err(|e| bad(path, format!("tensor `{name}`: {e}")))?;
        out.push((name, t));
    }
    let metadata = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((out, metadata))
}

fn from_le<T: WithDType, const N: usize>(
    data: &[u8],
    shape: Shape,
    f: impl Fn([u8; N]) -> T,
) -> Result<Tensor> {
    let values: Vec<T> = data
        .chunks_exact(N)
        .map(|c| {
            let mut b = [0u8; N];
            b.copy_from_slice(c);
            f(b)
        })
        .collect();
    Tensor::from_vec(values, shape, Device::Cpu)
}

/// The parser's error, with the tensor it is about when the parser does not say (it names
/// none for a byte range that does not fit the shape and dtype).
fn describe(e: &SafeTensorError, bytes: &[u8]) -> String {
    use SafeTensorError as E;
    let what = match e {
        E::HeaderTooSmall => format!("{} bytes: shorter than the 8-byte header length", bytes.len()),
        E::InvalidHeaderLength => format!(
            "the header length ({}) runs past the end of the file ({} bytes): truncated or not a safetensors file",
            header_len(bytes).map_or("?".into(), |n| n.to_string()),
            bytes.len()
        ),
        E::HeaderTooLarge => format!(
            "header length {} is over the format's limit of 100 MB: not a safetensors file",
            header_len(bytes).map_or("?".into(), |n| n.to_string())
        ),
        E::MetadataIncompleteBuffer => format!(
            "the header's byte ranges do not end at the end of the file ({} bytes): truncated or extended",
            bytes.len()
        ),
        E::InvalidHeaderDeserialization(j) if j.to_string().contains("unknown variant") => format!(
            "invalid header: {j} (mixprec reads {SUPPORTED_DTYPES})"
        ),
        other => other.to_string(),
    };
    match (e, first_bad_tensor(bytes)) {
        (E::TensorInvalidInfo | E::ValidationOverflow | E::MisalignedSlice, Some(t)) => {
            format!("{what}: {t}")
        }
        _ => what,
    }
}

fn header_len(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

/// The first tensor (by offset) whose byte range does not hold its shape × dtype, described.
fn first_bad_tensor(bytes: &[u8]) -> Option<String> {
    let n = usize::try_from(header_len(bytes)?).ok()?;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut infos: Vec<(String, TensorInfo)> = map
        .into_iter()
        .filter(|(k, _)| k != METADATA_KEY)
        .filter_map(|(k, v)| Some((k, serde_json::from_value::<TensorInfo>(v).ok()?)))
        .collect();
    infos.sort_by_key(|(_, i)| i.data_offsets);
    infos.into_iter().find_map(|(name, i)| {
        let (s, e) = i.data_offsets;
        let bits = i
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(i.dtype.bitsize()));
        let ok = bits.is_some_and(|b| b % 8 == 0 && e.checked_sub(s) == Some(b / 8));
        (!ok).then(|| {
            format!(
                "tensor `{name}`: {:?} of shape {:?} does not fit its byte range {s}..{e}",
                i.dtype, i.shape
            )
        })
    })
}
