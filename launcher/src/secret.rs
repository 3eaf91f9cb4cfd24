//! The run's secret: the run id admits a process to the rendezvous store, so it must not be
//! guessable. Fresh ids come from the operating system's random numbers; on several nodes the
//! id is shared through a file (`--run-id-file`, `LAUNCH_RUN_ID_FILE`) that node 0 writes once,
//! atomically and readable by its owner only, and the other nodes wait for. Part of the plan:
//! it decides nothing about what runs.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;
use std::time::{Duration, Instant};

use common::job_shape::{JobShape, Source};

/// The run id the plan uses, and the warning to print when it is no secret: given (a Slurm
/// job's derived id is no secret), read from (or, on node 0, written into) the run id file,
/// torchrun's public `none` on several nodes given nothing, or fresh on a single node. With
/// `require_secret`, a run id that is no secret is an error instead of a warning.
pub fn run_id_of(
    shape: &JobShape,
    dry_run: bool,
    require_secret: bool,
    notices: &mut Vec<String>,
) -> Result<(String, Option<String>), String> {
    let warning = shape.without_secret();
    if let (Some(why), true) = (&warning, require_secret) {
        return Err(why.replace(
            " (--require-secret makes this an error)",
            " (--require-secret, LAUNCH_REQUIRE_SECRET or dist.require_secret asked for one)",
        ));
    }
    if let Some(id) = &shape.run_id.value {
        return Ok((id.clone(), warning));
    }
    if let Source::File(path) = &shape.run_id.source {
        if dry_run {
            return Ok((format!("<read from {path} at start>"), None));
        }
        let (id, notice) = from_file(Path::new(path), shape.node_rank.value == 0, FILE_WAIT)?;
        notices.extend(notice);
        return Ok((id, None));
    }
    if let Some(id) = shape.default_run_id() {
        return Ok((id.to_string(), warning));
    }
    Ok((fresh_run_id()?, None))
}

/// `bytes` random bytes as hex.
fn random_hex(bytes: usize) -> Result<String, String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A fresh run id for a single-node run: `launch-` and 128 random bits.
pub fn fresh_run_id() -> Result<String, String> {
    Ok(format!("launch-{}", random_hex(16)?))
}

/// How long nodes other than 0 wait for node 0 to write the run id file.
pub const FILE_WAIT: Duration = Duration::from_secs(120);

/// The run id in `path`. Node 0 (`create`) writes a fresh secret there when the file does not
/// exist (atomically: a whole file or none, mode 0600); the other nodes wait up to `wait` for
/// it. Returns the id and, when the file is readable by others, a notice saying so.
pub fn from_file(
    path: &Path,
    create: bool,
    wait: Duration,
) -> Result<(String, Option<String>), String> {
    let shown = path.display();
    if create && !path.exists() {
        write_new(path)?;
    }
    let deadline = Instant::now() + wait;
    while !path.exists() {
        if Instant::now() >= deadline {
            return Err(format!(
                "run id file {shown} did not appear within {} s: node 0 writes it (is {shown} on a filesystem every node shares, and did node 0 start with the same --run-id-file?)",
                wait.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the run id file {shown}: {e}"))?;
    let id = text.trim().to_string();
    if id.is_empty() {
        return Err(format!(
            "run id file {shown} is empty; delete it (node 0 writes a fresh one) or put a secret in it"
        ));
    }
    let notice = std::fs::metadata(path)
        .ok()
        .filter(|m| m.permissions().mode() & 0o077 != 0)
        .map(|m| {
            format!(
                "run id file {shown} is readable by others (mode {:o}): anyone who reads it can join the run; chmod 600 {shown}",
                m.permissions().mode() & 0o777
            )
        });
    Ok((id, notice))
}

/// Writes a fresh secret into `path` as a whole: a private temporary file, then a hard link
/// (which fails if another process created `path` first; then that one's secret is used).
fn write_new(path: &Path) -> Result<(), String> {
    let shown = path.display();
    let secret = random_hex(32)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("creating {} for the run id file: {e}", dir.display()))?;
    }
    let name = path
        .file_name()
        .map_or("run-id".into(), |n| n.to_string_lossy());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(format!("{secret}\n").as_bytes())?;
            f.sync_all()
        });
    let linked = written.and_then(|()| match std::fs::hard_link(&tmp, path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    });
    let _ = std::fs::remove_file(&tmp);
    linked.map_err(|e| format!("writing the run id file {shown}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ids_are_random_and_long() {
        let (a, b) = (fresh_run_id().unwrap(), fresh_run_id().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), "launch-".len() + 32);
    }

    #[test]
    fn node_0_writes_a_private_secret_once_and_the_others_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared/run-id");
        let (first, notice) = from_file(&path, true, Duration::from_secs(1)).unwrap();
        assert_eq!(first.len(), 64);
        assert_eq!(notice, None);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A restart of node 0 and the other nodes read the same secret.
        assert_eq!(
            from_file(&path, true, Duration::from_secs(1)).unwrap().0,
            first
        );
        assert_eq!(
            from_file(&path, false, Duration::from_secs(1)).unwrap().0,
            first
        );
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "a temporary file was left");
    }

    #[test]
    fn other_nodes_wait_for_node_0_and_say_why_they_gave_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run-id");
        let waiter = {
            let path = path.clone();
            std::thread::spawn(move || from_file(&path, false, Duration::from_secs(10)))
        };
        std::thread::sleep(Duration::from_millis(300));
        let (written, _) = from_file(&path, true, Duration::from_secs(1)).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap().0, written);

        let missing = dir.path().join("never");
        let e = from_file(&missing, false, Duration::from_millis(300)).unwrap_err();
        assert!(
            e.contains("did not appear within") && e.contains("node 0 writes it"),
            "{e}"
        );
    }

    #[test]
    fn a_readable_or_empty_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run-id");
        std::fs::write(&path, "s3cret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let (id, notice) = from_file(&path, false, Duration::from_secs(1)).unwrap();
        assert_eq!(id, "s3cret");
        assert!(notice.unwrap().contains("readable by others (mode 644)"));
        std::fs::write(&path, "\n").unwrap();
        assert!(from_file(&path, true, Duration::from_secs(1))
            .unwrap_err()
            .contains("is empty"));
    }
}
