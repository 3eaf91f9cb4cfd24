//! HTTP for `fetch`: one `ureq` agent (rustls, the environment's `HTTPS_PROXY`/`HTTP_PROXY`/
//! `NO_PROXY`, connect and per-read timeouts), each transfer's total time bounded by its size
//! and a floor rate ([`Pace`]), HEAD and GET with redirects followed here (so a
//! `Range` header survives a hop to another host and a relative `Location` works), the hub's
//! `X-Linked-*` headers read, and network failures sorted into offline / HTTP status / transfer.
//!
//! Must not: write files, or know names, manifests or the cache.

use std::io;
use std::time::{Duration, Instant};

use ureq::http::{HeaderMap, StatusCode};
use ureq::{Agent, Body};

use crate::error::FetchError;

/// How many redirects one request may follow.
const MAX_HOPS: usize = 10;

/// The slowest average a transfer may keep, in bytes per second: a transfer of N bytes is
/// allowed the stall time plus N / FLOOR_RATE seconds (ml-1m's 5.9 MB: 90 s more; gpt2's
/// 548 MB: 2.3 h more) and is cut, like a stalled one (kept, resumed), once it takes longer.
/// So a server that sends a byte now and then, never quite stalling, cannot hold `fetch` for
/// hours. 64 KiB/s is about half a megabit.
pub const FLOOR_RATE: u64 = 64 * 1024;

/// How long to wait for a connection and for each read before giving up.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// DNS and TCP (and TLS) set-up.
    pub connect: Duration,
    /// The longest wait for the next bytes of an answer (a stalled server).
    pub stall: Duration,
}

/// The time one transfer is allowed, from when its answer's headers arrived: checked as its
/// bytes arrive (so at most one stall interval late, a read waiting that long at most).
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    start: Instant,
    allowed: Duration,
}

impl Pace {
    /// `Ok` while the transfer is within its allowance; then a retryable transfer failure
    /// naming `url`, the `got` bytes received, the time taken and the floor rate.
    pub fn check(&self, url: &str, got: u64) -> Result<(), FetchError> {
        let took = self.start.elapsed();
        if took <= self.allowed {
            return Ok(());
        }
        Err(FetchError::Transfer {
            url: url.to_string(),
            detail: format!(
                "too slow: {got} bytes in {:.1} s, below the floor of {} KiB/s (allowed {:.1} s)",
                took.as_secs_f64(),
                FLOOR_RATE / 1024,
                self.allowed.as_secs_f64()
            ),
        })
    }
}

/// An HTTP client; cheap to keep, reuses connections.
pub struct Client {
    agent: Agent,
    stall: Duration,
}

/// What a HEAD found (after relative redirects on the same host).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Head {
    /// Where to GET the file: an absolute redirect's target, else the URL that answered.
    pub download_url: String,
    /// `X-Linked-Etag` (the hub's SHA-256 of an LFS file), unquoted, lowercase.
    pub linked_etag: Option<String>,
    /// `X-Linked-Size`: the LFS file's size.
    pub linked_size: Option<u64>,
    /// `ETag`, unquoted.
    pub etag: Option<String>,
}

/// The answer to a GET: 200, 206 or 416; its body unread.
pub struct Reply {
    /// The URL that answered (after redirects).
    pub url: String,
    pub status: u16,
    pub content_length: Option<u64>,
    pub content_range: Option<ContentRange>,
    pub body: Body,
}

/// `Content-Range: bytes START-END/TOTAL` (TOTAL may be `*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentRange {
    pub start: u64,
    pub end: u64,
    pub total: Option<u64>,
}

impl Client {
    pub fn new(t: Timeouts) -> Client {
        let config = Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_resolve(Some(t.connect))
            .timeout_connect(Some(t.connect))
            .timeout_send_request(Some(t.stall))
            .timeout_recv_response(Some(t.stall))
            .timeout_per_read(Some(t.stall))
            .user_agent(concat!("gptrec-fetch/", env!("CARGO_PKG_VERSION")))
            .build();
        Client {
            agent: config.into(),
            stall: t.stall,
        }
    }

