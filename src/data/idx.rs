//! The IDX file format of MNIST and Fashion-MNIST (<http://yann.lecun.com/exdb/mnist/>), raw or
//! gzip'd (detected from the gzip magic bytes, not from the file name).
//!
//! An IDX file is a big-endian header — two zero bytes, a type code (0x08 = unsigned byte, the
//! only type MNIST-style files use), the number of dimensions — then one u32 per dimension, then
//! the data in row-major order. Images are 3-d (`count × rows × cols`, magic 0x00000803), labels
//! 1-d (`count`, magic 0x00000801).
//!
//! Reading never trusts the header for an allocation: the data are read through a `take` of the
//! expected size plus one byte, so a corrupt header cannot make us reserve gigabytes, and a file
//! whose length does not match its header is an error that says by how much.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

use crate::error::{Error, Result};

/// Magic number of a 3-d unsigned-byte IDX file (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of a 1-d unsigned-byte IDX file (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const FORMAT: &str = "IDX";

/// A stack of `count` grey-scale images of `rows × cols` bytes, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxImages {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    /// `count * rows * cols` pixels, image after image.
    pub pixels: Vec<u8>,
}

impl IdxImages {
    /// The pixels of image `i`, or `None` past the end.
    pub fn image(&self, i: usize) -> Option<&[u8]> {
        let n = self.rows.checked_mul(self.cols)?;
        self.pixels
            .get(i.checked_mul(n)?..i.checked_add(1)?.checked_mul(n)?)
    }
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::DataFormat {
        path: path.display().to_string(),
        format: FORMAT,
        detail: detail.into(),
    }
}

/// Turns a read error into the error a user should see: a gzip stream that is corrupt or cut
/// short is a data-format problem of the file, anything else (permissions, ...) is I/O.
fn read_err(path: &Path, gz: bool, what: &str, e: std::io::Error) -> Error {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::UnexpectedEof if gz => bad(
            path,
            format!("gzip stream ends early while reading the {what} (truncated file?)"),
        ),
        ErrorKind::UnexpectedEof => bad(path, format!("file ends inside the {what} (truncated)")),
        ErrorKind::InvalidData | ErrorKind::InvalidInput if gz => {
            bad(path, format!("corrupt gzip data in the {what}: {e}"))
        }
        _ => Error::io(format!("reading {}", path.display()), e),
    }
}

/// Reads a u8 IDX file whose magic must be `expected_magic`; returns its dims and data.
fn read_u8_idx(path: &Path, expected_magic: u32) -> Result<(Vec<usize>, Vec<u8>)> {
    let file = File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut raw = BufReader::new(file);
    // Peek at the first two bytes to tell gzip from raw IDX.
    let mut head = [0u8; 2];
    let got = read_fully(&mut raw, &mut head)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let gz = got == 2 && head == GZIP_MAGIC;
    let prefix = std::io::Cursor::new(head[..got].to_vec());
    let mut reader: Box<dyn Read> = if gz {
        Box::new(MultiGzDecoder::new(prefix.chain(raw)))
    } else {
        Box::new(prefix.chain(raw))
    };

    let mut magic = [0u8; 4];
    reader
        .read_exact(&mut magic)
        .map_err(|e| read_err(path, gz, "4-byte magic number", e))?;
    let magic = u32::from_be_bytes(magic);
    if magic != expected_magic {
        let what = |m: u32| match m {
            IMAGES_MAGIC => " (an images file)".to_string(),
            LABELS_MAGIC => " (a labels file)".to_string(),
            m if m >> 16 != 0 => " (not an IDX file: the first two bytes must be zero)".to_string(),
            m if (m >> 8) & 0xff != 0x08 => format!(
                " (element type 0x{:02x}; only unsigned bytes, 0x08, are supported)",
                (m >> 8) & 0xff
            ),
            m => format!(" (a {}-d unsigned-byte file)", m & 0xff),
        };
        return Err(bad(
            path,
            format!(
                "magic number 0x{magic:08x}{} where 0x{expected_magic:08x}{} was expected",
                what(magic),
                what(expected_magic)
            ),
        ));
    }
    let ndims = (magic & 0xff) as usize;
    let mut dims = Vec::with_capacity(ndims);
    for d in 0..ndims {
        let mut b = [0u8; 4];
        reader
            .read_exact(&mut b)
            .map_err(|e| read_err(path, gz, &format!("header (size of dimension {d})"), e))?;
        dims.push(u32::from_be_bytes(b) as usize);
    }
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            bad(
                path,
                format!("dimensions {dims:?} overflow the address space"),
            )
        })?;
    let mut data = Vec::new();
    reader
        .by_ref()
        .take(expected as u64 + 1)
        .read_to_end(&mut data)
        .map_err(|e| read_err(path, gz, "data", e))?;
    if data.len() < expected {
        let what = if gz {
            "gzip stream ends early"
        } else {
            "file is truncated"
        };
        return Err(bad(
            path,
            format!(
                "{what}: header says dimensions {dims:?} ({expected} bytes of data) but only {} bytes follow",
                data.len()
            ),
        ));
    }
    if data.len() > expected {
        return Err(bad(
            path,
            format!("trailing bytes after the {expected} bytes of data that dimensions {dims:?} describe"),
        ));
    }
    Ok((dims, data))
}

