//! Whether the run id keeps strangers out: the run id a shape uses when none is given (torchrun's
//! public `none` on several nodes), the warning when it is no secret, and `LAUNCH_REQUIRE_SECRET`,
//! which makes that an error. Pure logic, as the rest of the job shape.

use super::{Env, JobShape, ShapeError, Source, PUBLIC_RUN_ID, REQUIRE_SECRET_VAR, RUN_ID_VAR};

/// Whether `LAUNCH_REQUIRE_SECRET` asks for a secret: `1`/`true`/`yes`/`on` or
/// `0`/`false`/`no`/`off`/empty; anything else is an error naming the variable.
pub fn require_secret_from_env(env: &Env) -> Result<bool, ShapeError> {
    let Some(text) = env.get(REQUIRE_SECRET_VAR) else {
        return Ok(false);
    };
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ShapeError(format!(
            "environment variable {REQUIRE_SECRET_VAR}={text:?}: expected 1 or 0 (true/false, yes/no)"
        ))),
    }
}

impl JobShape {
    /// The run id this shape uses when nothing gives one: torchrun's public default on several
    /// nodes (with [`JobShape::without_secret`]'s warning), `None` (a fresh secret) otherwise.
    pub fn default_run_id(&self) -> Option<&'static str> {
        (self.nnodes.value > 1 && matches!(self.run_id.source, Source::Default(_)))
            .then_some(PUBLIC_RUN_ID)
    }

    /// Several nodes whose run id is no secret (none given, so torchrun's `none`, or one derived
    /// from the Slurm job): the one-line warning that anyone who reaches the rendezvous endpoint
    /// can join, and how to share a secret. `None` on one node or with a secret.
    pub fn without_secret(&self) -> Option<String> {
        if self.nnodes.value <= 1 {
            return None;
        }
        let what = match &self.run_id.source {
            Source::Default(_) => format!(
                "no secret run id was given (the run id is torchrun's default {PUBLIC_RUN_ID:?})"
            ),
            Source::Slurm(_) => format!(
                "the run id {:?} [{}] is derived from the Slurm job, not a secret",
                self.run_id.value.as_deref().unwrap_or(""),
                self.run_id.source
            ),
            // torchrun's public default, given explicitly (`--rdzv-id none`, PET_RDZV_ID=none).
            source if self.run_id.value.as_deref() == Some(PUBLIC_RUN_ID) => format!(
                "the run id {PUBLIC_RUN_ID:?} [{source}] is torchrun's public default, not a secret"
            ),
            _ => return None,
        };
        let (host, port) = match &self.elastic {
            Some(e) => (e.endpoint.value.0.as_str(), e.endpoint.value.1),
            None => (self.master_addr.value.as_str(), self.master_port.value),
        };
        let endpoint = crate::hostlist::join_host_port(host, port);
        Some(format!(
            "{what}: this run's traffic is unauthenticated, anyone who can reach {endpoint} can join it and read or change what its ranks exchange; share a secret with every node: --run-id-file PATH on a shared filesystem (node 0 writes one), export {RUN_ID_VAR}=$(openssl rand -hex 16), or --run-id (--require-secret makes this an error)"
        ))
    }
}
