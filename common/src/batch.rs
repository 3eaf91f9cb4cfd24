//! The batch plan: `micro x grad_accum x world = global`.
//!
//! `[batch]` in the config names any two of `global`, `micro` and `grad_accum` (or all three);
//! with the world size (number of data-parallel processes) known, [`BatchSpec::resolve`] derives
//! the missing one. Integer division that would lose samples is an error, never a silent
//! truncation, and every such error carries valid alternatives both as text and as
//! [`BatchPlan`]s ([`BatchError::suggestions`]).
//!
//! All arithmetic is checked: values that overflow `u64` are errors, not panics.

use std::fmt;

/// The `[batch]` section as written: any two of the three values, or all three; or `global`
/// with `micro = "auto"`.
///
/// Every field is a count of samples (or of micro-batches for `grad_accum`); a missing field is
/// derived by [`BatchSpec::resolve`] once the world size is known.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(from = "BatchToml", into = "BatchToml")]
pub struct BatchSpec {
    /// Samples per optimizer step, summed over all workers. Default: unset (derived). Must be >= 1.
    pub global: Option<u64>,
    /// Samples per forward/backward pass on one worker. Default: unset (derived). Must be >= 1.
    pub micro: Option<u64>,
    /// Micro-batches accumulated per optimizer step on each worker. Default: unset (derived;
    /// 1 when only `global` or only `micro` is given). Must be >= 1.
    pub grad_accum: Option<u64>,
    /// `micro = "auto"` in the file: each worker finds the largest micro batch that fits its
    /// device (at most `max_micro`), the ranks agree on the smallest, and `grad_accum` follows
    /// from `global`. Default: `false`.
    pub micro_auto: bool,
    /// With `micro = "auto"`: the largest micro batch to try (samples, >= 1). Default: unset
    /// (global / world).
    pub max_micro: Option<u64>,
}

/// `[batch]` as TOML holds it (a private type named like the public one, so that serde's
/// messages say "expected struct BatchSpec").
mod toml_form {
    use std::fmt;

    /// `[batch]` as TOML holds it: `micro` is a number or the word `"auto"`.
    #[derive(serde::Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct BatchSpec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub global: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub micro: Option<MicroToml>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub grad_accum: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_micro: Option<u64>,
    }

    /// `micro`: a count, or `"auto"`. Deserialised by hand so that a bad value is reported at the
    /// value (file:line:column), not at the `[batch]` header.
    pub enum MicroToml {
        Count(u64),
        Auto,
    }

    impl serde::Serialize for MicroToml {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                MicroToml::Count(n) => s.serialize_u64(*n),
                MicroToml::Auto => s.serialize_str("auto"),
            }
        }
    }

    impl<'de> serde::Deserialize<'de> for MicroToml {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MicroToml, D::Error> {
            struct Visitor;
            impl serde::de::Visitor<'_> for Visitor {
                type Value = MicroToml;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a number of samples or \"auto\"")
                }
                fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<MicroToml, E> {
                    Ok(MicroToml::Count(v))
                }
                fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<MicroToml, E> {
                    u64::try_from(v).map(MicroToml::Count).map_err(|_| {
                        E::custom(format!("must be a number of samples or \"auto\" (got {v})"))
                    })
                }
                fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<MicroToml, E> {
                    if v == "auto" {
                        Ok(MicroToml::Auto)
                    } else {
                        Err(E::custom(format!(
                            "must be a number of samples or \"auto\" (got {v:?})"
                        )))
                    }
                }
            }
            d.deserialize_any(Visitor)
        }
    }
}
use toml_form::{BatchSpec as BatchToml, MicroToml};

impl From<BatchToml> for BatchSpec {
    fn from(t: BatchToml) -> BatchSpec {
        let (micro, micro_auto) = match t.micro {
            None => (None, false),
            Some(MicroToml::Count(n)) => (Some(n), false),
            Some(MicroToml::Auto) => (None, true),
        };
        BatchSpec {
            global: t.global,
            micro,
            grad_accum: t.grad_accum,
            micro_auto,
            max_micro: t.max_micro,
        }
    }
}

impl From<BatchSpec> for BatchToml {
    fn from(s: BatchSpec) -> BatchToml {
        BatchToml {
            global: s.global,
            micro: if s.micro_auto {
                Some(MicroToml::Auto)
            } else {
                s.micro.map(MicroToml::Count)
            },
            grad_accum: s.grad_accum,
            max_micro: s.max_micro,
        }
    }
}

/// A resolved batch plan; `micro * grad_accum * world_size == global` holds for every plan this
/// module returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchPlan {
    /// Samples per optimizer step, summed over all workers.
    pub global: u64,
    /// Samples per forward/backward pass on one worker.
    pub micro: u64,
    /// Micro-batches accumulated per optimizer step on each worker.
    pub grad_accum: u64,
    /// Number of data-parallel worker processes.
    pub world_size: u64,
}