/// Reads into `buf` until it is full or the reader ends; returns how many bytes were read.
fn read_fully(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads an images file (magic 0x00000803), gzip'd or raw.
pub fn read_images(path: impl AsRef<Path>) -> Result<IdxImages> {
    let path = path.as_ref();
    let (dims, pixels) = read_u8_idx(path, IMAGES_MAGIC)?;
    let (count, rows, cols) = (dims[0], dims[1], dims[2]);
    if count > 0 && (rows == 0 || cols == 0) {
        return Err(bad(
            path,
            format!("images of size {rows}×{cols} (dimensions {dims:?})"),
        ));
    }
    Ok(IdxImages {
        count,
        rows,
        cols,
        pixels,
    })
}

/// Reads a labels file (magic 0x00000801), gzip'd or raw.
pub fn read_labels(path: impl AsRef<Path>) -> Result<Vec<u8>> {
    Ok(read_u8_idx(path.as_ref(), LABELS_MAGIC)?.1)
}

fn u32_dim(path: &Path, name: &str, v: usize) -> Result<[u8; 4]> {
    u32::try_from(v).map(u32::to_be_bytes).map_err(|_| {
        Error::invalid_arg(
            "idx::write",
            "dimension",
            v,
            format!("{name} of {} must fit in a u32", path.display()),
        )
    })
}

/// Writes `data` as a u8 IDX file with `dims` to `path`, gzip'd when `path` ends in `.gz`.
/// The gzip header carries no time stamp, so the same input gives the same bytes.
/// The file is written to a temporary name and renamed, so a failure leaves no half-written file.
fn write_u8_idx(path: &Path, magic: u32, dims: &[usize], data: &[u8]) -> Result<()> {
    let expected = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if expected != Some(data.len()) {
        return Err(Error::invalid_arg(
            "idx::write",
            "data.len()",
            data.len(),
            format!("dimensions {dims:?} need their product of bytes"),
        ));
    }
    let mut header = magic.to_be_bytes().to_vec();
    for (i, &d) in dims.iter().enumerate() {
        header.extend_from_slice(&u32_dim(path, &format!("dimension {i}"), d)?);
    }
    let tmp = path.with_extension("tmp-write");
    let ioe = |e| Error::io(format!("writing {}", tmp.display()), e);
    let file = BufWriter::new(File::create(&tmp).map_err(ioe)?);
    let gz = path.extension().is_some_and(|e| e == "gz");
    let result = (|| -> std::io::Result<()> {
        if gz {
            let mut enc = GzEncoder::new(file, Compression::best());
            enc.write_all(&header)?;
            enc.write_all(data)?;
            enc.finish()?.flush()
        } else {
            let mut file = file;
            file.write_all(&header)?;
            file.write_all(data)?;
            file.flush()
        }
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(ioe(e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        Error::io(
            format!("renaming {} to {}", tmp.display(), path.display()),
            e,
        )
    })
}

/// Writes images as an IDX file (gzip'd when `path` ends in `.gz`).
pub fn write_images(path: impl AsRef<Path>, images: &IdxImages) -> Result<()> {
    write_u8_idx(
        path.as_ref(),
        IMAGES_MAGIC,
        &[images.count, images.rows, images.cols],
        &images.pixels,
    )
}

/// Writes labels as an IDX file (gzip'd when `path` ends in `.gz`).
pub fn write_labels(path: impl AsRef<Path>, labels: &[u8]) -> Result<()> {
    write_u8_idx(path.as_ref(), LABELS_MAGIC, &[labels.len()], labels)
}