    /// HEAD `url`, following relative redirects (as `huggingface_hub` does) and stopping at an
    /// absolute one, whose target becomes the download URL. `X-Linked-*` are taken from the
    /// first answer that has them.
    pub fn head(&self, url: &str) -> Result<Head, FetchError> {
        let mut url = url.to_string();
        let mut found = Head::default();
        for _ in 0..MAX_HOPS {
            let resp = self
                .agent
                .head(&url)
                .call()
                .map_err(|e| self.request_error(&url, e))?;
            merge_head(&mut found, resp.headers());
            let status = resp.status();
            if let Some(loc) = redirect_target(status, resp.headers()) {
                let next = join_location(&url, &loc);
                if is_absolute(&loc) && authority(&next) != authority(&url) {
                    found.download_url = next;
                    return Ok(found);
                }
                url = next;
                continue;
            }
            check_status(&url, status)?;
            found.download_url = url;
            return Ok(found);
        }
        Err(too_many_redirects(&url))
    }

    /// GET `url` from byte `offset` (`Range: bytes=OFFSET-` when > 0), following redirects
    /// with the same `Range`. 200, 206 and 416 are answers; any other status is an error.
    pub fn get(&self, url: &str, offset: u64) -> Result<Reply, FetchError> {
        let mut url = url.to_string();
        for _ in 0..MAX_HOPS {
            let mut req = self.agent.get(&url);
            if offset > 0 {
                req = req.header("Range", format!("bytes={offset}-"));
            }
            let resp = req.call().map_err(|e| self.request_error(&url, e))?;
            let status = resp.status();
            if let Some(loc) = redirect_target(status, resp.headers()) {
                url = join_location(&url, &loc);
                continue;
            }
            if status.as_u16() != 416 {
                check_status(&url, status)?;
            }
            let headers = resp.headers();
            return Ok(Reply {
                status: status.as_u16(),
                content_length: header(headers, "content-length").and_then(|v| v.parse().ok()),
                content_range: header(headers, "content-range")
                    .and_then(|v| parse_content_range(&v)),
                body: resp.into_body(),
                url,
            });
        }
        Err(too_many_redirects(&url))
    }

    /// The allowance of a transfer of `expected` bytes, starting now: the stall time plus
    /// `expected` bytes at [`FLOOR_RATE`].
    pub fn pace(&self, expected: u64) -> Pace {
        let at_floor = Duration::from_secs_f64(expected as f64 / FLOOR_RATE as f64);
        Pace {
            start: Instant::now(),
            allowed: self.stall.saturating_add(at_floor),
        }
    }

    /// A failed request: offline, or another failure naming `url`.
    fn request_error(&self, url: &str, e: ureq::Error) -> FetchError {
        use ureq::Timeout as T;
        let unreachable = match &e {
            ureq::Error::HostNotFound | ureq::Error::ConnectionFailed => true,
            ureq::Error::Timeout(T::Resolve | T::Connect) => true,
            ureq::Error::Io(io) => is_unreachable(io),
            _ => false,
        };
        if unreachable {
            let detail = match &e {
                ureq::Error::Io(io) => io.to_string(),
                other => other.to_string(),
            };
            return FetchError::Unreachable {
                host: authority(url).to_string(),
                detail,
                hint: String::new(),
            };
        }
        let detail = match &e {
            ureq::Error::Timeout(_) => format!("no answer within {} s", self.stall.as_secs()),
            other => other.to_string(),
        };
        FetchError::Transfer {
            url: url.to_string(),
            detail,
        }
    }

