//! A client of PyTorch's c10d `TCPStore` protocol, for the store that torchrun's agent serves on
//! `MASTER_ADDR:MASTER_PORT` and announces with `TORCHELASTIC_USE_AGENT_STORE=True`.
//!
//! It owns the wire format below, the key prefix of one restart attempt, the sealing of every
//! value it writes (see [`seal`](super::seal)) and the refusal of every value it reads that does
//! not open, and the emulation of ephemeral keys (deleted when the client is dropped). It must
//! not host a store, must not be used where our own store runs (under `launch`: that one
//! authenticates every connection with the run id, this protocol authenticates nobody), must not
//! hand its caller a value it has not opened, and must not let a peer that sends junk or goes
//! silent panic or hang it: every read has a deadline and every announced length a limit.
//!
//! Wire format (PyTorch 2.x, `torch/csrc/distributed/c10d/TCPStore.cpp`, `TCPStoreBackend.cpp`,
//! `TCPStoreLibUvBackend.cpp`; checked against torch 2.11.0's server, libuv and classic
//! backends, by this module's tests). A query is one byte, its type, then its arguments;
//! integers are in the host's byte order (little-endian on every platform PyTorch ships for:
//! we write and read little-endian); a string or a byte vector is a `u64` length, then the
//! bytes. Queries and their answers:
//!
//! | query | type | arguments | answer |
//! |---|---|---|---|
//! | VALIDATE | 0 | `u32` 0x3C85F7CE | none; must be the first query, or the server ignores the connection |
//! | SET | 1 | key, value | none |
//! | GET | 3 | key | value (libuv: empty for a missing key; classic: closes the connection) |
//! | ADD | 4 | key, `i64` delta | `i64` new value (kept as decimal text; on a value that is not, the server closes the connection) |
//! | CHECK | 5 | `u64` count, keys | `u8` READY 0 / NOT_READY 1 |
//! | WAIT | 6 | `u64` count, keys | `u8` STOP_WAITING 0 once every key exists (the server has no timeout) |
//! | DELETE_KEY | 8 | key | `i64` keys deleted |
//! | MULTI_GET | 10 | `u64` count, keys | one value per key |
//! | CANCEL_WAIT | 12 | none | `u8` WAIT_CANCELED 1 (after a STOP_WAITING 0 when the wait had just ended) |
//! | PING | 13 | `u32` nonce | the same `u32` |
//!
//! The libuv server closes a connection that sends a key over 8 KiB, a value over 8 MiB, or
//! more than 128 Ki keys in one query; this client refuses to send those instead.
//!
//! How our client uses it: connect sends VALIDATE and a PING and waits for the echo (a peer that
//! stays silent is not a store; one that closes is retried until the deadline). Every key goes
//! on the wire as `/` (what PyTorch's client puts in front of every key), a prefix
//! (`gptrec/attempt-N/`, see [`rendezvous`](super::rendezvous)), so that a restarted group never
//! reads its predecessor's keys, then the key. `set` sends SET then PING and returns
//! when the echo comes, so an error surfaces at the call that caused it; `get` is CHECK then
//! GET; `wait` is WAIT, on its timeout CANCEL_WAIT (then CHECK for the keys still missing), and
//! MULTI_GET once every key exists.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::connect::{connect_any, connect_with_retries, request_timeout, Attempt};
use super::seal::{Seal, OVERHEAD};
use super::*;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const MULTI_GET: u8 = 10;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;

/// What VALIDATE carries (`validationMagicNumber` in `TCPStoreBackend.hpp`).
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// The libuv server's limits (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`, `MAX_KEY_COUNT`).
const MAX_KEY_BYTES: usize = 8 << 10;
const MAX_VALUE_BYTES: usize = 8 << 20;
const MAX_KEYS: usize = 128 << 10;
/// How long a dropped client spends deleting its ephemeral keys, at most per answer.
const DROP_TIMEOUT: Duration = Duration::from_secs(1);