/// Why a `[batch]` section cannot be turned into a [`BatchPlan`]. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// The world size was 0.
    #[error("batch: world size must be >= 1 (got 0)")]
    ZeroWorld,
    /// A given value was 0; `key` is `global`, `micro` or `grad_accum`.
    #[error("`batch.{key}` must be >= 1 (got 0)")]
    Zero {
        /// The offending key inside `[batch]`.
        key: &'static str,
    },
    /// Neither `global` nor `micro` was given.
    #[error("[batch] needs two of global, micro, grad_accum ({})", given_text(*.grad_accum))]
    Underdetermined {
        /// `grad_accum` when it was the only value given.
        grad_accum: Option<u64>,
    },
    /// A division did not come out exact (`global` is not a multiple of what divides it).
    #[error("batch: {detail}")]
    NotDivisible {
        /// The values as written.
        spec: Box<BatchSpec>,
        /// The world size the spec was resolved for.
        world_size: u64,
        /// The arithmetic and the suggestions, as one line.
        detail: String,
        /// Valid plans near the request (each satisfies the invariant).
        suggestions: Vec<BatchPlan>,
    },
    /// All three values were given and `micro * grad_accum * world != global`.
    #[error("batch: {detail}")]
    Mismatch {
        /// The values as written.
        spec: Box<BatchSpec>,
        /// The world size the spec was resolved for.
        world_size: u64,
        /// The arithmetic and the suggestions, as one line.
        detail: String,
        /// Valid plans near the request (each satisfies the invariant).
        suggestions: Vec<BatchPlan>,
    },
    /// `micro = "auto"` combined with what it cannot be combined with; `key` is the key to change.
    #[error("`batch.{key}`: {problem}")]
    Auto {
        /// The key inside `[batch]` to change.
        key: &'static str,
        /// What is wrong, and what to do.
        problem: String,
    },
    /// An elastic job cannot keep the global batch (none is configured, or the world size does
    /// not divide it).
    #[error("`batch.global`: {problem}")]
    Elastic {
        /// What is wrong, and what to do.
        problem: String,
    },
    /// A product does not fit in a `u64`.
    #[error("batch: {expression} does not fit in 64 bits")]
    Overflow {
        /// The product that overflowed, e.g. `micro 4294967296 x world 4294967296`.
        expression: String,
    },
}

fn given_text(grad_accum: Option<u64>) -> String {
    match grad_accum {
        Some(a) => format!("only grad_accum {a} given"),
        None => "none given".to_string(),
    }
}

impl BatchError {
    /// The dotted config key the error is about (`batch.micro`, or `batch` for the section).
    pub fn key_path(&self) -> String {
        match self {
            BatchError::Zero { key } | BatchError::Auto { key, .. } => format!("batch.{key}"),
            BatchError::Elastic { .. } => "batch.global".to_string(),
            _ => "batch".to_string(),
        }
    }

    /// Valid plans suggested by the error (empty for errors without suggestions).
    pub fn suggestions(&self) -> &[BatchPlan] {
        match self {
            BatchError::NotDivisible { suggestions, .. }
            | BatchError::Mismatch { suggestions, .. } => suggestions,
            _ => &[],
        }
    }
}

/// Above this quotient (`global / world`), divisor searches for suggestions are skipped
/// (they cost O(sqrt(quotient))).
const SUGGESTION_SEARCH_LIMIT: u64 = 1 << 40;

fn mul(parts: &[(&str, u64)]) -> Result<u64, BatchError> {
    let mut product: u64 = 1;
    for (_, v) in parts {
        product = match product.checked_mul(*v) {
            Some(p) => p,
            None => {
                let expression = parts
                    .iter()
                    .map(|(name, v)| format!("{name} {v}"))
                    .collect::<Vec<_>>()
                    .join(" x ");
                return Err(BatchError::Overflow { expression });
            }
        };
    }
    Ok(product)
}

fn ratio(n: u64, d: u64) -> String {
    format!("{:.2}", n as f64 / d as f64)
}

/// Multiples of `d` just below (if >= d) and just above `n`, which is not a multiple of `d`.
fn neighbour_multiples(n: u64, d: u64) -> Vec<u64> {
    let k = n / d;
    let mut out = Vec::with_capacity(2);
    if k >= 1 {
        out.push(k * d);
    }
    if let Some(up) = (k + 1).checked_mul(d) {
        out.push(up);
    }
    out
}

