//! Socket transfers of the ring, each bounded by a deadline: send to the next rank while
//! receiving (copying or adding) from the previous one.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::{as_bytes_mut, LinkFailure, Sink};

/// Sends `send` on `to_next` from a helper thread while this thread receives into `sink` from
/// `from_prev` (adding or copying piece by piece), both bounded by `deadline`.
pub(super) fn exchange(
    to_next: &mut TcpStream,
    from_prev: &mut TcpStream,
    send: &[u8],
    sink: Sink<'_>,
    scratch: &mut [f32],
    deadline: Instant,
) -> Result<(), LinkFailure> {
    std::thread::scope(|scope| {
        let sender =
            (!send.is_empty()).then(|| scope.spawn(|| write_all_until(to_next, send, deadline)));
        let received = match sink {
            Sink::Copy(dst) => {
                read_exact_until(from_prev, dst, deadline).map_err(LinkFailure::map_recv)
            }
            Sink::Add(dst) => {
                let mut result = Ok(());
                for part in dst.chunks_mut(scratch.len().max(1)) {
                    let piece = &mut scratch[..part.len()];
                    if let Err(e) = read_exact_until(from_prev, as_bytes_mut(piece), deadline) {
                        result = Err(e.map_recv());
                        break;
                    }
                    for (d, s) in part.iter_mut().zip(piece.iter()) {
                        *d += *s;
                    }
                }
                result
            }
        };
        let sent = match sender {
            Some(handle) => handle.join().unwrap_or_else(|_| {
                Err(LinkFailure::Send(std::io::Error::other(
                    "sender thread panicked",
                )))
            }),
            None => Ok(()),
        };
        // A timeout on either side is reported as a timeout (it names the silent ranks).
        match (received, sent) {
            (Err(LinkFailure::Timeout), _) | (_, Err(LinkFailure::Timeout)) => {
                Err(LinkFailure::Timeout)
            }
            (Err(e), _) | (_, Err(e)) => Err(e),
            (Ok(()), Ok(())) => Ok(()),
        }
    })
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

pub(super) fn write_all_until(
    stream: &mut TcpStream,
    mut data: &[u8],
    deadline: Instant,
) -> Result<(), LinkFailure> {
    while !data.is_empty() {
        let left = remaining(deadline).ok_or(LinkFailure::Timeout)?;
        stream
            .set_write_timeout(Some(left))
            .map_err(LinkFailure::Send)?;
        match stream.write(data) {
            Ok(0) => return Err(LinkFailure::Send(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(LinkFailure::Timeout),
            Err(e) => return Err(LinkFailure::Send(e)),
        }
    }
    Ok(())
}

/// Fills `buf` from `stream`; failures come back as `Send` and are re-labelled by the caller.
pub(super) fn read_exact_until(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), LinkFailure> {
    while !buf.is_empty() {
        let left = remaining(deadline).ok_or(LinkFailure::Timeout)?;
        stream
            .set_read_timeout(Some(left))
            .map_err(LinkFailure::Send)?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(LinkFailure::Send(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection (did it exit?)",
                )))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(LinkFailure::Timeout),
            Err(e) => return Err(LinkFailure::Send(e)),
        }
    }
    Ok(())
}
