//! A job inside a memory cgroup (a container, a Slurm job's `--mem`, a Kubernetes pod's limit)
//! plans with the cgroup's limit, not the host's RAM: `launch --dry-run` names the cgroup and
//! counts its limit, `dist.zero = "auto"` picks the stage that fits it, and the workers' budget
//! says where it came from. The test makes its own cgroup under the host's memory controller
//! (v1's hierarchy, or v2's where the memory controller is enabled at its root); without root
//! or either, it skips with one line.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

/// A memory cgroup the test made, removed on drop (once its processes are gone).
struct MemoryCgroup {
    dir: PathBuf,
    limit_file: &'static str,
}

impl MemoryCgroup {
    /// A fresh cgroup under the memory controller's root, or why there is none to make.
    fn make(tag: &str) -> Result<MemoryCgroup, String> {
        let name = format!("gptrec-test-{}-{tag}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup");
        let (root, limit_file) = if v1.join("memory.limit_in_bytes").is_file() {
            (v1, "memory.limit_in_bytes")
        } else if std::fs::read_to_string(v2.join("cgroup.subtree_control"))
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"))
        {
            (v2, "memory.max")
        } else {
            return Err("no memory controller to make a cgroup under".into());
        };
        let dir = root.join(name);
        std::fs::create_dir(&dir).map_err(|e| format!("making {}: {e}", dir.display()))?;
        Ok(MemoryCgroup { dir, limit_file })
    }

    /// Its path below the hierarchy's root, as `/proc/self/cgroup` gives it, less the `/`.
    fn name(&self) -> String {
        self.dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().to_string())
    }

    fn limit_mib(&self, mib: u64) {
        std::fs::write(self.dir.join(self.limit_file), (mib << 20).to_string())
            .expect("write the cgroup's limit");
    }

    /// `launch ARGS` started inside this cgroup (the shell moves itself in, then becomes
    /// `launch`), to completion.
    fn launch(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("echo $$ > \"$0/cgroup.procs\" && exec \"$@\"")
            .arg(&self.dir)
            .arg(bin("launch"))
            .args(args)
            .current_dir(repo_root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("SLURM_") || key.starts_with("PET_") || key == "LAUNCH_RUN_ID" {
                cmd.env_remove(key.as_ref());
            }
        }
        cmd.env_remove("GPTREC_MEMORY_LIMIT_MB");
        wait_output(cmd.spawn().expect("start sh"), Duration::from_secs(300))
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A fresh memory cgroup (or `None`, having said why the test skips), a fresh output
/// directory and the `--set` that sends the runs there.
fn cgroup_and_output(tag: &str) -> Option<(MemoryCgroup, tempfile::TempDir, String)> {
    let cgroup = MemoryCgroup::make(tag)
        .map_err(|why| eprintln!("skipping: {why}"))
        .ok()?;
    let dir = tempfile::tempdir().unwrap();
    let out = format!("run.output_dir={:?}", dir.path().display().to_string());
    Some((cgroup, dir, out))
}

fn args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--num-processes", "2", "configs/default.toml", "--set", out];
    for set in WIDE_DENSE
        .iter()
        .chain([&"data.synthetic=\"tiny\""])
        .chain(extra)
    {
        args.extend(["--set", set]);
    }
    args
}

#[test]
fn a_cgroup_memory_limit_is_the_budget_and_zero_auto_plans_with_it() {
    let Some((cgroup, _dir, out)) = cgroup_and_output("plan") else {
        return;
    };
    // Roomy: both stages fit; the figures to place the limit between them.
    cgroup.limit_mib(64 << 10);
    let mut dry = args(&out, &["dist.zero=\"auto\""]);
    dry.insert(0, "--dry-run");
    let roomy = cgroup.launch(&dry);
    roomy.assert_code(0);
    let (zero, one) = (stage_peak(&roomy.stdout, 0), stage_peak(&roomy.stdout, 1));
    assert!(one + 20.0 < zero, "{}", roomy.stdout);

    // Two workers share the cgroup: each plans with half of it, 90% of that usable.
    let limit = ((zero + one) / 2.0 / 0.9 * 2.0).round() as u64;
    cgroup.limit_mib(limit);
    let name = cgroup.name();
    let tight = cgroup.launch(&dry);
    tight.assert_code(0);
    tight.assert_stdout_all(&[
        format!("local rank 0: cpu in cgroup /{name}: "),
        format!("per worker ({}.0 MiB in all)", limit),
        "dist.zero \"auto\": by the estimate, stage 1 (".to_string(),
    ]);
    // DDP does not fit there, and the warning names stage 1 among the levers.
    let mut ddp = args(&out, &["dist.zero=0"]);
    ddp.insert(0, "--dry-run");
    let warned = cgroup.launch(&ddp);
    warned.assert_stdout_all(&[
        "does NOT fit with the 10% margin",
        "dist.zero = 1 (estimate ",
    ]);

    // A run inside it: the workers' budget names the cgroup, and it trains (4 GiB: below
    // the RAM of any machine this runs on, above what the two workers take).
    cgroup.limit_mib(4 << 10);
    let ran = cgroup.launch(&args(&out, &["dist.zero=\"auto\""]));
    let all = ran.all();
    assert_eq!(ran.code(), Some(0), "{all}");
    assert!(
        all.contains(&format!("the memory limit of cgroup /{name} / 2 workers")),
        "{all}"
    );
}

/// A worker the kernel's OOM killer ends (here under the cgroup's limit) is named as out of
/// memory in the failure summary, with the limit it ran under, not as a bare SIGKILL.
#[test]
fn a_worker_the_oom_killer_ends_is_reported_as_out_of_memory() {
    let Some((cgroup, _dir, out)) = cgroup_and_output("oom") else {
        return;
    };
    // Two workers of this model take about 1.4 GiB together.
    cgroup.limit_mib(900);
    let ran = cgroup.launch(&args(&out, &[]));
    let all = ran.all();
    assert_eq!(ran.code(), Some(137), "{all}");
    let name = cgroup.name();
    assert!(all.contains("killed by SIGKILL"), "{all}");
    assert!(
        all.contains(&format!(
            "most likely ran out of memory under the memory limit of cgroup /{name} (900.0 MiB)"
        )),
        "{all}"
    );
}