/// All divisors of `n` (n >= 1), ascending. O(sqrt(n)).
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut i: u64 = 1;
    while i <= n / i {
        if n % i == 0 {
            small.push(i);
            if i != n / i {
                large.push(n / i);
            }
        }
        i += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The divisors of `n` nearest to `target` from below and from above (excluding `target`).
/// Empty when `n` is too large to search.
fn nearest_divisors(n: u64, target: u64) -> Vec<u64> {
    if n == 0 || n > SUGGESTION_SEARCH_LIMIT {
        return Vec::new();
    }
    let divs = divisors(n);
    let below = divs.iter().copied().filter(|&d| d < target).max();
    let above = divs.iter().copied().filter(|&d| d > target).min();
    below.into_iter().chain(above).collect()
}

fn join_or(items: &[String]) -> String {
    items.join(" or ")
}

fn impossible_keep(global: u64, world: u64) -> String {
    format!("or keep global {global} with world {world}: impossible ({global} is not a multiple of {world})")
}

impl BatchSpec {
    /// World-independent checks: no value is 0, and `global` or `micro` is given.
    ///
    /// [`BatchSpec::resolve`] runs these first; `Config::validate` runs them without a world size.
    pub fn check(&self) -> Result<(), BatchError> {
        for (key, value) in [
            ("global", self.global),
            ("micro", self.micro),
            ("grad_accum", self.grad_accum),
            ("max_micro", self.max_micro),
        ] {
            if value == Some(0) {
                return Err(BatchError::Zero { key });
            }
        }
        if self.micro_auto {
            if self.global.is_none() {
                return Err(BatchError::Auto {
                    key: "micro",
                    problem: "\"auto\" needs batch.global (the batch it keeps while choosing micro and grad_accum)".into(),
                });
            }
            if let Some(a) = self.grad_accum {
                return Err(BatchError::Auto {
                    key: "grad_accum",
                    problem: format!("is chosen when batch.micro = \"auto\"; remove it (got {a})"),
                });
            }
        } else if let Some(m) = self.max_micro {
            return Err(BatchError::Auto {
                key: "max_micro",
                problem: format!("only applies with batch.micro = \"auto\" (got {m})"),
            });
        }
        if self.global.is_none() && self.micro.is_none() {
            return Err(BatchError::Underdetermined {
                grad_accum: self.grad_accum,
            });
        }
        Ok(())
    }

    /// Derives the full plan for `world_size` data-parallel processes.
    ///
    /// Rules: all three given -> they must satisfy the invariant; global + micro -> grad_accum =
    /// global / (micro x world); global + grad_accum -> micro = global / (grad_accum x world);
    /// micro + grad_accum -> global = micro x grad_accum x world; global only -> grad_accum 1,
    /// micro = global / world; micro only -> grad_accum 1, global = micro x world. A division
    /// that is not exact is an error with suggestions.
    pub fn resolve(&self, world_size: u64) -> Result<BatchPlan, BatchError> {
        let w = world_size;
        if w == 0 {
            return Err(BatchError::ZeroWorld);
        }
        self.check()?;
        if self.micro_auto {
            return self
                .auto_candidates(w)?
                .first()
                .copied()
                .ok_or_else(|| BatchError::Auto {
                    key: "max_micro",
                    problem: "leaves no micro batch to try".into(),
                });
        }
        let plan = |global, micro, grad_accum| plan_of(w, global, micro, grad_accum);
        match (self.global, self.micro, self.grad_accum) {
            (Some(g), Some(m), Some(a)) => self.all_three(g, m, a, w),
            (Some(g), Some(m), None) => self.global_and(g, Given::Micro(m), w),
            (Some(g), None, Some(a)) => self.global_and(g, Given::GradAccum(a), w),
            (Some(g), None, None) => self.global_only(g, w),
            (None, Some(m), Some(a)) => {
                let g = mul(&[("micro", m), ("grad_accum", a), ("world", w)])?;
                Ok(plan(g, m, a))
            }
            (None, Some(m), None) => {
                let g = mul(&[("micro", m), ("world", w)])?;
                Ok(plan(g, m, 1))
            }
            // `check` rejected these above; kept total without panicking.
            (None, None, a) => Err(BatchError::Underdetermined { grad_accum: a }),
        }
    }

    /// The plan of an elastic job on `world_size` workers: the configured global batch, kept
    /// exactly whatever the world. The configured plan when it fits this world; otherwise
    /// grad_accum follows, and micro too where the configured one no longer divides (the largest
    /// micro up to the configured one that does, as with `micro = "auto"`). An error when no
    /// global batch is configured or the world size does not divide it.
    pub fn resolve_elastic(&self, world_size: u64) -> Result<BatchPlan, BatchError> {
        let Some(g) = self.global else {
            return Err(BatchError::Elastic {
                problem: "an elastic job (--nnodes MIN:MAX) keeps the global batch through every change of world size, so it must be configured: set batch.global".into(),
            });
        };
        let exact = self.resolve(world_size);
        if exact.is_ok() || self.micro_auto || world_size == 0 {
            return exact;
        }
        if g % world_size != 0 {
            return Err(BatchError::Elastic {
                problem: format!("global {g} is not divisible by world {world_size}"),
            });
        }
        let cap = self.micro.or(self.max_micro).unwrap_or(g / world_size);
        BatchPlan::plans_keeping_global(g, world_size)
            .into_iter()
            .find(|p| p.micro <= cap)
            .ok_or_else(|| BatchError::Elastic {
                problem: format!(
                    "no micro batch up to {cap} keeps global {g} on world {world_size}"
                ),
            })
    }

    /// All three given: they must satisfy the invariant; the error suggests plans that do.
    fn all_three(&self, g: u64, m: u64, a: u64, w: u64) -> Result<BatchPlan, BatchError> {
        let p = mul(&[("micro", m), ("grad_accum", a), ("world", w)])?;
        if p == g {
            return Ok(plan_of(w, g, m, a));
        }
        let mut suggestions = vec![plan_of(w, p, m, a)];
        let mut keep = Vec::new();
        if g % w == 0 {
            let q = g / w;
            if q % m == 0 {
                keep.push(plan_of(w, g, m, q / m));
            }
            if q % a == 0 {
                keep.push(plan_of(w, g, q / a, a));
            }
            if keep.is_empty() {
                keep.extend(
                    nearest_divisors(q, m)
                        .into_iter()
                        .map(|d| plan_of(w, g, d, q / d)),
                );
            }
        }
        let mut detail = format!(
            "global {g} != micro {m} x grad_accum {a} x world {w} = {p}; nearest valid: global {p}"
        );
        if g % w != 0 {
            detail.push_str(", ");
            detail.push_str(&impossible_keep(g, w));
        } else if !keep.is_empty() {
            let texts: Vec<String> = keep
                .iter()
                .map(|k| format!("micro {} x grad_accum {}", k.micro, k.grad_accum))
                .collect();
            detail.push_str(&format!(", or keep global {g} with {}", join_or(&texts)));
        }
        suggestions.extend(keep);
        Err(BatchError::Mismatch {
            spec: Box::new(self.clone()),
            world_size: w,
            detail,
            suggestions,
        })
    }

    /// Global and one of micro / grad_accum given: the other = global / (given x world),
    /// exactly; otherwise an error naming the nearest globals that divide.
    fn global_and(&self, g: u64, given: Given, w: u64) -> Result<BatchPlan, BatchError> {
        let (name, v) = given.name_value();
        let d = mul(&[(name, v), ("world", w)])?;
        let plan = |n: u64| match given {
            Given::Micro(m) => plan_of(w, n, m, n / d),
            Given::GradAccum(a) => plan_of(w, n, n / d, a),
        };
        if g % d == 0 {
            return Ok(plan(g));
        }
        let near: Vec<BatchPlan> = neighbour_multiples(g, d).into_iter().map(plan).collect();
        let near_text: Vec<String> = near
            .iter()
            .map(|p| match given {
                Given::Micro(_) => format!("{} (grad_accum {})", p.global, p.grad_accum),
                Given::GradAccum(_) => format!("{} (micro {})", p.global, p.micro),
            })
            .collect();
        let mut detail = format!(
            "global {g} is not divisible by {name} {v} x world {w} = {d} ({g} / {d} = {}); nearest valid: global {}",
            ratio(g, d),
            join_or(&near_text)
        );
        let micro_given = matches!(given, Given::Micro(_));
        let keep = self.keep_global_text(g, w, v, micro_given, &mut detail);
        self.not_divisible(w, detail, near.into_iter().chain(keep).collect())
    }

    /// Global only: grad_accum 1, micro = global / world, exactly.
    fn global_only(&self, g: u64, w: u64) -> Result<BatchPlan, BatchError> {
        if g % w == 0 {
            return Ok(plan_of(w, g, g / w, 1));
        }
        let near: Vec<BatchPlan> = neighbour_multiples(g, w)
            .into_iter()
            .map(|n| plan_of(w, n, n / w, 1))
            .collect();
        let near_text: Vec<String> = near
            .iter()
            .map(|p| format!("{} (micro {})", p.global, p.micro))
            .collect();
        let detail = format!(
            "global {g} is not divisible by world {w} ({g} / {w} = {}); nearest valid: global {}",
            ratio(g, w),
            join_or(&near_text)
        );
        self.not_divisible(w, detail, near)
    }

    /// With `micro = "auto"`: every plan that keeps `global` on `world_size` workers with
    /// `micro <= max_micro`, largest micro first (the order in which they are tried). The first
    /// one is what [`BatchSpec::resolve`] returns before anything was measured.
    pub fn auto_candidates(&self, world_size: u64) -> Result<Vec<BatchPlan>, BatchError> {
        if world_size == 0 {
            return Err(BatchError::ZeroWorld);
        }
        self.check()?;
        let Some(g) = self.global else {
            return Err(BatchError::Underdetermined { grad_accum: None });
        };
        if g % world_size != 0 {
            let near: Vec<BatchPlan> = neighbour_multiples(g, world_size)
                .into_iter()
                .map(|n| BatchPlan {
                    global: n,
                    micro: n / world_size,
                    grad_accum: 1,
                    world_size,
                })
                .collect();
            let texts: Vec<String> = near.iter().map(|p| p.global.to_string()).collect();
            let detail = format!(
                "global {g} is not divisible by world {world_size} ({g} / {world_size} = {}), so no micro batch keeps it; nearest valid: global {}",
                ratio(g, world_size),
                join_or(&texts)
            );
            return self
                .not_divisible(world_size, detail, near)
                .map(|p| vec![p]);
        }
        if g / world_size > SUGGESTION_SEARCH_LIMIT {
            return Err(BatchError::Overflow {
                expression: format!("global {g} / world {world_size} (too large to search)"),
            });
        }
        let cap = self.max_micro.unwrap_or(u64::MAX);
        let plans: Vec<BatchPlan> = BatchPlan::plans_keeping_global(g, world_size)
            .into_iter()
            .filter(|p| p.micro <= cap)
            .collect();
        Ok(plans)
    }

    fn not_divisible(
        &self,
        world_size: u64,
        detail: String,
        suggestions: Vec<BatchPlan>,
    ) -> Result<BatchPlan, BatchError> {
        Err(BatchError::NotDivisible {
            spec: Box::new(self.clone()),
            world_size,
            detail,
            suggestions,
        })
    }

    /// Appends "or keep global ..." to `detail` and returns the plans it names. `given` is the
    /// requested micro (`given_is_micro`) or grad_accum.
    fn keep_global_text(
        &self,
        g: u64,
        w: u64,
        given: u64,
        given_is_micro: bool,
        detail: &mut String,
    ) -> Vec<BatchPlan> {
        if g % w != 0 {
            detail.push_str(", ");
            detail.push_str(&impossible_keep(g, w));
            return Vec::new();
        }
        let q = g / w;
        let plans: Vec<BatchPlan> = nearest_divisors(q, given)
            .into_iter()
            .map(|d| {
                let (micro, grad_accum) = if given_is_micro {
                    (d, q / d)
                } else {
                    (q / d, d)
                };
                BatchPlan {
                    global: g,
                    micro,
                    grad_accum,
                    world_size: w,
                }
            })
            .collect();
        if !plans.is_empty() {
            let texts: Vec<String> = plans
                .iter()
                .map(|p| {
                    if given_is_micro {
                        format!("{} (grad_accum {})", p.micro, p.grad_accum)
                    } else {
                        format!("{} (micro {})", p.grad_accum, p.micro)
                    }
                })
                .collect();
            let key = if given_is_micro {
                "micro"
            } else {
                "grad_accum"
            };
            detail.push_str(&format!(
                ", or keep global {g} with {key} {}",
                join_or(&texts)
            ));
        }
        plans
    }
}

impl BatchPlan {
    /// The plan of these four numbers, as given (see [`BatchPlan::is_consistent`]).
    pub const fn new(global: u64, micro: u64, grad_accum: u64, world_size: u64) -> BatchPlan {
        BatchPlan {
            global,
            micro,
            grad_accum,
            world_size,
        }
    }

    /// Whether `micro * grad_accum * world_size == global` (without overflow) and all are >= 1.
    pub fn is_consistent(&self) -> bool {
        self.micro >= 1
            && self.grad_accum >= 1
            && self.world_size >= 1
            && self
                .micro
                .checked_mul(self.grad_accum)
                .and_then(|p| p.checked_mul(self.world_size))
                == Some(self.global)
    }

    /// The arithmetic as one line, e.g. `micro 4 x grad_accum 2 x world 2 = global 16`.
    pub fn derivation(&self) -> String {
        format!(
            "micro {} x grad_accum {} x world {} = global {}",
            self.micro, self.grad_accum, self.world_size, self.global
        )
    }

    /// All plans with `micro * grad_accum * world_size == global`, largest `micro` first.
    /// Empty when `global` or `world_size` is 0 or `global` is not a multiple of `world_size`.
    /// Costs O(sqrt(global / world_size)).
    pub fn plans_keeping_global(global: u64, world_size: u64) -> Vec<BatchPlan> {
        if global == 0 || world_size == 0 || global % world_size != 0 {
            return Vec::new();
        }
        let q = global / world_size;
        divisors(q)
            .into_iter()
            .rev()
            .map(|micro| BatchPlan {
                global,
                micro,
                grad_accum: q / micro,
                world_size,
            })
            .collect()
    }
}

impl fmt::Display for BatchPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.derivation())
    }
}

