//! `dist.zero`: a ZeRO stage, or `"auto"` (the memory plan chooses). Owns the value's TOML form
//! and which stages are built; which stage `"auto"` picks is the memory plan's
//! ([`crate::memory::stages`]), and what a stage does is the DDP engine's.

use std::fmt;

/// `dist.zero` as a config holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// A stage the user chose (validation accepts only [`ZeroStage::BUILT`]).
    Stage(u8),
    /// The memory plan chooses before training starts (`launch --dry-run` shows its choice).
    Auto,
}

impl ZeroStage {
    /// The stages that are built, in order of the traffic a step moves (stages 1 and 2 move
    /// DDP's bytes: a reduce-scatter and an all-gather are an all-reduce's two halves; stage 3
    /// gathers each unit for its forward and again for its backward, 1.5x for a model that runs
    /// each unit once a micro-batch).
    pub const BUILT: [u8; 4] = [0, 1, 2, 3];

    /// The stage to plan and run with: a chosen one as it is; `"auto"` not yet resolved counts
    /// as stage 0 (every rank keeps everything, the most memory: an estimate on the safe side).
    pub fn stage(self) -> u8 {
        match self {
            ZeroStage::Stage(s) => s,
            ZeroStage::Auto => 0,
        }
    }

    pub fn is_auto(self) -> bool {
        self == ZeroStage::Auto
    }
}

impl Default for ZeroStage {
    fn default() -> ZeroStage {
        ZeroStage::Stage(0)
    }
}

impl From<u8> for ZeroStage {
    fn from(stage: u8) -> ZeroStage {
        ZeroStage::Stage(stage)
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZeroStage::Stage(s) => write!(f, "{s}"),
            ZeroStage::Auto => f.write_str("\"auto\""),
        }
    }
}

impl serde::Serialize for ZeroStage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ZeroStage::Stage(n) => s.serialize_u8(*n),
            ZeroStage::Auto => s.serialize_str("auto"),
        }
    }
}

/// By hand, so that a bad value is reported at the value (file:line:column).
impl<'de> serde::Deserialize<'de> for ZeroStage {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ZeroStage, D::Error> {
        struct Visitor;
        const EXPECTED: &str = "0, 1, 2, 3 or \"auto\"";
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ZeroStage;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ZeroStage, E> {
                match u8::try_from(v) {
                    Ok(s) if s <= 3 => Ok(ZeroStage::Stage(s)),
                    // Validation says which of them are built.
                    _ => Err(E::custom(format!("must be {EXPECTED} (got {v})"))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ZeroStage, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("must be {EXPECTED} (got {v})"))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ZeroStage, E> {
                if v == "auto" {
                    Ok(ZeroStage::Auto)
                } else {
                    Err(E::custom(format!("must be {EXPECTED} (got {v:?})")))
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}
