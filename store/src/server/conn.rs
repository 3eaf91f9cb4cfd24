//! One connection of the event loop: its socket, what it has sent that is not yet a whole frame,
//! what it has not yet been sent, where it stands in the handshake, its wait in progress and its
//! deadlines. It parses and writes frames; what a request means is the loop's business.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::Instant;

use mio::net::TcpStream;

use super::super::*;
use super::keys::PendingWait;

/// Bytes read from a socket per turn: a peer that floods is read in turns with the others.
pub(super) const READ_TURN: usize = 256 << 10;
/// Answers a connection may have unsent before its next requests wait for it to read them.
const UNSENT_LIMIT: usize = 1 << 20;

/// Where a connection stands in the handshake.
pub(super) enum Stage {
    /// Accepted; its `Hello` has not come yet. It must prove the run id by `by`.
    Hello { by: Instant },
    /// The challenge is sent; its proof has not come yet.
    Proof {
        by: Instant,
        client: auth::Nonce,
        server: auth::Nonce,
    },
    /// It proved the run id.
    Ready,
}

/// Why a connection ends.
pub(super) enum ConnEnd {
    /// The peer closed between frames, or the server is stopping.
    Quiet,
    /// The peer misbehaved or the socket failed; the reason is logged (and sent, if possible).
    Bad(String),
}

pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) stage: Stage,
    input: Vec<u8>,
    output: Vec<u8>,
    /// How much of `output` is written.
    written: usize,
    /// The peer closed its side (what it sent before still counts).
    pub(super) eof: bool,
    /// The kernel said the peer closed its side: read on to the end of input even after a
    /// short read (with edge-triggered polling, an end that arrived together with the last
    /// bytes raises no event of its own).
    pub(super) peer_closed: bool,
    /// Reading stopped with bytes possibly left in the socket (too much input unserved).
    pub(super) read_held: bool,
    /// When the peer last sent a byte (a frame left half sent too long ends the connection).
    last_read: Instant,
    /// When the peer last took a byte of its answers.
    last_write: Instant,
    pub(super) wait: Option<PendingWait>,
    /// Keys set with `SetEphemeral`: removed when the connection ends.
    pub(super) ephemeral: Vec<String>,
    /// The names of the wills this connection left (see [`super::keys::Wills`]).
    pub(super) wills: Vec<String>,
    /// The deadline the loop's timer holds for this connection.
    pub(super) scheduled: Option<Instant>,
}

impl Conn {
    pub(super) fn new(stream: TcpStream, peer: SocketAddr, hello_by: Instant) -> Conn {
        let now = Instant::now();
        Conn {
            stream,
            peer,
            stage: Stage::Hello { by: hello_by },
            input: Vec::new(),
            output: Vec::new(),
            written: 0,
            eof: false,
            peer_closed: false,
            read_held: false,
            last_read: now,
            last_write: now,
            wait: None,
            ephemeral: Vec::new(),
            wills: Vec::new(),
            scheduled: None,
        }
    }

    pub(super) fn proven(&self) -> bool {
        matches!(self.stage, Stage::Ready)
    }

    /// The largest frame this connection may send now.
    fn frame_limit(&self) -> usize {
        if self.proven() {
            MAX_FRAME_BYTES
        } else {
            PRE_HELLO_MAX_FRAME
        }
    }

