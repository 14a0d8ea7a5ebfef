//! The rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects (with
//! retries, since rank 0 may start later), says who it is, and waits for rank 0's welcome, which
//! carries a blob from rank 0 (the NCCL unique id). Rank 0 checks that every rank agrees (world
//! size, backend, build) and that no rank is missing or claimed twice; any disagreement, and a
//! rank that has not joined by the deadline, fails the rendezvous on every rank with a message
//! naming the rank. The links stay open afterwards: the control link of each rank to rank 0
//! (fault detection, see `control.rs`) and, for the CPU backend, a data link.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::env::LaunchEnv;
use super::wire::{read_frame, tag, write_frame, Dec, Enc, MAGIC, VERSION};
use crate::error::{Error, Result};

/// What a link carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkKind {
    Control = 0,
    Data = 1,
}

/// The links a rendezvous leaves: per peer rank (rank 0: every other rank; others: rank 0 only).
pub(crate) struct Links {
    pub(crate) control: Vec<Option<TcpStream>>,
    pub(crate) data: Vec<Option<TcpStream>>,
    /// Rank 0's blob, as every rank received it.
    pub(crate) blob: Vec<u8>,
}

/// What a rank says when it connects.
struct Hello {
    version: u32,
    kind: u8,
    rank: u64,
    world_size: u64,
    backend: u8,
    endian: u32,
}

const ENDIAN_MARK: u32 = 0x0102_0304;

impl Hello {
    fn encode(&self) -> Vec<u8> {
        Enc::new()
            .u32(MAGIC)
            .u32(self.version)
            .u8(self.kind)
            .u64(self.rank)
            .u64(self.world_size)
            .u8(self.backend)
            .0
            .into_iter()
            .chain(self.endian.to_ne_bytes())
            .collect()
    }

    fn decode(b: &[u8]) -> Option<Hello> {
        let mut d = Dec::new(b);
        if d.u32()? != MAGIC {
            return None;
        }
        let version = d.u32()?;
        let kind = d.u8()?;
        let rank = d.u64()?;
        let world_size = d.u64()?;
        let backend = d.u8()?;
        let rest = d.rest();
        let endian = u32::from_ne_bytes(rest.get(..4)?.try_into().ok()?);
        Some(Hello {
            version,
            kind,
            rank,
            world_size,
            backend,
            endian,
        })
    }
}

fn reject(culprit: Option<usize>, why: &str) -> Vec<u8> {
    Enc::new()
        .u64(culprit.map_or(u64::MAX, |c| c as u64))
        .str(why)
        .done()
}

fn dist_err(env: &LaunchEnv, culprit: Option<usize>, detail: impl Into<String>) -> Error {
    Error::Distributed {
        rank: env.rank,
        world_size: env.world_size,
        culprit,
        detail: detail.into(),
    }
}

/// Runs the rendezvous (see the module docs). `backend` is a code every rank must share;
/// `blob` is what rank 0 hands out (ignored on other ranks); `want_data` opens a data link per
/// peer too.
pub(crate) fn rendezvous(
    env: &LaunchEnv,
    backend: u8,
    want_data: bool,
    blob: &[u8],
    timeout: Duration,
) -> Result<Links> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        serve(env, backend, want_data, blob, timeout, deadline)
    } else {
        join(env, backend, want_data, timeout, deadline)
    }
}