/// A plan on `world_size` workers.
fn plan_of(world_size: u64, global: u64, micro: u64, grad_accum: u64) -> BatchPlan {
    BatchPlan::new(global, micro, grad_accum, world_size)
}

/// The one of micro / grad_accum that was given alongside the global batch.
#[derive(Debug, Clone, Copy)]
enum Given {
    Micro(u64),
    GradAccum(u64),
}

impl Given {
    fn name_value(self) -> (&'static str, u64) {
        match self {
            Given::Micro(m) => ("micro", m),
            Given::GradAccum(a) => ("grad_accum", a),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_elastic_plan_keeps_the_global_batch_changing_grad_accum_then_micro() {
        // world 6 -> 4 with micro 128: grad_accum 2 -> 3.
        let s = spec(Some(1536), Some(128), None);
        assert_eq!(s.resolve_elastic(6), Ok(BatchPlan::new(1536, 128, 2, 6)));
        assert_eq!(s.resolve_elastic(4), Ok(BatchPlan::new(1536, 128, 3, 4)));
        // global 96, micro 16 on world 4: 96 / 4 = 24 is not a multiple of 16, so micro 12.
        let s = spec(Some(96), Some(16), None);
        assert_eq!(s.resolve_elastic(4), Ok(BatchPlan::new(96, 12, 2, 4)));
        // All three given: the configured grad_accum gives way too.
        let s = spec(Some(256), Some(64), Some(2));
        assert_eq!(s.resolve_elastic(4), Ok(BatchPlan::new(256, 64, 1, 4)));
        let err = spec(Some(256), Some(64), None)
            .resolve_elastic(3)
            .unwrap_err();
        assert_eq!(err.key_path(), "batch.global");
        assert!(
            err.to_string()
                .contains("global 256 is not divisible by world 3"),
            "{err}"
        );
        let err = spec(None, Some(8), Some(2)).resolve_elastic(2).unwrap_err();
        assert!(err.to_string().contains("set batch.global"), "{err}");
    }

    fn spec(g: Option<u64>, m: Option<u64>, a: Option<u64>) -> BatchSpec {
        BatchSpec {
            global: g,
            micro: m,
            grad_accum: a,
            ..Default::default()
        }
    }

    fn auto(g: u64, max_micro: Option<u64>) -> BatchSpec {
        BatchSpec {
            global: Some(g),
            micro_auto: true,
            max_micro,
            ..Default::default()
        }
    }

    #[test]
    fn auto_tries_every_plan_keeping_global_largest_micro_first() {
        let plans = auto(192, None).auto_candidates(2).unwrap();
        let micros: Vec<u64> = plans.iter().map(|p| p.micro).collect();
        assert_eq!(micros, vec![96, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]);
        assert!(plans.iter().all(|p| p.is_consistent() && p.global == 192));
        // The cap keeps only micro batches up to it; resolve gives the largest.
        let capped = auto(192, Some(40)).auto_candidates(2).unwrap();
        assert_eq!(capped[0].micro, 32);
        assert_eq!(auto(192, Some(40)).resolve(2).unwrap(), plan(192, 32, 3, 2));
        assert_eq!(auto(192, None).resolve(3).unwrap(), plan(192, 64, 1, 3));
    }

    #[test]
    fn auto_errors_name_the_key() {
        let e = auto(100, None).resolve(3).unwrap_err();
        assert!(
            e.to_string()
                .contains("global 100 is not divisible by world 3"),
            "{e}"
        );
        assert!(e.to_string().contains("99 or 102"), "{e}");
        let mut s = auto(64, None);
        s.grad_accum = Some(2);
        let e = s.check().unwrap_err();
        assert_eq!(e.key_path(), "batch.grad_accum");
        assert!(e.to_string().contains("remove it"), "{e}");
        let s = BatchSpec {
            micro_auto: true,
            ..Default::default()
        };
        assert!(s
            .check()
            .unwrap_err()
            .to_string()
            .contains("needs batch.global"));
        let s = BatchSpec {
            global: Some(64),
            micro: Some(8),
            max_micro: Some(8),
            ..Default::default()
        };
        assert_eq!(s.check().unwrap_err().key_path(), "batch.max_micro");
        assert_eq!(
            auto(64, Some(0)).check().unwrap_err().key_path(),
            "batch.max_micro"
        );
    }

    #[test]
    fn auto_reads_and_writes_as_the_word() {
        let s: BatchSpec = toml::from_str("global = 64\nmicro = \"auto\"\nmax_micro = 16").unwrap();
        assert_eq!(s, auto(64, Some(16)));
        let text = toml::to_string(&s).unwrap();
        assert!(text.contains("micro = \"auto\""), "{text}");
        assert_eq!(toml::from_str::<BatchSpec>(&text).unwrap(), s);
        let e = toml::from_str::<BatchSpec>("global = 64\nmicro = \"big\"").unwrap_err();
        assert!(
            e.to_string()
                .contains("must be a number of samples or \"auto\" (got \"big\")"),
            "{e}"
        );
        let e = toml::from_str::<BatchSpec>("global = 64\nmikro = 2").unwrap_err();
        assert!(e.to_string().contains("mikro"), "{e}");
    }

    fn plan(global: u64, micro: u64, grad_accum: u64, world_size: u64) -> BatchPlan {
        BatchPlan::new(global, micro, grad_accum, world_size)
    }

    #[test]
    fn all_three_consistent() {
        let p = spec(Some(16), Some(4), Some(2)).resolve(2).unwrap();
        assert_eq!(p, plan(16, 4, 2, 2));
    }

    #[test]
    fn global_and_micro_derive_grad_accum() {
        assert_eq!(
            spec(Some(64), Some(16), None).resolve(2).unwrap(),
            plan(64, 16, 2, 2)
        );
        assert_eq!(
            spec(Some(64), Some(16), None).resolve(1).unwrap(),
            plan(64, 16, 4, 1)
        );
    }

    #[test]
    fn global_and_grad_accum_derive_micro() {
        assert_eq!(
            spec(Some(64), None, Some(4)).resolve(2).unwrap(),
            plan(64, 8, 4, 2)
        );
    }

    #[test]
    fn micro_and_grad_accum_derive_global() {
        assert_eq!(
            spec(None, Some(8), Some(3)).resolve(5).unwrap(),
            plan(120, 8, 3, 5)
        );
    }

    #[test]
    fn global_only() {
        assert_eq!(
            spec(Some(96), None, None).resolve(3).unwrap(),
            plan(96, 32, 1, 3)
        );
    }

    #[test]
    fn micro_only() {
        assert_eq!(
            spec(None, Some(12), None).resolve(4).unwrap(),
            plan(48, 12, 1, 4)
        );
    }

    #[test]
    fn grad_accum_only_or_nothing_is_an_error() {
        let e = spec(None, None, Some(4)).resolve(2).unwrap_err();
        assert_eq!(
            e,
            BatchError::Underdetermined {
                grad_accum: Some(4)
            }
        );
        assert_eq!(
            e.to_string(),
            "[batch] needs two of global, micro, grad_accum (only grad_accum 4 given)"
        );
        let e = BatchSpec::default().resolve(2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "[batch] needs two of global, micro, grad_accum (none given)"
        );
        assert_eq!(e.key_path(), "batch");
    }

    #[test]
    fn world_zero_is_an_error() {
        let e = spec(Some(8), Some(4), None).resolve(0).unwrap_err();
        assert_eq!(e, BatchError::ZeroWorld);
        assert_eq!(e.to_string(), "batch: world size must be >= 1 (got 0)");
    }

    #[test]
    fn zero_values_name_the_key() {
        for (s, key) in [
            (spec(Some(0), Some(4), None), "global"),
            (spec(Some(8), Some(0), None), "micro"),
            (spec(Some(8), None, Some(0)), "grad_accum"),
        ] {
            let e = s.resolve(1).unwrap_err();
            assert_eq!(e, BatchError::Zero { key });
            assert_eq!(e.to_string(), format!("`batch.{key}` must be >= 1 (got 0)"));
            assert_eq!(e.key_path(), format!("batch.{key}"));
        }
    }

    #[test]
    fn inconsistent_specs_name_the_nearest_valid_plans() {
        // (case, spec, world, message, the suggestions where the case checks them)
        let cases = [
            (
                "global and micro, world does not divide global",
                spec(Some(100), Some(8), None),
                3,
                "batch: global 100 is not divisible by micro 8 x world 3 = 24 (100 / 24 = 4.17); \
                 nearest valid: global 96 (grad_accum 4) or 120 (grad_accum 5), \
                 or keep global 100 with world 3: impossible (100 is not a multiple of 3)",
                Some(vec![plan(96, 8, 4, 3), plan(120, 8, 5, 3)]),
            ),
            (
                "global and micro, suggests micro keeping global",
                spec(Some(96), Some(10), None),
                4,
                "batch: global 96 is not divisible by micro 10 x world 4 = 40 (96 / 40 = 2.40); \
                 nearest valid: global 80 (grad_accum 2) or 120 (grad_accum 3), \
                 or keep global 96 with micro 8 (grad_accum 3) or 12 (grad_accum 2)",
                Some(vec![
                    plan(80, 10, 2, 4),
                    plan(120, 10, 3, 4),
                    plan(96, 8, 3, 4),
                    plan(96, 12, 2, 4),
                ]),
            ),
            (
                "global smaller than micro x world",
                spec(Some(10), Some(8), None),
                2,
                "batch: global 10 is not divisible by micro 8 x world 2 = 16 (10 / 16 = 0.62); \
                 nearest valid: global 16 (grad_accum 1), \
                 or keep global 10 with micro 5 (grad_accum 1)",
                None,
            ),
            (
                "global and grad_accum, world does not divide global",
                spec(Some(100), None, Some(4)),
                3,
                "batch: global 100 is not divisible by grad_accum 4 x world 3 = 12 (100 / 12 = 8.33); \
                 nearest valid: global 96 (micro 8) or 108 (micro 9), \
                 or keep global 100 with world 3: impossible (100 is not a multiple of 3)",
                None,
            ),
            (
                "global and grad_accum, suggests grad_accum keeping global",
                spec(Some(96), None, Some(5)),
                2,
                "batch: global 96 is not divisible by grad_accum 5 x world 2 = 10 (96 / 10 = 9.60); \
                 nearest valid: global 90 (micro 9) or 100 (micro 10), \
                 or keep global 96 with grad_accum 4 (micro 12) or 6 (micro 8)",
                None,
            ),
            (
                "global only",
                spec(Some(100), None, None),
                3,
                "batch: global 100 is not divisible by world 3 (100 / 3 = 33.33); \
                 nearest valid: global 99 (micro 33) or 102 (micro 34)",
                Some(vec![plan(99, 33, 1, 3), plan(102, 34, 1, 3)]),
            ),
            (
                "all three, world does not divide global",
                spec(Some(64), Some(8), Some(2)),
                3,
                "batch: global 64 != micro 8 x grad_accum 2 x world 3 = 48; nearest valid: global 48, \
                 or keep global 64 with world 3: impossible (64 is not a multiple of 3)",
                None,
            ),
            (
                "all three, suggests micro x grad_accum keeping global",
                spec(Some(64), Some(8), Some(2)),
                2,
                "batch: global 64 != micro 8 x grad_accum 2 x world 2 = 32; nearest valid: global 32, \
                 or keep global 64 with micro 8 x grad_accum 4 or micro 16 x grad_accum 2",
                None,
            ),
            (
                // Neither micro nor grad_accum can be kept: nearest micro values instead.
                "all three, neither micro nor grad_accum can be kept",
                spec(Some(36), Some(5), Some(5)),
                1,
                "batch: global 36 != micro 5 x grad_accum 5 x world 1 = 25; nearest valid: global 25, \
                 or keep global 36 with micro 4 x grad_accum 9 or micro 6 x grad_accum 6",
                None,
            ),
        ];
        for (case, s, world, message, suggestions) in cases {
            let e = s.resolve(world).unwrap_err();
            assert_eq!(e.to_string(), message, "{case}");
            if let Some(suggestions) = suggestions {
                assert_eq!(e.suggestions(), suggestions.as_slice(), "{case}");
            }
        }
        assert!(matches!(
            spec(Some(100), Some(8), None).resolve(3),
            Err(BatchError::NotDivisible { world_size: 3, .. })
        ));
        assert!(matches!(
            spec(Some(64), Some(8), Some(2)).resolve(3),
            Err(BatchError::Mismatch { .. })
        ));
    }

    #[test]
    fn overflow_is_an_error() {
        let big = 1u64 << 40;
        let e = spec(None, Some(big), Some(big)).resolve(2).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("batch: micro {big} x grad_accum {big} x world 2 does not fit in 64 bits")
        );
        let e = spec(Some(8), Some(u64::MAX), None).resolve(2).unwrap_err();
        assert!(matches!(e, BatchError::Overflow { .. }));
        let e = spec(None, Some(u64::MAX), None).resolve(2).unwrap_err();
        assert!(matches!(e, BatchError::Overflow { .. }));
        let e = spec(Some(8), None, Some(u64::MAX)).resolve(3).unwrap_err();
        assert!(matches!(e, BatchError::Overflow { .. }));
        let e = spec(Some(8), Some(u64::MAX), Some(2))
            .resolve(1)
            .unwrap_err();
        assert!(matches!(e, BatchError::Overflow { .. }));
    }

    #[test]
    fn huge_values_do_not_hang_or_panic() {
        // Suggestion searches are skipped above the limit; the error still has neighbours.
        let e = spec(Some(u64::MAX - 1), Some(3), None)
            .resolve(1)
            .unwrap_err();
        assert!(e.suggestions().iter().all(BatchPlan::is_consistent));
        let e = spec(Some(u64::MAX), Some(2), None).resolve(1).unwrap_err();
        assert!(!e.suggestions().is_empty());
        assert!(e.suggestions().iter().all(BatchPlan::is_consistent));
    }

    #[test]
    fn derivation_text() {
        assert_eq!(
            plan(16, 4, 2, 2).derivation(),
            "micro 4 x grad_accum 2 x world 2 = global 16"
        );
        assert_eq!(
            plan(16, 4, 2, 2).to_string(),
            plan(16, 4, 2, 2).derivation()
        );
    }

    #[test]
    fn plans_keeping_global_examples() {
        let plans = BatchPlan::plans_keeping_global(24, 2);
        let micros: Vec<u64> = plans.iter().map(|p| p.micro).collect();
        assert_eq!(micros, vec![12, 6, 4, 3, 2, 1]);
        assert!(plans.iter().all(BatchPlan::is_consistent));
        assert!(BatchPlan::plans_keeping_global(25, 2).is_empty());
        assert!(BatchPlan::plans_keeping_global(0, 2).is_empty());
        assert!(BatchPlan::plans_keeping_global(8, 0).is_empty());
        assert_eq!(
            BatchPlan::plans_keeping_global(7, 7),
            vec![plan(7, 1, 1, 7)]
        );
    }

    #[test]
    fn messages_are_one_line() {
        for s in [
            spec(Some(100), Some(8), None),
            spec(Some(64), Some(8), Some(2)),
            spec(None, None, None),
        ] {
            let e = s.resolve(3).unwrap_err();
            assert!(!e.to_string().contains('\n'));
        }
    }

    fn opt_value() -> impl Strategy<Value = Option<u64>> {
        prop::option::of(1u64..=4096)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn resolve_upholds_invariant(g in opt_value(), m in opt_value(), a in opt_value(), w in 1u64..=64) {
            let s = spec(g, m, a);
            match s.resolve(w) {
                Ok(p) => {
                    prop_assert!(p.is_consistent(), "{p:?}");
                    prop_assert_eq!(p.world_size, w);
                    if let Some(g) = g { prop_assert_eq!(p.global, g); }
                    if let Some(m) = m { prop_assert_eq!(p.micro, m); }
                    if let Some(a) = a { prop_assert_eq!(p.grad_accum, a); }
                    if (g.is_none() || m.is_none()) && a.is_none() {
                        prop_assert_eq!(p.grad_accum, 1);
                    }
                }
                Err(e) => {
                    prop_assert!(!e.to_string().contains('\n'));
                    for sug in e.suggestions() {
                        prop_assert!(sug.is_consistent(), "{sug:?} from {e}");
                        prop_assert_eq!(sug.world_size, w);
                    }
                    match &e {
                        BatchError::NotDivisible { suggestions, .. }
                        | BatchError::Mismatch { suggestions, .. } => {
                            prop_assert!(!suggestions.is_empty());
                        }
                        BatchError::Underdetermined { .. } => {
                            prop_assert!(g.is_none() && m.is_none());
                        }
                        other => prop_assert!(false, "unexpected error {other:?}"),
                    }
                }
            }
        }

        #[test]
        fn resolve_accepts_every_consistent_triple(m in 1u64..=4096, a in 1u64..=64, w in 1u64..=64) {
            let g = m * a * w;
            prop_assert_eq!(spec(Some(g), Some(m), Some(a)).resolve(w), Ok(plan(g, m, a, w)));
            prop_assert_eq!(spec(Some(g), Some(m), None).resolve(w), Ok(plan(g, m, a, w)));
            prop_assert_eq!(spec(Some(g), None, Some(a)).resolve(w), Ok(plan(g, m, a, w)));
            prop_assert_eq!(spec(None, Some(m), Some(a)).resolve(w), Ok(plan(g, m, a, w)));
        }

        #[test]
        fn plans_keeping_global_matches_brute_force(g in 1u64..=4096, w in 1u64..=64) {
            let got = BatchPlan::plans_keeping_global(g, w);
            let mut expected = Vec::new();
            for micro in (1..=g).rev() {
                for grad_accum in 1..=(g / micro) {
                    if micro * grad_accum * w == g {
                        expected.push(plan(g, micro, grad_accum, w));
                    }
                }
            }
            prop_assert_eq!(got, expected);
        }
    }
}
