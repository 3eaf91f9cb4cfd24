//! The job's cgroup (cgroup v2): where the launcher may make one below its own (root, a
//! delegated subtree, a systemd user scope), every worker starts inside it, and whatever a
//! worker starts stays inside, `setsid` and double forks included; `cgroup.kill` then ends all
//! of it at once, which is what the teardown's last step and the orphan guard do. Where none
//! can be made, process groups and the child subreaper are the fallback, and [`probe`] says why.
//!
//! Owns: finding the cgroup v2 mount and the launcher's place in it, making, killing and
//! removing the job's cgroup. Must not: decide when to kill (the supervisor and the guard do).

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Set to `off` to keep the workers out of a cgroup (the fallback is used, as where none can
/// be made).
pub const CGROUP_VAR: &str = "LAUNCH_CGROUP";

/// The job's cgroup, removed (emptied first) when dropped.
pub struct JobCgroup {
    dir: PathBuf,
    /// `cgroup.procs`, open for writing: each worker writes itself in before its exec.
    procs: File,
}

impl JobCgroup {
    /// Makes `launch-<pid>` below the launcher's own cgroup; why not, where it cannot.
    pub fn create() -> Result<JobCgroup, String> {
        let parent = probe()?;
        let dir = parent.join(format!("launch-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let made = JobCgroup::open(&dir);
        if made.is_err() {
            let _ = std::fs::remove_dir(&dir);
        }
        made
    }

    fn open(dir: &Path) -> Result<JobCgroup, String> {
        if !dir.join("cgroup.kill").exists() {
            return Err(format!(
                "{} has no cgroup.kill (a kernel before 5.14)",
                dir.display()
            ));
        }
        let path = dir.join("cgroup.procs");
        let procs = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        Ok(JobCgroup {
            dir: dir.to_path_buf(),
            procs,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The open `cgroup.procs` a child writes `0` into to join.
    pub fn procs(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    /// Whether any process is left inside.
    pub fn populated(&self) -> bool {
        populated(&self.dir)
    }

    /// Kills everything inside and waits (up to a second) until it is empty; `true` if it is.
    pub fn kill(&self) -> bool {
        kill(&self.dir)
    }

    /// What the kernel counted for the whole job, where its controllers are on for this
    /// cgroup: the peak memory (bytes) and the most processes at once.
    pub fn peaks(&self) -> (Option<u64>, Option<u64>) {
        peaks(&self.dir)
    }
}

/// `memory.peak` and `pids.peak` of the cgroup `dir`, each where the file is there.
fn peaks(dir: &Path) -> (Option<u64>, Option<u64>) {
    let read = |name: &str| {
        let text = std::fs::read_to_string(dir.join(name)).ok()?;
        text.trim().parse::<u64>().ok()
    };
    (read("memory.peak"), read("pids.peak"))
}

impl Drop for JobCgroup {
    fn drop(&mut self) {
        if self.populated() {
            self.kill();
        }
        remove(&self.dir);
    }
}

/// Removes the cgroup `dir` and the cgroups below it, deepest first (a `launch` run by a
/// worker makes its job's cgroup below ours, and one killed with its guard leaves it there).
fn remove(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Whether the cgroup `dir` has a process in it (its `cgroup.events` says `populated 1`).
pub fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events"))
        .map(|events| events.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// Writes `1` to `dir`'s `cgroup.kill` (SIGKILL to every process inside, as one act) and waits
/// up to a second for it to empty; `true` once empty.
pub fn kill(dir: &Path) -> bool {
    let killed = OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.kill"))
        .and_then(|mut f| f.write_all(b"1"));
    if killed.is_err() {
        return !populated(dir);
    }
    let until = Instant::now() + Duration::from_secs(1);
    while populated(dir) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    !populated(dir)
}

/// Kills what is left in `dir` and removes it with the cgroups below it (the orphan guard's
/// end).
pub fn kill_and_remove(dir: &Path) {
    kill(dir);
    remove(dir);
}

/// The launcher's own cgroup directory, if a job cgroup can be made below it: cgroup v2
/// mounted, the launcher's place in it found, and its directory and `cgroup.procs` writable
/// (moving a worker in writes to both ends' common ancestor, which is this one). Why not
/// otherwise.
pub fn probe() -> Result<PathBuf, String> {
    if std::env::var_os(CGROUP_VAR).is_some_and(|v| v == "off") {
        return Err(format!("{CGROUP_VAR}=off"));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let (root, mount) = cgroup2_mount(&mountinfo).ok_or("no cgroup v2 mounted")?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("this process has no cgroup v2 entry in /proc/self/cgroup")?;
    let relative = Path::new(path)
        .strip_prefix(&root)
        .map_err(|_| format!("this process's cgroup {path} is outside the mount of {root}"))?;
    let dir = match relative.as_os_str().is_empty() {
        true => mount,
        false => mount.join(relative),
    };
    for path in [dir.clone(), dir.join("cgroup.procs")] {
        nix::unistd::access(&path, nix::unistd::AccessFlags::W_OK)
            .map_err(|e| format!("{} is not writable: {}", path.display(), e.desc()))?;
    }
    Ok(dir)
}

/// The root and mount point of the first cgroup v2 mount in `/proc/self/mountinfo`'s text.
fn cgroup2_mount(mountinfo: &str) -> Option<(String, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut fields = left.split_whitespace();
        let root = fields.nth(3)?;
        let mount = fields.next()?;
        Some((unescape(root), PathBuf::from(unescape(mount))))
    })
}

/// mountinfo's octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How the job's processes are ended when `launch` is killed, for the dry run.
pub fn describe(probed: &Result<PathBuf, String>) -> String {
    match probed {
        Ok(dir) => format!(
            "the job's own cgroup below {}, ended whole (cgroup.kill): all a worker started",
            dir.display()
        ),
        Err(why) => format!(
            "the workers' process groups, with a child subreaper (no cgroup: {why}; a worker's \
             child that leaves its process group survives a SIGKILL of launch)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_are_read_where_the_controllers_left_them() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(peaks(dir.path()), (None, None));
        std::fs::write(dir.path().join("memory.peak"), "1048576\n").unwrap();
        std::fs::write(dir.path().join("pids.peak"), "7\n").unwrap();
        assert_eq!(peaks(dir.path()), (Some(1 << 20), Some(7)));
    }

    #[test]
    fn the_cgroup2_mount_is_found_among_v1_mounts() {
        let info = "25 1 0:22 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                    30 1 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(info),
            Some(("/".to_string(), PathBuf::from("/sys/fs/cgroup/unified")))
        );
        let spaced = "30 1 0:27 /a\\040b /mnt/c\\040g rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(spaced),
            Some(("/a b".to_string(), PathBuf::from("/mnt/c g")))
        );
        assert_eq!(
            cgroup2_mount("25 1 0:22 / /x rw - cgroup cgroup rw\n"),
            None
        );
    }

    /// A child started into the job's cgroup is there from before its exec, with what it
    /// starts (a `setsid` escapee too); `kill` ends them all and the drop removes the cgroup.
    #[test]
    fn a_child_joins_before_exec_and_kill_ends_all_it_started() {
        let job = match JobCgroup::create() {
            Ok(job) => job,
            Err(why) => return eprintln!("skipped: no cgroup can be made here ({why})"),
        };
        let script = "setsid sleep 30 & grep ^0:: /proc/self/cgroup; exec sleep 31";
        let mut command =
            crate::child::Command::new("sh".as_ref(), &["-c".into(), script.into()]).unwrap();
        command.join_cgroup(job.procs());
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut child.stdout), &mut line)
            .unwrap();
        let name = job
            .dir()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            line.starts_with("0::/") && line.trim_end().ends_with(&name),
            "{line}"
        );
        let members = std::fs::read_to_string(job.dir().join("cgroup.procs")).unwrap();
        assert!(
            members.lines().count() >= 2,
            "sh (then sleep 31) and the escapee: {members}"
        );
        assert!(job.kill(), "still populated after cgroup.kill");
        let status = crate::child::wait(child.pid).unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        let dir = job.dir().to_path_buf();
        drop(job);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}
