//! The dry run's description of a plan: every value of the job shape with where it came from,
//! the batch derivation, the memory estimate against each device, the CPUs, the logs and each
//! local rank's environment. Reads the plan; decides nothing.

use std::fmt::Write as _;

use common::job_shape::{Source, RUN_ID_VAR};

use super::{feasible, list_counts, shell_words, Plan, GIB};

impl Plan {
    /// The dry run's line about an elastic job: its range, endpoint, which node counts keep
    /// the global batch, and the timeouts.
    fn elastic_line(&self) -> Option<String> {
        let e = self.shape.elastic.as_ref()?;
        let spec = self.config.as_ref().map(|t| &t.config.batch);
        let keeps = list_counts((e.min..=e.max).filter(|&n| feasible(spec, self.nproc, n).is_ok()));
        Some(format!(
            "  elastic:      {}..{} nodes  [{}]; rendezvous store at {}:{}  [{}]; node rank, world and batch set at each (re)start; node counts that keep the global batch: {}; join timeout {:.0} s, last call {:.0} s",
            e.min,
            e.max,
            e.range_source,
            e.endpoint.value.0,
            e.endpoint.value.1,
            e.endpoint.source,
            keeps,
            e.join_timeout.value.as_secs_f64(),
            e.last_call.value.as_secs_f64()
        ))
    }