    /// A failed read of a body: a stall, an early close, or another I/O error.
    pub fn read_error(&self, url: &str, e: &io::Error) -> FetchError {
        let stalled = matches!(
            e.get_ref()
                .and_then(|inner| inner.downcast_ref::<ureq::Error>()),
            Some(ureq::Error::Timeout(_))
        ) || e.kind() == io::ErrorKind::TimedOut;
        let detail = if stalled {
            format!("no data for {} s (stalled)", self.stall.as_secs())
        } else if e.kind() == io::ErrorKind::UnexpectedEof {
            "the connection closed before the end".to_string()
        } else {
            e.to_string()
        };
        FetchError::Transfer {
            url: url.to_string(),
            detail,
        }
    }
}

/// A failure to resolve or connect: refused, unreachable, timed out, or a failed DNS lookup
/// (std reports those as "failed to lookup address information: ...", of no stable kind).
fn is_unreachable(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    e.to_string()
        .starts_with("failed to lookup address information")
        || matches!(
            e.kind(),
            K::ConnectionRefused
                | K::HostUnreachable
                | K::NetworkUnreachable
                | K::NetworkDown
                | K::AddrNotAvailable
                | K::TimedOut
        )
}

fn check_status(url: &str, status: StatusCode) -> Result<(), FetchError> {
    if status.is_success() {
        return Ok(());
    }
    let reason = status.canonical_reason().unwrap_or("");
    Err(FetchError::Status {
        url: url.to_string(),
        status: format!("{} {reason}", status.as_u16())
            .trim_end()
            .to_string(),
    })
}

fn too_many_redirects(url: &str) -> FetchError {
    FetchError::Transfer {
        url: url.to_string(),
        detail: format!("more than {MAX_HOPS} redirects"),
    }
}

/// The `Location` of a redirect (301, 302, 303, 307, 308), if this is one.
fn redirect_target(status: StatusCode, headers: &HeaderMap) -> Option<String> {
    matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308)
        .then(|| header(headers, "location"))
        .flatten()
}

fn merge_head(found: &mut Head, headers: &HeaderMap) {
    if found.linked_etag.is_none() {
        found.linked_etag =
            header(headers, "x-linked-etag").map(|v| unquote_etag(&v).to_ascii_lowercase());
    }
    if found.linked_size.is_none() {
        found.linked_size = header(headers, "x-linked-size").and_then(|v| v.trim().parse().ok());
    }
    if found.etag.is_none() {
        found.etag = header(headers, "etag").map(|v| unquote_etag(&v));
    }
}

/// A header's value as text (names are case-insensitive in `HeaderMap`).
fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

/// An ETag without a weak `W/` prefix and without quotes.
pub fn unquote_etag(value: &str) -> String {
    let v = value.trim();
    let v = v.strip_prefix("W/").unwrap_or(v);
    v.trim_matches('"').to_string()
}

/// `bytes START-END/TOTAL` or `bytes START-END/*`.
pub fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let (start, end) = range.trim().split_once('-')?;
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some(ContentRange {
        start: start.trim().parse().ok()?,
        end: end.trim().parse().ok()?,
        total,
    })
}

fn is_absolute(location: &str) -> bool {
    location.contains("://") || location.starts_with("//")
}

/// `scheme://authority` of `url`.
fn origin(url: &str) -> &str {
    let after = url.find("://").map_or(0, |i| i + 3);
    match url[after..].find(['/', '?', '#']) {
        Some(i) => &url[..after + i],
        None => url,
    }
}

/// The host (and port) of `url`, without any user info, for messages.
pub fn authority(url: &str) -> &str {
    let o = origin(url);
    let host = o.find("://").map_or(o, |i| &o[i + 3..]);
    host.rsplit_once('@').map_or(host, |(_, h)| h)
}

