//! The byte format of mixprec's own TCP links (rendezvous, control plane, the CPU backend's
//! data): frames of `tag: u8, len: u64 (LE), payload`, and a little encoder/decoder for payloads.
//! Reads take a deadline, so that no wait on a peer is unbounded unless asked for.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// "MXPR": the first word of every hello.
pub(crate) const MAGIC: u32 = 0x4d58_5052;
/// Bumped whenever a frame's layout changes: ranks of different builds refuse each other.
pub(crate) const VERSION: u32 = 1;

pub(crate) mod tag {
    // rendezvous
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const REJECT: u8 = 3;
    // control plane
    pub const FAULT: u8 = 10;
    pub const GOODBYE: u8 = 11;
    pub const PROGRESS: u8 = 12;
    pub const GATHER: u8 = 13;
    pub const GATHER_RESULT: u8 = 14;
    // the CPU backend's collectives
    pub const DATA: u8 = 20;
}

/// Frames bigger than this are refused on read (a corrupt length must not allocate terabytes).
const MAX_FRAME: u64 = 1 << 40;

pub(crate) fn write_frame(w: &mut TcpStream, tag: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = tag;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

/// A frame with a header and a body written back to back (no copy of the body).
pub(crate) fn write_frame2(w: &mut TcpStream, tag: u8, head: &[u8], body: &[u8]) -> io::Result<()> {
    let mut h = [0u8; 9];
    h[0] = tag;
    h[1..].copy_from_slice(&((head.len() + body.len()) as u64).to_le_bytes());
    w.write_all(&h)?;
    w.write_all(head)?;
    w.write_all(body)?;
    w.flush()
}

/// Fills `buf` from `r`, failing with `TimedOut` at `deadline` (None: waits as long as it takes).
pub(crate) fn read_exact_by(
    r: &mut TcpStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
                }
                r.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            }
            None => r.set_read_timeout(None)?,
        }
        match r.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ))
            }
            Ok(n) => filled += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn read_frame(
    r: &mut TcpStream,
    deadline: Option<Instant>,
) -> io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    read_exact_by(r, &mut head, deadline)?;
    let len = u64::from_le_bytes(head[1..].try_into().unwrap_or([0; 8]));
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (corrupt stream?)"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    read_exact_by(r, &mut body, deadline)?;
    Ok((head[0], body))
}

/// Builds a payload.
#[derive(Default)]
pub(crate) struct Enc(pub(crate) Vec<u8>);

impl Enc {
    pub(crate) fn new() -> Enc {
        Enc(Vec::new())
    }
    pub(crate) fn u8(mut self, v: u8) -> Enc {
        self.0.push(v);
        self
    }
    pub(crate) fn u32(mut self, v: u32) -> Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(mut self, v: u64) -> Enc {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn bytes(mut self, v: &[u8]) -> Enc {
        self = self.u64(v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    pub(crate) fn str(self, v: &str) -> Enc {
        self.bytes(v.as_bytes())
    }
    pub(crate) fn done(self) -> Vec<u8> {
        self.0
    }
}

/// Reads a payload; every getter fails (None) past the end instead of panicking.
pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Dec<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf, at: 0 }
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.buf.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    pub(crate) fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.take(n)
    }
    pub(crate) fn str(&mut self) -> Option<String> {
        Some(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    /// Everything not read yet.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.at.min(self.buf.len())..];
        self.at = self.buf.len();
        s
    }
}