/// The agent stores this process has connected to: address and key prefix, so that a second
/// connection of the same rank ([`StoreClient::connect`] to that address) speaks this protocol.
static AGENT_STORES: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Records that `addr` is torchrun's agent store, its keys under `prefix`.
pub(crate) fn remember_agent_store(addr: &str, prefix: &str) {
    let mut stores = AGENT_STORES.lock().unwrap_or_else(PoisonError::into_inner);
    stores.retain(|(known, _)| known != addr);
    stores.push((addr.to_string(), prefix.to_string()));
}

/// The key prefix of the agent store at `addr`, if this process connected to one there.
pub(crate) fn agent_store_prefix(addr: &str) -> Option<String> {
    let stores = AGENT_STORES.lock().unwrap_or_else(PoisonError::into_inner);
    stores
        .iter()
        .find(|(known, _)| known == addr)
        .map(|(_, prefix)| prefix.clone())
}

/// One query, built as the server reads it.
struct Query(Vec<u8>);

impl Query {
    fn new(kind: u8) -> Query {
        Query(vec![kind])
    }
    fn u32(mut self, value: u32) -> Query {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }
    fn u64(mut self, value: u64) -> Query {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }
    fn i64(mut self, value: i64) -> Query {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }
    fn bytes(self, bytes: &[u8]) -> Query {
        let mut query = self.u64(bytes.len() as u64);
        query.0.extend_from_slice(bytes);
        query
    }
    fn keys(self, keys: &[String]) -> Query {
        let query = self.u64(keys.len() as u64);
        keys.iter().fold(query, |q, key| q.bytes(key.as_bytes()))
    }
    fn then(mut self, next: Query) -> Query {
        self.0.extend_from_slice(&next.0);
        self
    }
}

/// An answer that cannot be one: the peer is not (or no longer) a store we understand.
fn junk(detail: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail)
}

fn read_array<const N: usize>(stream: &mut TcpStream) -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn read_u8(stream: &mut TcpStream) -> io::Result<u8> {
    Ok(read_array::<1>(stream)?[0])
}

fn read_i64(stream: &mut TcpStream) -> io::Result<i64> {
    Ok(i64::from_le_bytes(read_array(stream)?))
}

/// A length-prefixed value, at most [`MAX_FRAME_BYTES`] (nothing is allocated beyond that).
fn read_value(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let len = u64::from_le_bytes(read_array(stream)?);
    let len = usize::try_from(len)
        .ok()
        .filter(|&len| len <= MAX_FRAME_BYTES)
        .ok_or_else(|| {
            junk(format!(
                "a value of {len} bytes announced, over the {MAX_FRAME_BYTES}-byte limit"
            ))
        })?;
    let mut value = vec![0u8; len];
    stream.read_exact(&mut value)?;
    Ok(value)
}

/// The answer to PING `nonce`.
fn read_pong(stream: &mut TcpStream, nonce: u32) -> io::Result<()> {
    let echoed = u32::from_le_bytes(read_array(stream)?);
    if echoed != nonce {
        return Err(junk(format!("ping {nonce} answered with {echoed}")));
    }
    Ok(())
}

/// The answer to CHECK: whether every key exists.
fn read_check(stream: &mut TcpStream) -> io::Result<bool> {
    match read_u8(stream)? {
        READY => Ok(true),
        NOT_READY => Ok(false),
        other => Err(junk(format!("check answered with {other}"))),
    }
}

fn is_timeout(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// One connection to a c10d `TCPStore` (see the module's documentation).
pub(crate) struct C10dClient {
    stream: TcpStream,
    addr: String,
    /// Put in front of every key, after PyTorch's `/` (`gptrec/attempt-N/`).
    prefix: String,
    seal: Seal,
    /// Keys (prefixed) set with `set_ephemeral`, deleted when the client is dropped.
    ephemeral: Vec<String>,
    broken: Option<String>,
    io_timeout: Duration,
    /// The nonce of the next PING.
    pings: u32,
}

impl fmt::Debug for C10dClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("protocol", &"c10d")
            .field("prefix", &self.prefix)
            .field("broken", &self.broken)
            .finish()
    }
}

