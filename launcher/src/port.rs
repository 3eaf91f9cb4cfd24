//! Who holds a TCP port on this machine, for the one line that refuses a busy `--master-port`:
//! the listening socket's inode from `/proc/net/tcp{,6}`, then the process whose descriptors
//! hold it, with its command line.
//!
//! Must not: choose or bind ports (the plan does), or signal the holder.

use std::path::Path;

/// `pid 4242 (python3 -m http.server 29500)` for the process listening on `port`, or `a process
/// of uid 1001` when its descriptors cannot be read; `None` when no listener is found.
pub fn holder(port: u16) -> Option<String> {
    let (inode, uid) = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| listening_inode(Path::new(table), port))?;
    Some(match process_holding(inode) {
        Some((pid, command)) => format!("pid {pid} ({command})"),
        None => format!("a process of uid {uid}"),
    })
}

/// (inode, uid) of the socket listening on `port` in `table` (the kernel's text form).
fn listening_inode(table: &Path, port: u16) -> Option<(u64, u32)> {
    const LISTEN: &str = "0A";
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let local_port = fields.get(1)?.rsplit(':').next()?;
        let matches =
            u16::from_str_radix(local_port, 16).ok()? == port && fields.get(3)? == &LISTEN;
        let inode: u64 = fields.get(9)?.parse().ok()?;
        (matches && inode != 0).then_some((inode, fields.get(7)?.parse().ok()?))
    })
}

/// The first process with a descriptor on socket `inode`, and its command line.
fn process_holding(inode: u64) -> Option<(u32, String)> {
    let target = format!("socket:[{inode}]");
    let procs = std::fs::read_dir("/proc").ok()?;
    procs.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let fds = std::fs::read_dir(entry.path().join("fd")).ok()?;
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == target.as_str())
        });
        holds.then(|| (pid, crate::process::command_line(pid)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test process listening on a port is found, with its pid and command; a port nobody
    /// listens on has no holder.
    #[test]
    fn the_process_listening_on_a_port_is_named() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let found = holder(port).expect("a holder");
        assert!(
            found.starts_with(&format!("pid {} (", std::process::id())),
            "{found}"
        );
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_string_lossy();
        assert!(found.contains(&*name), "{found}");
        drop(listener);
        assert_eq!(holder(port), None);
    }
}
