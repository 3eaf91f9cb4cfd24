//! The records of `metrics.jsonl`: one per optimizer step, one per evaluation.

use serde::{Deserialize, Serialize};

use recommender::eval::Metrics;

/// A baseline's evaluation as a line of `metrics.jsonl`, written once at a fresh start (the
/// curves draw it beside the model's): `{"kind":"baseline","model":"pop","split":"valid",
/// "users":..,"recall@10":..,...}`.
pub fn baseline_record(model: &str, split: &str, metrics: &Metrics) -> serde_json::Value {
    let mut record = eval_record(split, 0, 0, metrics, 0.0);
    if let serde_json::Value::Object(map) = &mut record {
        for key in ["epoch", "step", "seconds"] {
            map.remove(key);
        }
        map.insert("kind".into(), "baseline".into());
        map.insert("model".into(), model.into());
    }
    record
}

/// One evaluation as a line of `metrics.jsonl`: `{"kind":"eval","split":"valid","epoch":..,
/// "step":..,"users":..,"recall@10":..,...,"seconds":..}`.
pub fn eval_record(
    split: &str,
    epoch: u64,
    step: u64,
    metrics: &Metrics,
    seconds: f64,
) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    map.insert("kind".into(), "eval".into());
    map.insert("split".into(), split.into());
    map.insert("epoch".into(), epoch.into());
    map.insert("step".into(), step.into());
    map.insert("users".into(), metrics.users.into());
    for (i, k) in metrics.ks.iter().enumerate() {
        for (name, series) in Metrics::NAMES.iter().zip(metrics.columns()) {
            map.insert(format!("{name}@{k}"), series[i].into());
        }
    }
    map.insert("seconds".into(), seconds.into());
    serde_json::Value::Object(map)
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    pub kind: String,
    pub epoch: u64,
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub samples_per_s: f64,
    /// The largest peak memory over the ranks so far, sampled after a step's backward passes at
    /// most every half second (MiB; RSS on the CPU, device memory on GPUs), and the rank that
    /// has it. On every step
    /// record; optional only to read files older runs wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mem_mib: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mem_rank: Option<u64>,
}