impl C10dClient {
    /// Connects to the c10d store at `addr`, retrying while nobody answers for up to `deadline`;
    /// keys go under `prefix`, values are sealed with `run_id` (which is never sent).
    pub(crate) fn connect(
        addr: &str,
        run_id: &str,
        prefix: &str,
        deadline: Duration,
    ) -> Result<C10dClient, StoreError> {
        let stream = connect_with_retries(addr, deadline, |end| Self::attempt(addr, end))?;
        tracing::debug!(addr, prefix, "connected to torchrun's agent store");
        Ok(C10dClient {
            stream,
            addr: addr.to_string(),
            prefix: prefix.to_string(),
            seal: Seal::new(run_id),
            ephemeral: Vec::new(),
            broken: None,
            io_timeout: IO_TIMEOUT,
            pings: 1,
        })
    }

    /// One connection and its validation: VALIDATE, then a PING whose echo must come back.
    fn attempt(addr: &str, end: Option<Instant>) -> Result<TcpStream, Attempt> {
        let remaining = || {
            end.map_or(Duration::MAX, |e| {
                e.saturating_duration_since(Instant::now())
            })
        };
        let mut stream = connect_any(addr, remaining, None)?;
        let retry_io = |err: io::Error| Attempt::Retry(describe_io(&err));
        stream.set_nodelay(true).map_err(retry_io)?;
        stream
            .set_write_timeout(Some(IO_TIMEOUT))
            .map_err(retry_io)?;
        let limit = remaining().clamp(Duration::from_secs(1), HANDSHAKE_TIMEOUT);
        stream.set_read_timeout(Some(limit)).map_err(retry_io)?;
        let nonce = std::process::id();
        let hello = Query::new(VALIDATE)
            .u32(VALIDATION_MAGIC)
            .then(Query::new(PING).u32(nonce));
        let answered = stream
            .write_all(&hello.0)
            .and_then(|()| read_pong(&mut stream, nonce));
        match answered {
            Ok(()) => Ok(stream),
            Err(err) if is_timeout(&err) => Err(Attempt::Fatal(StoreError::Silent {
                addr: addr.to_string(),
                waited: limit,
            })),
            Err(err) if err.kind() == io::ErrorKind::InvalidData => {
                Err(Attempt::Fatal(StoreError::Protocol {
                    addr: addr.to_string(),
                    detail: format!(
                        "{err} while validating; is something other than PyTorch's TCPStore \
                         listening there?"
                    ),
                }))
            }
            Err(err) => Err(Attempt::Retry(format!(
                "{} while validating",
                describe_io(&err)
            ))),
        }
    }

    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    pub(crate) fn set_io_timeout(&mut self, timeout: Duration) -> Result<(), StoreError> {
        self.io_timeout = request_timeout(&self.stream, &self.addr, timeout)?;
        Ok(())
    }