/// `location` resolved against the URL that sent it (absolute, scheme-relative,
/// host-relative `/x`, or path-relative `x`).
pub fn join_location(base: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    if let Some(rest) = location.strip_prefix("//") {
        let scheme = base.split_once("://").map_or("https", |(s, _)| s);
        return format!("{scheme}://{rest}");
    }
    let origin = origin(base);
    if location.starts_with('/') {
        return format!("{origin}{location}");
    }
    let path = &base[origin.len()..];
    let path = path.split(['?', '#']).next().unwrap_or("");
    let dir = path.rfind('/').map_or("/", |i| &path[..=i]);
    format!("{origin}{dir}{location}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_lose_quotes_and_the_weak_prefix() {
        assert_eq!(unquote_etag("\"abc\""), "abc");
        assert_eq!(unquote_etag(" W/\"abc\" "), "abc");
        assert_eq!(unquote_etag("abc"), "abc");
    }

    #[test]
    fn hub_headers_are_read_case_insensitively_and_first_wins() {
        let mut h = HeaderMap::new();
        h.insert("X-Linked-Etag", "\"ABCDEF\"".parse().unwrap());
        h.insert("x-linked-size", " 42 ".parse().unwrap());
        h.insert("ETag", "W/\"e1\"".parse().unwrap());
        let mut found = Head::default();
        merge_head(&mut found, &h);
        let mut later = HeaderMap::new();
        later.insert("x-linked-size", "7".parse().unwrap());
        merge_head(&mut found, &later);
        assert_eq!(found.linked_etag.as_deref(), Some("abcdef"));
        assert_eq!(found.linked_size, Some(42));
        assert_eq!(found.etag.as_deref(), Some("e1"));
    }

    #[test]
    fn content_ranges_parse() {
        let r = |s| parse_content_range(s);
        assert_eq!(
            r("bytes 100-199/200"),
            Some(ContentRange {
                start: 100,
                end: 199,
                total: Some(200)
            })
        );
        assert_eq!(r("bytes 0-9/*").map(|c| c.total), Some(None));
        assert_eq!(r("bytes */200"), None);
        assert_eq!(r("items 0-1/2"), None);
    }

    #[test]
    fn locations_resolve_against_the_url_that_sent_them() {
        let base =
            "https://huggingface.co/openai-community/gpt2/resolve/main/model.safetensors?x=1";
        assert_eq!(
            join_location(base, "https://cas.example/a?b"),
            "https://cas.example/a?b"
        );
        assert_eq!(
            join_location(base, "//cas.example/a"),
            "https://cas.example/a"
        );
        assert_eq!(
            join_location(base, "/api/x"),
            "https://huggingface.co/api/x"
        );
        assert_eq!(
            join_location(base, "other.bin"),
            "https://huggingface.co/openai-community/gpt2/resolve/main/other.bin"
        );
        assert_eq!(
            join_location("http://127.0.0.1:9", "/a"),
            "http://127.0.0.1:9/a"
        );
        assert_eq!(join_location("http://h:1?q", "a"), "http://h:1/a");
    }

    #[test]
    fn a_transfer_is_allowed_the_stall_time_plus_its_bytes_at_the_floor_rate() {
        let client = Client::new(Timeouts {
            connect: Duration::from_secs(1),
            stall: Duration::from_secs(2),
        });
        let pace = client.pace(FLOOR_RATE * 3);
        assert_eq!(pace.allowed, Duration::from_secs(5));
        assert!(pace.check("u", 0).is_ok());
        let late = Pace {
            start: Instant::now() - Duration::from_secs(6),
            ..pace
        };
        let err = late.check("http://h/x.zip", 42).unwrap_err();
        assert!(err.is_transient());
        let line = err.to_string();
        assert!(
            line.starts_with("download of http://h/x.zip failed: too slow: 42 bytes in 6.0 s, below the floor of 64 KiB/s (allowed 5.0 s)"),
            "{line}"
        );
    }

    #[test]
    fn authorities_drop_user_info() {
        assert_eq!(
            authority("https://files.grouplens.org/datasets/x.zip"),
            "files.grouplens.org"
        );
        assert_eq!(authority("http://u:p@127.0.0.1:8080/x"), "127.0.0.1:8080");
        assert_eq!(authority("http://h"), "h");
    }
}