fn serve(
    env: &LaunchEnv,
    backend: u8,
    want_data: bool,
    blob: &[u8],
    timeout: Duration,
    deadline: Instant,
) -> Result<Links> {
    let n = env.world_size;
    let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
        dist_err(
            env,
            None,
            format!(
                "rank 0 cannot listen on port {} for the rendezvous: {e} (is another run using \
                 it? choose another MASTER_PORT, or MIXPREC_MASTER_PORT under torchrun)",
                env.master_port
            ),
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| dist_err(env, None, format!("rendezvous listener: {e}")))?;
    let mut control: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut data: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let wanted = (n - 1) * if want_data { 2 } else { 1 };
    let mut joined = 0;
    let fail = |control: &mut Vec<Option<TcpStream>>, culprit: Option<usize>, why: String| {
        // Everyone who joined hears why the run cannot start.
        for s in control.iter_mut().flatten() {
            let _ = write_frame(s, tag::REJECT, &reject(culprit, &why));
        }
        dist_err(env, culprit, format!("rendezvous failed: {why}"))
    };
    while joined < wanted {
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..n)
                        .filter(|&r| control[r].is_none() || (want_data && data[r].is_none()))
                        .collect();
                    let why = format!(
                        "rank(s) {missing:?} did not join within {} s (are they running, with \
                         the same MASTER_ADDR/MASTER_PORT ({}:{}) and WORLD_SIZE = {n}?)",
                        timeout.as_secs(),
                        env.master_addr,
                        env.master_port
                    );
                    return Err(fail(&mut control, missing.first().copied(), why));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(dist_err(env, None, format!("rendezvous accept: {e}"))),
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_nodelay(true);
        // A connection that does not say hello in time is not one of ours: dropped.
        let hello_by = Instant::now() + Duration::from_secs(10).min(timeout);
        let hello = match read_frame(&mut s, Some(hello_by)) {
            Ok((tag::HELLO, b)) => Hello::decode(&b),
            _ => None,
        };
        let Some(h) = hello else {
            log::warn!("rendezvous: ignoring a connection from {peer} that is not a mixprec rank");
            continue;
        };
        let r = h.rank as usize;
        let why = if h.version != VERSION {
            Some(format!(
                "rank {r} runs protocol version {} and rank 0 version {VERSION} (different mixprec builds)",
                h.version
            ))
        } else if h.endian != ENDIAN_MARK {
            Some(format!("rank {r} has another byte order than rank 0"))
        } else if h.world_size as usize != n {
            Some(format!(
                "rank {r} was started with WORLD_SIZE = {} and rank 0 with {n}",
                h.world_size
            ))
        } else if r == 0 || r >= n {
            Some(format!(
                "a process at {peer} claims rank {r} (allowed: 1 to {}); two processes with RANK = 0?",
                n - 1
            ))
        } else if h.backend != backend {
            Some(format!(
                "rank {r} uses backend {} and rank 0 backend {}",
                super::collective::backend_name(h.backend),
                super::collective::backend_name(backend)
            ))
        } else {
            None
        };
        if let Some(why) = why {
            let _ = write_frame(&mut s, tag::REJECT, &reject(Some(r), &why));
            return Err(fail(&mut control, Some(r), why));
        }
        let slot = match h.kind {
            0 => &mut control[r],
            1 if want_data => &mut data[r],
            k => {
                let why =
                    format!("rank {r} opened a link of kind {k} that this backend does not use");
                return Err(fail(&mut control, Some(r), why));
            }
        };
        if slot.is_some() {
            let why = format!("two processes claim rank {r} (the second from {peer})");
            let _ = write_frame(&mut s, tag::REJECT, &reject(Some(r), &why));
            return Err(fail(&mut control, Some(r), why));
        }
        *slot = Some(s);
        joined += 1;
    }
    let welcome = Enc::new().bytes(blob).done();
    for (r, s) in control.iter_mut().enumerate().skip(1) {
        if let Some(s) = s.as_mut() {
            write_frame(s, tag::WELCOME, &welcome).map_err(|e| {
                dist_err(
                    env,
                    Some(r),
                    format!("rendezvous: rank {r} left before the welcome: {e}"),
                )
            })?;
        }
    }
    Ok(Links {
        control,
        data,
        blob: blob.to_vec(),
    })
}

fn resolve(env: &LaunchEnv) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            dist_err(
                env,
                Some(0),
                format!("cannot resolve MASTER_ADDR {:?}: {e}", env.master_addr),
            )
        })?
        .collect();
    if addrs.is_empty() {
        return Err(dist_err(
            env,
            Some(0),
            format!("MASTER_ADDR {:?} resolves to no address", env.master_addr),
        ));
    }
    Ok(addrs)
}

/// Connects to rank 0, retrying until `deadline` (rank 0 may not be listening yet).
fn connect(
    env: &LaunchEnv,
    addrs: &[SocketAddr],
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last = String::from("no attempt");
    loop {
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(dist_err(
                env,
                Some(0),
                format!(
                    "could not reach rank 0 at {}:{} within {} s (last error: {last}); is rank 0 \
                     running, and are MASTER_ADDR/MASTER_PORT the same on every rank?",
                    env.master_addr,
                    env.master_port,
                    timeout.as_secs()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn join(
    env: &LaunchEnv,
    backend: u8,
    want_data: bool,
    timeout: Duration,
    deadline: Instant,
) -> Result<Links> {
    let addrs = resolve(env)?;
    let hello = |kind: LinkKind| Hello {
        version: VERSION,
        kind: kind as u8,
        rank: env.rank as u64,
        world_size: env.world_size as u64,
        backend,
        endian: ENDIAN_MARK,
    };
    let io = |e: std::io::Error| dist_err(env, Some(0), format!("rendezvous with rank 0: {e}"));
    let mut ctl = connect(env, &addrs, timeout, deadline)?;
    write_frame(&mut ctl, tag::HELLO, &hello(LinkKind::Control).encode()).map_err(io)?;
    let data = if want_data {
        let mut d = connect(env, &addrs, timeout, deadline)?;
        write_frame(&mut d, tag::HELLO, &hello(LinkKind::Data).encode()).map_err(io)?;
        Some(d)
    } else {
        None
    };
    let (t, body) = read_frame(&mut ctl, Some(deadline)).map_err(|e| {
        dist_err(
            env,
            None,
            if e.kind() == std::io::ErrorKind::TimedOut {
                format!(
                    "rendezvous: rank 0 did not complete the rendezvous within {} s (some rank \
                     missing?)",
                    timeout.as_secs()
                )
            } else {
                format!("rendezvous: rank 0 closed the connection: {e}")
            },
        )
    })?;
    let mut d = Dec::new(&body);
    match t {
        tag::WELCOME => {
            let blob = d.bytes().unwrap_or_default().to_vec();
            let n = env.world_size;
            let mut control: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
            let mut dl: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
            control[0] = Some(ctl);
            dl[0] = data;
            Ok(Links {
                control,
                data: dl,
                blob,
            })
        }
        tag::REJECT => {
            let culprit = d
                .u64()
                .and_then(|c| usize::try_from(c).ok())
                .filter(|&c| c < env.world_size);
            let why = d.str().unwrap_or_default();
            Err(dist_err(
                env,
                culprit,
                format!("rendezvous failed (rank 0 says): {why}"),
            ))
        }
        other => Err(dist_err(
            env,
            Some(0),
            format!("rendezvous: unexpected message {other} from rank 0"),
        )),
    }
}