    /// SET, then a PING whose echo says that the server has the value.
    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let full = self.full_key(key)?;
        let sealed = self
            .seal
            .seal(&full, value)
            .map_err(|reason| StoreError::Protocol {
                addr: self.addr.clone(),
                detail: format!("cannot seal the value of {key:?}: {reason}"),
            })?;
        if sealed.len() > MAX_VALUE_BYTES {
            return Err(StoreError::FrameTooLarge {
                addr: self.addr.clone(),
                len: value.len(),
                limit: MAX_VALUE_BYTES - OVERHEAD,
            });
        }
        let nonce = self.next_ping();
        let query = Query::new(SET)
            .bytes(full.as_bytes())
            .bytes(&sealed)
            .then(Query::new(PING).u32(nonce));
        let op = || format!("set {key:?}");
        self.exchange(&op, &query, self.io_timeout, |s| read_pong(s, nonce))
    }

    /// `set`, and the key is deleted when this client is dropped.
    pub(crate) fn set_ephemeral(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.set(key, value)?;
        let full = self.full_key(key)?;
        if !self.ephemeral.contains(&full) {
            self.ephemeral.push(full);
        }
        Ok(())
    }

    /// CHECK, then GET when the key exists.
    pub(crate) fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let full = self.full_key(key)?;
        let op = || format!("get {key:?}");
        let check = Query::new(CHECK).keys(std::slice::from_ref(&full));
        if !self.exchange(&op, &check, self.io_timeout, read_check)? {
            return Ok(None);
        }
        let query = Query::new(GET).bytes(full.as_bytes());
        let sealed = self.exchange(&op, &query, self.io_timeout, read_value)?;
        self.open(key, &full, &sealed).map(Some)
    }

    /// WAIT (CANCEL_WAIT after `timeout`), then MULTI_GET.
    pub(crate) fn wait(
        &mut self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let full = self.full_keys(keys)?;
        let op = || format!("wait for {keys:?}");
        let query = Query::new(WAIT).keys(&full);
        let first = self.exchange(&op, &query, timeout, |s| match read_u8(s) {
            Ok(byte) => Ok(Some(byte)),
            Err(err) if is_timeout(&err) => Ok(None),
            Err(err) => Err(err),
        })?;
        let arrived = match first {
            Some(STOP_WAITING) => true,
            Some(other) => {
                let err = junk(format!("wait answered with {other}"));
                return Err(self.give_up(op(), err, timeout));
            }
            None => self.cancel_wait(&op)?,
        };
        if !arrived {
            let missing = self.missing(&op, keys, &full)?;
            return Err(StoreError::WaitTimeout {
                addr: self.addr.clone(),
                timeout,
                missing,
            });
        }
        let query = Query::new(MULTI_GET).keys(&full);
        let values = self.exchange(&op, &query, self.io_timeout, |s| {
            (0..full.len())
                .map(|_| read_value(s))
                .collect::<io::Result<Vec<_>>>()
        })?;
        (keys.iter().zip(&full).zip(values))
            .map(|((key, full), sealed)| self.open(key, full, &sealed))
            .collect()
    }

    /// Cancels a WAIT that timed out: whether its keys arrived meanwhile after all.
    fn cancel_wait(&mut self, op: &dyn Fn() -> String) -> Result<bool, StoreError> {
        let query = Query::new(CANCEL_WAIT);
        self.exchange(op, &query, self.io_timeout, |s| match read_u8(s)? {
            WAIT_CANCELED => Ok(false),
            STOP_WAITING => match read_u8(s)? {
                WAIT_CANCELED => Ok(true),
                other => Err(junk(format!("cancel-wait answered with {other}"))),
            },
            other => Err(junk(format!("cancel-wait answered with {other}"))),
        })
    }

    /// Of `keys` (prefixed: `full`), those that do not exist: one CHECK each, in one write.
    fn missing(
        &mut self,
        op: &dyn Fn() -> String,
        keys: &[&str],
        full: &[String],
    ) -> Result<Vec<String>, StoreError> {
        let query = full.iter().fold(Query(Vec::new()), |q, key| {
            q.then(Query::new(CHECK).keys(std::slice::from_ref(key)))
        });
        let present = self.exchange(op, &query, self.io_timeout, |s| {
            (0..full.len())
                .map(|_| read_check(s))
                .collect::<io::Result<Vec<_>>>()
        })?;
        Ok((keys.iter().zip(present))
            .filter(|(_, present)| !present)
            .map(|(key, _)| key.to_string())
            .collect())
    }

    /// ADD: the server keeps the counter as decimal text, in the clear.
    pub(crate) fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let full = self.full_key(key)?;
        let query = Query::new(ADD).bytes(full.as_bytes()).i64(delta);
        let op = || {
            format!(
                "add {key:?} (the store closes the connection on a value that is not a counter)"
            )
        };
        self.exchange(&op, &query, self.io_timeout, read_i64)
    }

    /// Sends `query` and reads its answer with `read` within `within`; a failure gives the
    /// connection up (the two sides may no longer agree on where an answer starts).
    fn exchange<T>(
        &mut self,
        op: &dyn Fn() -> String,
        query: &Query,
        within: Duration,
        read: impl FnOnce(&mut TcpStream) -> io::Result<T>,
    ) -> Result<T, StoreError> {
        if let Some(reason) = &self.broken {
            return Err(StoreError::Broken {
                addr: self.addr.clone(),
                reason: reason.clone(),
            });
        }
        let within = within.max(Duration::from_millis(1));
        let result = (self.stream.set_read_timeout(Some(within)))
            .and_then(|()| self.stream.write_all(&query.0))
            .and_then(|()| read(&mut self.stream));
        result.map_err(|err| self.give_up(op(), err, within))
    }

    /// The error for a failed exchange; the connection is unusable from now on.
    fn give_up(&mut self, op: String, err: io::Error, waited: Duration) -> StoreError {
        let addr = self.addr.clone();
        let error = if is_timeout(&err) {
            StoreError::NoAnswer { addr, op, waited }
        } else if err.kind() == io::ErrorKind::InvalidData {
            StoreError::Protocol {
                addr,
                detail: format!("{err} during {op}"),
            }
        } else {
            StoreError::Connection {
                addr,
                op,
                cause: err,
            }
        };
        self.broken = Some(error.to_string());
        error
    }

    /// The plaintext of the value read under `key`, or why it cannot be trusted.
    fn open(&self, key: &str, full: &str, sealed: &[u8]) -> Result<Vec<u8>, StoreError> {
        self.seal
            .open(full, sealed)
            .ok_or_else(|| StoreError::Unsealed {
                addr: self.addr.clone(),
                key: key.to_string(),
            })
    }

    /// `key` as it goes on the wire, if the server accepts a key that long: under this client's
    /// prefix, after the `/` that PyTorch's client puts in front of every key (its `keyPrefix_`),
    /// so that a PyTorch client reads our key `K` as `K` too.
    fn full_key(&self, key: &str) -> Result<String, StoreError> {
        let full = format!("/{}{key}", self.prefix);
        if full.len() > MAX_KEY_BYTES {
            return Err(StoreError::FrameTooLarge {
                addr: self.addr.clone(),
                len: full.len(),
                limit: MAX_KEY_BYTES,
            });
        }
        Ok(full)
    }

    fn full_keys(&self, keys: &[&str]) -> Result<Vec<String>, StoreError> {
        if keys.len() > MAX_KEYS {
            return Err(StoreError::FrameTooLarge {
                addr: self.addr.clone(),
                len: keys.len(),
                limit: MAX_KEYS,
            });
        }
        keys.iter().map(|key| self.full_key(key)).collect()
    }

    fn next_ping(&mut self) -> u32 {
        self.pings = self.pings.wrapping_add(1);
        self.pings
    }
}

impl Drop for C10dClient {
    /// Deletes the keys set with `set_ephemeral`, within [`DROP_TIMEOUT`] per answer, ignoring
    /// failures (the store may be gone already).
    fn drop(&mut self) {
        if self.broken.is_some() || self.ephemeral.is_empty() {
            return;
        }
        let query = self.ephemeral.iter().fold(Query(Vec::new()), |q, key| {
            q.then(Query::new(DELETE_KEY).bytes(key.as_bytes()))
        });
        let stream = &mut self.stream;
        let deleted = (stream.set_write_timeout(Some(DROP_TIMEOUT)))
            .and_then(|()| stream.set_read_timeout(Some(DROP_TIMEOUT)))
            .and_then(|()| stream.write_all(&query.0))
            .and_then(|()| (0..self.ephemeral.len()).try_for_each(|_| read_i64(stream).map(drop)));
        if let Err(err) = deleted {
            tracing::debug!(addr = %self.addr, "could not delete ephemeral keys: {err}");
        }
    }
}
