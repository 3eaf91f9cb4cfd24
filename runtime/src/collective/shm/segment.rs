//! One POSIX shared-memory segment, and how the members of a group come to map each other's:
//! each creates one (mode 0600, named by [`common::shm_segments`]), publishes its name in the
//! store, maps the others', and unlinks its own once every member has said it mapped them, so
//! nothing is left in `/dev/shm` however the processes end afterwards (the launcher sweeps what
//! dies inside that window). This module maps bytes; what they mean is the group's business.

use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::time::Duration;

use nix::fcntl::OFlag;
use nix::sys::mman::{mmap, munmap, shm_open, shm_unlink, MapFlags, ProtFlags};
use nix::sys::stat::Mode;

use crate::store::StoreClient;

/// One mapped segment: ours (created, then unlinked) or a peer's.
pub(super) struct Segment {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; which bytes each thread or process touches, and
// when, is governed by the group's progress protocol, not by ownership of this handle.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates and maps a new segment `name` of `len` bytes, reserving its pages now (so a full
    /// `/dev/shm` is an error here, not a SIGBUS later).
    fn create(name: &str, len: usize) -> Result<Segment, String> {
        let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR;
        let fd = shm_open(name, flags, Mode::S_IRUSR | Mode::S_IWUSR)
            .map_err(|e| format!("creating {name}: {e}"))?;
        let mapped = nix::fcntl::posix_fallocate(&fd, 0, len as libc::off_t)
            .map_err(|e| {
                format!("reserving {len} bytes for {name} (is /dev/shm full or small?): {e}")
            })
            .and_then(|()| Segment::map(&fd, name, len));
        if mapped.is_err() {
            let _ = shm_unlink(name);
        }
        mapped
    }

    /// Maps a peer's segment `name`, which must hold at least `len` bytes.
    fn open(name: &str, len: usize) -> Result<Segment, String> {
        let fd = shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| format!("opening {name}: {e}"))?;
        let size = nix::sys::stat::fstat(&fd)
            .map_err(|e| format!("reading the size of {name}: {e}"))?
            .st_size;
        if size < len as i64 {
            return Err(format!("{name} holds {size} bytes, expected {len}"));
        }
        Segment::map(&fd, name, len)
    }

    fn map(fd: &OwnedFd, name: &str, len: usize) -> Result<Segment, String> {
        let size = NonZeroUsize::new(len).ok_or_else(|| format!("{name}: empty segment"))?;
        let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        // SAFETY: a fresh shared mapping of a file we hold open; nothing else in this process
        // refers to the address range.
        let base = unsafe { mmap(None, size, prot, MapFlags::MAP_SHARED, fd, 0) }
            .map_err(|e| format!("mapping {name}: {e}"))?;
        Ok(Segment {
            base: base.cast(),
            len,
        })
    }

    /// The first byte of the mapping (page-aligned).
    pub(super) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of that length, unmapped once.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

/// Every member's segment of `len` bytes, in member order (ours at `me`, given to `init` before
/// anyone can see it), set up through the store under `{prefix}/*`. Every member reaches the same answer: `Ok(Err(why))` when any
/// member could not create or map a segment (nothing is left behind then either); `Err` only
/// when the store fails.
pub(super) fn share(
    store: &mut StoreClient,
    prefix: &str,
    ranks: &[usize],
    me: usize,
    len: usize,
    timeout: Duration,
    init: impl FnOnce(&Segment),
) -> Result<Result<Vec<Segment>, String>, String> {
    let rank = ranks[me];
    let name = common::shm_segments::segment_name(std::process::id(), &random_hex()?);
    let own = Segment::create(&name, len);
    if let Ok(own) = &own {
        init(own);
    }
    let published = match &own {
        Ok(_) => name.clone(),
        Err(why) => format!("!{why}"),
    };
    let key = format!("{prefix}/name");
    let names = exchange(store, &key, rank, ranks, &published, timeout)?;
    let mapped: Result<Vec<Option<Segment>>, String> =
        match names.iter().find(|n| n.starts_with('!')) {
            Some(failed) => Err(failed[1..].to_string()),
            None => (names.iter().enumerate())
                .map(|(j, n)| (j != me).then(|| Segment::open(n, len)).transpose())
                .collect(),
        };
    let own_name = own.is_ok().then_some(name.as_str());
    let all_mapped = settle(
        store,
        prefix,
        rank,
        ranks,
        mapped.is_ok(),
        own_name,
        timeout,
    )?;
    let (own, mut segments) = match (own, mapped) {
        (Err(why), _) | (_, Err(why)) => return Ok(Err(why)),
        (Ok(own), Ok(others)) => (own, others),
    };
    if !all_mapped {
        return Ok(Err("another rank could not map the segments".to_string()));
    }
    segments[me] = Some(own);
    Ok(Ok(segments.into_iter().flatten().collect()))
}