    /// Reads what the socket has, up to [`READ_TURN`] bytes and never more than one frame
    /// beyond what is buffered; true when there may be more to read.
    /// `chunk` is the loop's scratch buffer (zeroed once, not per read).
    pub(super) fn read(&mut self, chunk: &mut [u8]) -> Result<bool, ConnEnd> {
        self.read_held = false;
        let mut taken = 0;
        while taken < READ_TURN && !self.eof {
            if self.input.len() > 4 + self.frame_limit() + chunk.len() {
                // Requests sent without reading the answers: wait for the peer to catch up (the
                // socket is read again once those are served: no new event will say so).
                self.read_held = true;
                return Ok(false);
            }
            match self.stream.read(chunk) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.input.extend_from_slice(&chunk[..n]);
                    self.last_read = Instant::now();
                    taken += n;
                    if n < chunk.len() && !self.peer_closed {
                        // A short read drained the socket; epoll reports what comes later.
                        return Ok(false);
                    }
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(ConnEnd::Bad(describe_io(&err))),
            }
        }
        Ok(!self.eof)
    }

    /// The next whole request the peer sent, if there is one.
    pub(super) fn next_request(&mut self) -> Result<Option<Request>, ConnEnd> {
        let Some(header) = self.input.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let limit = self.frame_limit();
        if len > limit {
            return Err(ConnEnd::Bad(format!(
                "frame of {len} bytes exceeds the {limit}-byte limit{}",
                if self.proven() {
                    ""
                } else {
                    " before the run id is proven"
                }
            )));
        }
        if self.input.len() < 4 + len {
            return Ok(None);
        }
        let request = decode_body(&self.input[4..4 + len]).map_err(ConnEnd::Bad);
        self.input.drain(..4 + len);
        if self.input.capacity() > 1 << 20 && self.input.len() < 1 << 16 {
            self.input.shrink_to(1 << 16);
        }
        request.map(Some)
    }

    /// Whether the peer left a frame half sent.
    pub(super) fn in_frame(&self) -> bool {
        !self.input.is_empty()
    }

    /// Why the peer's closing is bad, if it is: in the middle of a frame.
    pub(super) fn end_of_input(&self) -> ConnEnd {
        if self.input.is_empty() {
            ConnEnd::Quiet
        } else {
            ConnEnd::Bad(format!(
                "connection closed in the middle of a frame ({} bytes of it sent)",
                self.input.len()
            ))
        }
    }

    /// Queues `response`; the loop writes a connection's answers together once it has served
    /// what the connection sent ([`Conn::flush`]): one segment for a run of pipelined requests.
    pub(super) fn send(&mut self, response: &Response) -> Result<(), ConnEnd> {
        let frame = encode_frame(response).map_err(|len| {
            ConnEnd::Bad(format!(
                "answer of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
            ))
        })?;
        if self.output.is_empty() {
            self.last_write = Instant::now();
        }
        self.output.extend_from_slice(&frame);
        Ok(())
    }

    /// Writes queued answers until done or the socket is full.
    pub(super) fn flush(&mut self) -> Result<(), ConnEnd> {
        while self.written < self.output.len() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => return Err(ConnEnd::Bad("the peer stopped taking answers".into())),
                Ok(n) => {
                    self.written += n;
                    self.last_write = Instant::now();
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(ConnEnd::Bad(describe_io(&err))),
            }
        }
        self.output.clear();
        self.written = 0;
        if self.output.capacity() > 1 << 20 {
            self.output.shrink_to(1 << 16);
        }
        Ok(())
    }

    /// Whether answers wait to be written.
    pub(super) fn sending(&self) -> bool {
        !self.output.is_empty()
    }

    /// Whether the loop may answer its next request now: no wait in progress, and not too much
    /// unsent (a peer that does not read its answers is not served more).
    pub(super) fn ready_for_request(&self) -> bool {
        self.wait.is_none() && self.output.len() - self.written < UNSENT_LIMIT
    }

    /// The earliest moment something about this connection must be checked.
    pub(super) fn deadline(&self) -> Option<Instant> {
        let hello = match self.stage {
            Stage::Hello { by } | Stage::Proof { by, .. } => Some(by),
            Stage::Ready => None,
        };
        let wait = self.wait.as_ref().and_then(|w| w.deadline);
        let stall = self.in_frame().then(|| self.last_read + STALL_LIMIT);
        let write = self
            .sending()
            .then(|| self.last_write + SERVER_WRITE_TIMEOUT);
        [hello, wait, stall, write].into_iter().flatten().min()
    }

    /// What has run out at `now`, apart from the wait: the handshake's deadline, a half-sent
    /// frame, unread answers.
    pub(super) fn expired(
        &self,
        now: Instant,
        hello_deadline: std::time::Duration,
    ) -> Option<String> {
        if let Stage::Hello { by } | Stage::Proof { by, .. } = self.stage {
            if now >= by {
                return Some(format!(
                    "the run id was not proven within {:.1} s",
                    hello_deadline.as_secs_f64()
                ));
            }
        }
        if self.in_frame() && now >= self.last_read + STALL_LIMIT {
            return Some(format!(
                "peer stalled for {} s in the middle of a frame",
                STALL_LIMIT.as_secs()
            ));
        }
        if self.sending() && now >= self.last_write + SERVER_WRITE_TIMEOUT {
            return Some(format!(
                "peer took none of its answers for {} s",
                SERVER_WRITE_TIMEOUT.as_secs()
            ));
        }
        None
    }
}