    /// The dry-run description: world, nodes, batch derivation, each local rank's device and
    /// environment.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "launch plan (dry run: nothing was started)");
        let _ = writeln!(
            out,
            "  world size:   {} = {} node(s) x {} process(es); this node: rank {} of {}",
            self.world_size, self.nnodes, self.nproc, self.node_rank, self.nnodes
        );
        let port = if self.master_port == 0 {
            "a free port chosen at launch".to_string()
        } else {
            self.master_port.to_string()
        };
        let shape = &self.shape;
        let rows: [(&str, String, &Source); 6] = [
            ("nodes", self.nnodes.to_string(), &shape.nnodes.source),
            (
                "node rank",
                self.node_rank.to_string(),
                &shape.node_rank.source,
            ),
            (
                "processes",
                format!("{} on this node", self.nproc),
                &shape.num_processes.source,
            ),
            (
                "master addr",
                self.master_addr.clone(),
                &shape.master_addr.source,
            ),
            ("master port", port, &shape.master_port.source),
            ("run id", self.shown_run_id(), &shape.run_id.source),
        ];
        for (name, value, source) in rows {
            let _ = writeln!(out, "  {:<13} {value}  [{source}]", format!("{name}:"));
        }
        if let Some(line) = self.elastic_line() {
            let _ = writeln!(out, "{line}");
        }
        let _ = writeln!(
            out,
            "  failures:     tear down with SIGTERM, SIGKILL after {:.1} s; up to {} restart(s)  [{}]",
            self.grace_period.as_secs_f64(),
            self.max_restarts,
            shape.max_restarts.source
        );
        let orphans = crate::cgroup::describe(&crate::cgroup::probe());
        let _ = writeln!(out, "  orphans:      {orphans}");
        let _ = writeln!(out, "  command:      {}", shell_words(&self.command));
        if let Some(wc) = &self.config {
            let _ = writeln!(
                out,
                "  config:       {} (run {:?})",
                wc.source.display(),
                wc.config.run.name
            );
            let _ = writeln!(out, "  batch:        {}", wc.batch.derivation());
        }
        if let Some(check) = self.memory_check() {
            let _ = writeln!(out, "  memory:");
            for line in &check.lines {
                let _ = writeln!(out, "    {line}");
            }
            for w in &check.warnings {
                let _ = writeln!(out, "  warning:      {w}");
            }
            if let Some(refusal) = &check.refusal {
                let _ = writeln!(out, "  refused:      launch would not start: {refusal}");
            }
        }
        if let Some((threads, cores)) = self.omp_threads {
            let _ = writeln!(
                out,
                "  threads:      OMP_NUM_THREADS={threads} (not set: {cores} core(s) / {} process(es))",
                self.nproc
            );
        }
        self.describe_cpus_logs_notes(&mut out);
        for local_rank in 0..self.nproc {
            self.describe_rank(&mut out, local_rank);
        }
        out
    }

    /// The dry run's lines on CPU pinning, log files, notices and the secret warning.
    fn describe_cpus_logs_notes(&self, out: &mut String) {
        let _ = match (&self.cpu_map, &self.pinning) {
            (Some(map), Some(asked)) => {
                writeln!(out, "  cpus:         {}  [{asked}]", map.describe())
            }
            (_, Some(asked)) => writeln!(
                out,
                "  cpus:         not pinned: fewer usable CPUs than workers  [{asked}]"
            ),
            (_, None) => writeln!(
                out,
                "  cpus:         not pinned (--numa-binding MODE or --pin pins each worker)"
            ),
        };
        if self.log_streams {
            let dir = self
                .log_dir
                .as_ref()
                .map_or("<a temporary directory>".into(), |d| {
                    d.display().to_string()
                });
            let _ = writeln!(
                out,
                "  logs:         {dir}/<run>_<random>/attempt_N/<local rank>/{{stdout,stderr}}.log"
            );
        }
        if let Some(dir) = &self.rank_logs {
            let _ = writeln!(out, "  rank logs:    {}/rank-N.log", dir.display());
        }
        for notice in &self.notices {
            let _ = writeln!(out, "  note:         {notice}");
        }
        if let Some(warning) = &self.secret_warning {
            let _ = writeln!(out, "  warning:      {warning}");
        }
    }

    /// The dry run's lines of one local rank: its device, who else holds it, its environment.
    fn describe_rank(&self, out: &mut String, local_rank: u32) {
        let env = self.worker_env(local_rank, 0);
        let device = self.device_of(local_rank);
        let _ = writeln!(out, "  local rank {local_rank}: device {device}");
        if let Some(line) = self.holders_line(local_rank) {
            let _ = writeln!(out, "{line}");
        }
        let accelerate = (self.accelerate_env.iter()).map(|(k, v)| (k.as_str(), v.clone()));
        let vars: Vec<String> = env
            .to_vars()
            .into_iter()
            .chain(self.extra_env())
            .chain(accelerate)
            .map(|(k, v)| match k {
                "TORCHELASTIC_RUN_ID" => format!("{k}={}", self.shown_run_id()),
                "MASTER_PORT" if self.master_port == 0 => format!("{k}=<free port>"),
                _ => format!("{k}={v}"),
            })
            .collect();
        let _ = writeln!(out, "    {}", vars.join(" "));
    }

    /// The run id as a dry run may print it: a secret from `LAUNCH_RUN_ID` stays hidden (job
    /// logs are often readable by others).
    fn shown_run_id(&self) -> String {
        match &self.shape.run_id.source {
            Source::Env(var) if var == RUN_ID_VAR => format!("<hidden: ${RUN_ID_VAR}>"),
            Source::File(path) => format!("<hidden: in {path}>"),
            _ => self.run_id.clone(),
        }
    }

    fn device_of(&self, local_rank: u32) -> String {
        let slurm = self
            .shape
            .slurm
            .as_ref()
            .and_then(|s| s.gpus.as_ref())
            .and_then(|g| g.physical_of(local_rank))
            .map(|id| format!("; Slurm's GPU {id} on this node"))
            .unwrap_or_default();
        match &self.gpus {
            Some(gpus) if !gpus.is_empty() => match gpus.get(local_rank as usize) {
                Some(gpu) => {
                    let memory = if gpu.total_bytes == 0 {
                        String::new()
                    } else {
                        format!(
                            ", {:.1} GiB total, {:.1} GiB free",
                            gpu.total_bytes as f64 / GIB,
                            gpu.free_bytes as f64 / GIB
                        )
                    };
                    format!(
                        "cuda:{} = {} ({}{memory}){slurm}",
                        gpu.cuda_index,
                        gpu.mig
                            .clone()
                            .unwrap_or_else(|| format!("GPU {}", gpu.nvml_index)),
                        gpu.name,
                    )
                }
                None => format!(
                    "none: only {} GPU(s) visible for {} processes (cuda:{local_rank} does not exist)",
                    gpus.len(),
                    self.nproc
                ),
            },
            _ if !slurm.is_empty() => {
                format!("cuda:{local_rank}{slurm} (NVML does not see it from here)")
            }
            _ => "cpu (no visible GPU)".to_string(),
        }
    }
}