/// One segment of `len` bytes that every member maps (the same memory): member 0 creates it
/// (zeroed), the others open it, and member 0 unlinks it once every member has said whether it
/// mapped it. Every member reaches the same answer, as with [`share`].
pub(super) fn share_one(
    store: &mut StoreClient,
    prefix: &str,
    ranks: &[usize],
    me: usize,
    len: usize,
    timeout: Duration,
) -> Result<Result<Segment, String>, String> {
    let rank = ranks[me];
    let made = (me == 0).then(|| {
        let name = common::shm_segments::segment_name(std::process::id(), &random_hex()?);
        Segment::create(&name, len).map(|segment| (name, segment))
    });
    let published = match &made {
        Some(Ok((name, _))) => name.clone(),
        Some(Err(why)) => format!("!{why}"),
        None => String::new(), // only member 0's entry names the segment
    };
    let key = format!("{prefix}/name");
    let names = exchange(store, &key, rank, ranks, &published, timeout)?;
    let (name, mapped) = match made {
        Some(made) => (
            made.as_ref().ok().map(|(n, _)| n.clone()),
            made.map(|(_, s)| s),
        ),
        None => match names[0].strip_prefix('!') {
            Some(why) => (None, Err(why.to_string())),
            None => (None, Segment::open(&names[0], len)),
        },
    };
    let all_mapped = settle(
        store,
        prefix,
        rank,
        ranks,
        mapped.is_ok(),
        name.as_deref(),
        timeout,
    )?;
    let segment = match mapped {
        Ok(segment) => segment,
        Err(why) => return Ok(Err(why)),
    };
    if !all_mapped {
        return Ok(Err("another rank could not map the segment".to_string()));
    }
    Ok(Ok(segment))
}

/// Tells the members whether we mapped what we were to map, unlinks the segment we created
/// (`own`: mapped everywhere, or given up, so not needed by name), and says whether every member
/// mapped.
fn settle(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    ranks: &[usize],
    mapped: bool,
    own: Option<&str>,
    timeout: Duration,
) -> Result<bool, String> {
    let verdict = if mapped { "ok" } else { "!" };
    let verdicts = exchange(
        store,
        &format!("{prefix}/mapped"),
        rank,
        ranks,
        verdict,
        timeout,
    );
    if let Some(name) = own {
        let _ = shm_unlink(name);
    }
    Ok(verdicts?.iter().all(|v| v == "ok"))
}

/// Publishes `value` under `{prefix}/{rank}` and returns every member's, in member order.
fn exchange(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    ranks: &[usize],
    value: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    store
        .set(&format!("{prefix}/{rank}"), value.as_bytes())
        .map_err(|e| format!("publishing {prefix}/{rank}: {e}"))?;
    let keys: Vec<String> = ranks.iter().map(|r| format!("{prefix}/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = store
        .wait(&keys, timeout)
        .map_err(|e| format!("waiting for {prefix} of ranks {ranks:?}: {e}"))?;
    Ok(values
        .into_iter()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .collect())
}

fn random_hex() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
