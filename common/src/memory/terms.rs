//! The terms of the estimate, one function per group: the process, the model's parameters and
//! optimizer, the text side, activations, evaluation and the allocator's reserve.

use super::*;

/// What every term of the estimate reads: the config, the plan, the data, the device and
/// derived sizes.
pub(super) struct Inputs<'a> {
    pub(super) config: &'a Config,
    pub(super) plan: &'a BatchPlan,
    pub(super) data: &'a DataShape,
    pub(super) device: DeviceKind,
    pub(super) cuda: bool,
    pub(super) bf16: bool,
    /// How the model reads text (`None`: IDs only).
    pub(super) text: Option<TextMode>,
    pub(super) gpt2: Gpt2Dims,
    /// GPT-2's width and the ID embedding size.
    pub(super) d: u64,
    pub(super) dim: u64,
    /// Ranks of the job on this worker's host.
    pub(super) host_ranks: u64,
}

/// Parameter counts of the model (f32 values).
pub(super) struct Sizes {
    /// Projections of the text features into the ID space, and the MLP scorer.
    pub(super) proj: u64,
    pub(super) mlp: u64,
    /// The history tower's item rows (0 without it).
    pub(super) history: u64,
    pub(super) gpt2_params: u64,
    pub(super) gpt2_trainable: u64,
    /// GPT-2 blocks that train (and so keep activations).
    pub(super) trained_blocks: u64,
    pub(super) params: u64,
    pub(super) trainable: u64,
    /// Trainable values that the host's ranks keep once, in shared memory (0 unless they do:
    /// see [`kept_once_values`]).
    pub(super) shared: u64,
    /// Trainable values whose AdamW moments each rank keeps only its share of under ZeRO stage
    /// 1 or 2 (`dist.zero`; 0 where it does not apply: see [`zero_sharded_values`]).
    pub(super) zero_sharded: u64,
}

/// The process itself: the CUDA context, or libtorch's RSS, the host data and the tokenizer.
pub(super) fn runtime_terms(x: &Inputs<'_>) -> Vec<MemoryTerm> {
    let (cuda, data) = (x.cuda, x.data);
    let mut terms = vec![MemoryTerm {
        name: if cuda {
            "CUDA context"
        } else {
            "runtime (libtorch)"
        },
        bytes: if cuda {
            CUDA_CONTEXT_BYTES
        } else {
            CPU_RUNTIME_BYTES
        },
        held: Held::Always,
        detail: if cuda {
            "context, kernels and libraries, measured on an H100".into()
        } else {
            "process baseline, measured".into()
        },
    }];
    if !cuda {
        terms.push(MemoryTerm {
            name: "data (host)",
            bytes: data.interactions * HOST_BYTES_PER_INTERACTION,
            held: Held::Always,
            detail: format!(
                "{} interactions x {HOST_BYTES_PER_INTERACTION} B ({})",
                data.interactions, data.source
            ),
        });
    }
    if !cuda && x.config.model.kind == ModelKind::Gpt2rec {
        terms.push(MemoryTerm {
            name: "tokenizer (host)",
            bytes: TOKENIZER_BYTES,
            held: Held::Always,
            detail: "GPT-2 BPE tables, measured".into(),
        });
    }
    terms
}

/// Parameters: ID embeddings, text projections, MLP scorer, GPT-2 in dynamic mode.
pub(super) fn model_sizes(x: &Inputs<'_>) -> Sizes {
    let (m, gpt2, d, dim) = (&x.config.model, &x.gpt2, x.d, x.dim);
    let ids = (x.data.users + x.data.items) * dim;
    // The history tower's item rows: dense, trained as a whole.
    let history = if m.user_tower == UserTower::Id {
        0
    } else {
        x.data.items * dim + item_item_values(x)
    };
    let proj = if x.text.is_some() {
        2 * (d * dim + dim)
    } else {
        0
    };
    let mlp = if m.scorer == ScorerKind::Mlp {
        2 * dim * dim + dim + dim + 1
    } else {
        0
    };
    let (gpt2_params, gpt2_trainable, trained_blocks) = match x.text {
        Some(TextMode::Dynamic) => {
            let all = gpt2.params();
            let blocks = if m.freeze_gpt2 {
                0
            } else {
                m.trainable_layers
                    .map_or(gpt2.n_layer, |n| u64::from(n).min(gpt2.n_layer))
            };
            let trainable = if m.freeze_gpt2 {
                0
            } else if m.trainable_layers.is_some() {
                blocks * gpt2.block_params() + if blocks > 0 { 2 * d } else { 0 }
            } else {
                all
            };
            (all, trainable, blocks)
        }
        _ => (0, 0, 0),
    };
    // The token table is row-sparse (and so shared) when it trains: when every GPT-2 weight does.
    let wte = if gpt2_trainable > 0 && gpt2_trainable == gpt2_params {
        gpt2.vocab_size * d
    } else {
        0
    };
    let trainable = ids + history + proj + mlp + gpt2_trainable;
    let shared = kept_once_values(x, ids + wte, trainable);
    Sizes {
        zero_sharded: zero_sharded_values(x, ids + wte, trainable, shared),
        proj,
        mlp,
        gpt2_params,
        gpt2_trainable,
        trained_blocks,
        history,
        params: ids + history + proj + mlp + gpt2_params,
        trainable,
        shared,
    }
}

/// Of the trainable values, those the ranks keep once per host when every rank of the job is
/// on this host, on the CPU, with shared memory: all of them (`trainable`) with
/// `dist.shard_optimizer` (`runtime::ddp`'s host shards), the row-sparse `tables` (the ID
/// embeddings, and GPT-2's token table when it trains) with `dist.shared_tables` and row-sparse
/// exchanges. Otherwise every rank holds its own copy: 0.
fn kept_once_values(x: &Inputs<'_>, tables: u64, trainable: u64) -> u64 {
    let dist = &x.config.dist;
    let one_host = !x.cuda
        && x.plan.world_size > 1
        && x.host_ranks >= x.plan.world_size
        && dist.backend != crate::config::Backend::Nccl
        && dist.shared_memory;
    match one_host {
        true if dist.shard_optimizer => trainable,
        true if dist.sparse_embeddings && dist.shared_tables => tables,
        _ => 0,
    }
}

/// Of the trainable values, those whose moments ZeRO shards (`runtime::ddp`'s `zero`; stage 2
/// their gradients too): every dense one where `dist.zero` 1 or 2 applies (several ranks, and not the one-host shared
/// memory form of stage 1, which keeps every trainable value once: `shared == trainable`),
/// less the row-sparse `tables`, whose moments every rank keeps (or its host once).
fn zero_sharded_values(x: &Inputs<'_>, tables: u64, trainable: u64, shared: u64) -> u64 {
    let dist = &x.config.dist;
    if dist.zero.stage() == 0 || x.plan.world_size < 2 || (shared > 0 && shared == trainable) {
        return 0;
    }
    let sparse = if dist.sparse_embeddings { tables } else { 0 };
    trainable.saturating_sub(sparse)
}

/// Parameters, gradients, AdamW's state and temporaries, rank 0's checkpoint, the all-reduce
/// and NCCL buffers, and autocast's bf16 copies.
pub(super) fn parameter_terms(x: &Inputs<'_>, s: &Sizes) -> Vec<MemoryTerm> {
    let (params, trainable) = (s.params, s.trainable);
    let parts = parameter_parts(x, s);
    let largest = largest_trainable(x, s);
    let shared = s.shared;
    let mut terms = vec![
        MemoryTerm {
            name: "parameters",
            bytes: (params - shared) * F32,
            held: Held::Always,
            detail: match shared {
                0 => format!("{params} f32: {parts}"),
                _ => format!("{params} f32: {parts}, less {shared} kept once per host"),
            },
        },
        gradients_term(x, s),
        optimizer_term(x, s),
    ];
    if let Some(units) = stage_3_units(x, s) {
        terms[0] = stage_3_parameters(x, s, &parts);
        terms.extend(gathered_terms(x, s, units));
    }
    if shared > 0 {
        terms.push(shared_term(x, shared));
    }
    terms.extend([
        match offloads(x, s) && x.cuda {
            true => MemoryTerm {
                name: "optimizer temporaries",
                bytes: 0,
                held: Held::Training,
                detail: "none: the update runs in host memory (dist.offload)".into(),
            },
            false => MemoryTerm {
                name: "optimizer temporaries",
                bytes: 3 * largest * F32,
                held: Held::Training,
                detail: format!("3 x the largest trainable tensor ({largest} f32)"),
            },
        },
        // Rank 0's checkpoint: snapshots of the optimizer state, then each file's bytes.
        MemoryTerm {
            name: "checkpoint (rank 0)",
            bytes: (2 * trainable + params.max(2 * trainable)) * F32,
            held: Held::Checkpoint,
            detail: "optimizer snapshot + the larger file's bytes".into(),
        },
    ]);
    if x.plan.world_size > 1 {
        let bucket_mb = x.config.dist.bucket_mb;
        let bucket = (bucket_mb * MIB) as u64;
        terms.push(MemoryTerm {
            name: "all-reduce buffers",
            bytes: 2 * bucket.min(trainable * F32),
            held: Held::Training,
            detail: format!("2 x one bucket (dist.bucket_mb {bucket_mb})"),
        });
    }
    terms.extend(nccl_buffers(x.config, x.plan, x.device));
    if x.bf16 && s.gpt2_params > 0 {
        terms.push(MemoryTerm {
            name: "bf16 weight copies",
            bytes: s.gpt2_params * 2,
            held: Held::Training,
            detail: "autocast's bf16 copies of GPT-2's weights".into(),
        });
    }
    terms
}

/// Under ZeRO stage 3 (where it applies), the units it gathers one at a time: (values in one,
/// in all of them), GPT-2's trained blocks; (0, 0) without them (everything is then gathered
/// for each whole step). `None` where stage 3 does not apply.
fn stage_3_units(x: &Inputs<'_>, s: &Sizes) -> Option<(u64, u64)> {
    if x.config.dist.zero.stage() < 3 || s.zero_sharded == 0 {
        return None;
    }
    let unit = if s.trained_blocks > 0 && s.gpt2_trainable > 0 {
        x.gpt2.block_params()
    } else {
        0
    };
    Some((unit, (unit * s.trained_blocks).min(s.zero_sharded)))
}

/// Stage 3's parameters between uses: every value not sharded, and this rank's shard of the
/// dense ones.
fn stage_3_parameters(x: &Inputs<'_>, s: &Sizes, parts: &str) -> MemoryTerm {
    let (params, sharded) = (s.params, s.zero_sharded);
    let world = x.plan.world_size.max(1);
    MemoryTerm {
        name: "parameters",
        bytes: (params - s.shared - sharded + sharded.div_ceil(world)) * F32,
        held: Held::Always,
        detail: format!(
            "{params} f32: {parts}; of {sharded} dense ones 1/{world} kept between uses (dist.zero = 3)"
        ),
    }
}

/// Stage 3's gathered values: during a step the ones outside the units whole and three units
/// (in backward the one whose pass just ran, the next one and the buffer it is gathered
/// through); during evaluations and checkpoints every dense value whole.
fn gathered_terms(x: &Inputs<'_>, s: &Sizes, (unit, in_units): (u64, u64)) -> [MemoryTerm; 2] {
    let sharded = s.zero_sharded;
    let window = sharded - in_units;
    [
        MemoryTerm {
            name: "gathered parameters",
            bytes: (window + 3 * unit).min(sharded) * F32,
            held: Held::Training,
            detail: format!(
                "{window} f32 whole for each step + 3 GPT-2 blocks of {unit} (the one running, the next and its gathering buffer; dist.zero = 3)"
            ),
        },
        MemoryTerm {
            name: "gathered parameters (evaluation)",
            bytes: sharded * F32,
            held: Held::Eval,
            detail: format!(
                "{sharded} dense f32 whole for evaluations and checkpoints (dist.zero = 3, {} ranks)",
                x.plan.world_size
            ),
        },
    ]
}

/// The gradients: one per trainable value; under ZeRO stage 2, of the dense ones (those whose
/// moments are sharded) this rank's shard, plus what is whole during backward: two buckets (the
/// one filling and the one being reduce-scattered), or the largest parameter (a bucket of its
/// own) and one more. With accumulation, or with activation checkpointing (the buckets are
/// then reduced once the recomputation is done), the whole gradients exist at once (DDP's sums
/// need them), and the shards come on top.
fn gradients_term(x: &Inputs<'_>, s: &Sizes) -> MemoryTerm {
    let (trainable, sharded) = (s.trainable, s.zero_sharded);
    let world = x.plan.world_size.max(1);
    let mut term = MemoryTerm {
        name: "gradients",
        bytes: trainable * F32,
        held: Held::Always,
        detail: format!("{trainable} trainable f32"),
    };
    if x.config.dist.zero.stage() < 2 || sharded == 0 {
        return term;
    }
    let shard = sharded.div_ceil(world);
    let whole = match (
        x.plan.grad_accum > 1,
        x.config.model.activation_checkpointing,
    ) {
        (true, _) => Some("while accumulating"),
        (false, true) => Some("with activation checkpointing"),
        (false, false) => None,
    };
    if let Some(why) = whole {
        term.bytes = (trainable + shard) * F32;
        term.detail = format!(
            "{trainable} trainable f32 whole {why}, + 1/{world} of {sharded} (dist.zero = {})",
            x.config.dist.zero.stage()
        );
        return term;
    }
    let bucket_mb = x.config.dist.bucket_mb;
    let bucket = (bucket_mb * MIB) as u64 / F32;
    let mut in_flight = (2 * bucket)
        .max(largest_trainable(x, s) + bucket)
        .min(sharded);
    // Stage 3 reduces each unit once it is complete, the others after the last one.
    if let Some((unit, in_units)) = stage_3_units(x, s).filter(|(unit, _)| *unit > 0) {
        in_flight = (sharded - in_units + 2 * unit).min(sharded);
    }
    let stage = x.config.dist.zero.stage();
    term.bytes = (trainable - sharded + shard + in_flight) * F32;
    term.detail = format!(
        "{} f32 + 1/{world} of {sharded} dense ones (dist.zero = {stage}) + {in_flight} whole during backward (2 buckets of dist.bucket_mb {bucket_mb}, or the largest parameter and a bucket; under stage 3 those outside the units and 2 units)",
        trainable - sharded
    );
    term
}

/// What the parameters are, for the term's detail: `IDs (6040+3629) x 64 + projections ...`.
fn parameter_parts(x: &Inputs<'_>, s: &Sizes) -> String {
    let (d, dim) = (x.d, x.dim);
    let mut parts = vec![format!("IDs ({}+{}) x {dim}", x.data.users, x.data.items)];
    if s.proj > 0 {
        parts.push(format!("projections 2 x {d} x {dim}"));
    }
    if s.history > 0 {
        parts.push(format!("history {} x {dim}", x.data.items));
    }
    if item_item_values(x) > 0 {
        parts.push(format!("item-item {0} x {0}", x.data.items));
    }
    if s.mlp > 0 {
        parts.push("MLP scorer".into());
    }
    if s.gpt2_params > 0 {
        parts.push(format!(
            "GPT-2 {} {}",
            x.config.model.gpt2_label(),
            s.gpt2_params
        ));
    }
    parts.join(" + ")
}

/// Values in the largest trainable tensor: AdamW works parameter by parameter, with three
/// temporaries of that size.
fn largest_trainable(x: &Inputs<'_>, s: &Sizes) -> u64 {
    let (d, dim) = (x.d, x.dim);
    [
        x.data.users * dim,
        x.data.items * dim,
        s.proj / 2,
        s.mlp,
        item_item_values(x),
    ]
    .into_iter()
    .chain((s.gpt2_trainable > 0).then_some(x.gpt2.vocab_size * d))
    .max()
    .unwrap_or(0)
}

/// AdamW's two moments: per trainable value, less those kept once per host, and of the ones
/// ZeRO stages 1 and 2 shard only this rank's share; none on a GPU that offloads them.
fn optimizer_term(x: &Inputs<'_>, s: &Sizes) -> MemoryTerm {
    let (trainable, shared, sharded) = (s.trainable, s.shared, s.zero_sharded);
    let world = x.plan.world_size.max(1);
    let kept = trainable - shared - sharded + sharded.div_ceil(world);
    let mut detail = match (shared, sharded) {
        (0, 0) => "2 moments per trainable value".to_string(),
        (_, 0) => "2 moments per trainable value not kept once per host".into(),
        _ => format!(
            "2 moments per trainable value not kept once per host, of {sharded} dense ones 1/{world} (dist.zero = {})",
            x.config.dist.zero.stage()
        ),
    };
    let offloaded = offloads(x, s);
    if offloaded {
        let host = mib_text(2 * kept * F32);
        detail = match x.cuda {
            true => format!("none: {detail}, {host}, in host memory (dist.offload)"),
            false => format!("{detail}, in host memory as on any CPU run (dist.offload)"),
        };
    }
    MemoryTerm {
        name: "optimizer (AdamW)",
        bytes: if offloaded && x.cuda {
            0
        } else {
            2 * kept * F32
        },
        held: Held::Always,
        detail,
    }
}

/// Whether AdamW's moments live in host memory and its update runs there (`dist.offload`),
/// not where the one-host shared-memory form of stage 1 keeps every value anyway.
fn offloads(x: &Inputs<'_>, s: &Sizes) -> bool {
    let host_sharded = s.shared > 0 && s.shared == s.trainable;
    x.config.dist.offload == OffloadKind::Optimizer && !host_sharded
}

/// This rank's share of the parameters and moments its host keeps once in shared memory.
fn shared_term(x: &Inputs<'_>, shared: u64) -> MemoryTerm {
    let ranks = x.host_ranks;
    let (name, key) = match x.config.dist.shard_optimizer {
        true => ("shared parameters", "dist.shard_optimizer"),
        false => ("shared tables", "dist.shared_tables"),
    };
    MemoryTerm {
        name,
        bytes: (3 * shared * F32).div_ceil(ranks),
        held: Held::Always,
        detail: format!(
            "1/{ranks} of {shared} f32 + 2 moments, kept once by the host's {ranks} ranks ({key})"
        ),
    }
}

/// The text side: cached features (and the encoder that builds them), or token tables.
pub(super) fn text_terms(x: &Inputs<'_>) -> Vec<MemoryTerm> {
    let (m, gpt2, d, data) = (&x.config.model, &x.gpt2, x.d, x.data);
    let (users, items) = (data.users, data.items);
    match x.text {
        Some(TextMode::Cached) => {
            // Building them: a frozen GPT-2, the gathered and standardised copies of a table.
            let rows = users.max(items);
            let encode =
                CACHE_ROWS * data.item_tokens.max(data.user_tokens) * d * ENCODE_COPIES * F32;
            vec![
                MemoryTerm {
                    name: "cached text features",
                    bytes: (users + items) * d * F32,
                    held: Held::Always,
                    detail: format!("({users}+{items}) x {d} f32"),
                },
                MemoryTerm {
                    name: "text encoder (caching)",
                    bytes: gpt2.params() * F32 + 4 * rows * d * F32 + encode,
                    held: Held::Build,
                    detail: format!(
                        "frozen GPT-2 {} {} f32 + 4 copies of a {rows} x {d} table + {CACHE_ROWS} rows x {} tokens x {ENCODE_COPIES} copies of {d} encoding",
                        m.gpt2_label(),
                        gpt2.params(),
                        data.item_tokens.max(data.user_tokens)
                    ),
                },
            ]
        }
        Some(TextMode::Dynamic) => vec![
            MemoryTerm {
                name: "GPT-2 initialisation",
                bytes: gpt2.vocab_size * d * F32,
                held: Held::Build,
                detail: "a copy of the token embedding while it is initialised".into(),
            },
            MemoryTerm {
                name: "token tables",
                bytes: (users + items) * m.max_text_tokens as u64 * 16,
                held: Held::Always,
                detail: format!(
                    "({users}+{items}) x {} tokens x (i64 id + i64 mask)",
                    m.max_text_tokens
                ),
            },
        ],
        None => Vec::new(),
    }
}

/// Activations of one micro-batch: B users, B positives and B negatives, and GPT-2's in
/// dynamic mode.
pub(super) fn activation_terms(x: &Inputs<'_>, s: &Sizes) -> Vec<MemoryTerm> {
    let (b, d, dim) = (x.plan.micro, x.d, x.dim);
    let width = if x.text.is_some() { dim + d } else { dim };
    let mut id_bytes = 3 * b * width * ID_ROW_COPIES * F32;
    if s.mlp > 0 {
        id_bytes += 2 * b * 4 * dim * F32;
    }
    let mut terms = vec![MemoryTerm {
        name: "activations (IDs)",
        bytes: id_bytes,
        held: Held::Training,
        detail: format!("3 x micro {b} rows x {width} x {ID_ROW_COPIES} copies x 4 B"),
    }];
    if x.config.train.loss == LossKind::Softmax {
        terms.push(softmax_activations(x, width));
    }
    if x.text == Some(TextMode::Dynamic) {
        terms.push(gpt2_activations(x, s));
    }
    terms
}

/// The softmax's negatives: their rows (as the IDs') and the logits of every sample against
/// each (scores, the f32 copy, log-softmax and its gradient).
fn softmax_activations(x: &Inputs<'_>, width: u64) -> MemoryTerm {
    let b = x.plan.micro;
    let n = match x.config.train.negatives {
        0 => x.data.items,
        n => u64::from(n),
    };
    // The item-item matrix's scores [micro, items] and their gradient, gathered at the negatives.
    let item_scores = if item_item_values(x) > 0 {
        b * x.data.items * ITEM_SCORE_COPIES
    } else {
        0
    };
    MemoryTerm {
        name: "activations (softmax)",
        bytes: (n * width * ID_ROW_COPIES + b * n * LOGIT_COPIES + item_scores) * F32,
        held: Held::Training,
        detail: format!(
            "{n} negatives x {width} x {ID_ROW_COPIES} copies + micro {b} x {n} logits x {LOGIT_COPIES} copies{}, x 4 B",
            if item_scores > 0 {
                format!(" + micro {b} x {} item-item scores x {ITEM_SCORE_COPIES} copies", x.data.items)
            } else {
                String::new()
            }
        ),
    }
}

/// The item-item matrix's values (`model.item_item`, with a history tower; 0 without).
fn item_item_values(x: &Inputs<'_>) -> u64 {
    let m = &x.config.model;
    if m.item_item && m.user_tower != UserTower::Id {
        x.data.items * x.data.items
    } else {
        0
    }
}

/// f32 copies of a micro-batch's item-item scores (the sums, the pools, their gradients).
const ITEM_SCORE_COPIES: u64 = 5;

/// f32 copies of a micro-batch's logits against the negatives.
const LOGIT_COPIES: u64 = 6;

/// GPT-2's activations in dynamic mode. Users' texts and items' (positives and negatives
/// together) go through GPT-2 as two batches, each cut to its longest text. Only blocks above
/// the frozen ones keep activations for backward; a frozen stack still needs one block's
/// working set.
pub(super) fn gpt2_activations(x: &Inputs<'_>, s: &Sizes) -> MemoryTerm {
    let (b, d, gpt2) = (x.plan.micro, x.d, &x.gpt2);
    let (lu, li) = (x.data.user_tokens, x.data.item_tokens);
    let trained_blocks = s.trained_blocks;
    let token_rows = b * lu + 2 * b * li;
    let score_rows = b * lu * lu + 2 * b * li * li;
    let kept = trained_blocks.max(1);
    let (copies, dtype) = match (x.cuda, x.bf16) {
        (false, _) => (BLOCK_ACTIVATION_COPIES, F32),
        (true, false) => (CUDA_BLOCK_ACTIVATION_COPIES, F32),
        (true, true) => (CUDA_BF16_BLOCK_ACTIVATION_COPIES, 2),
    };
    let per_input = if x.cuda {
        CUDA_CHECKPOINT_COPIES_PER_BLOCK
    } else {
        CHECKPOINT_COPIES_PER_BLOCK
    };
    // On CUDA the fused attention (FlashAttention, memory-efficient) keeps no scores, only a
    // row's log-sum-exp; the CPU trains through the math path (its fused kernel takes no
    // dropout), which keeps them.
    let scores = if x.cuda {
        0
    } else {
        score_rows * gpt2.n_head * ATTENTION_SCORE_COPIES * F32
    };
    let per_block = token_rows * d * copies * dtype + scores;
    let embed = if trained_blocks > 0 {
        token_rows * d * EMBEDDING_COPIES * F32
    } else {
        0
    };
    // On the CPU the f32 count stands for bf16 too (not measured there: an upper bound).
    let in_bf16 = if x.cuda && x.bf16 { " in bf16" } else { "" };
    let (bytes, detail) = if x.config.model.activation_checkpointing && trained_blocks > 0 {
        // Each trained block keeps its f32 input; backward recomputes one block at a time
        // and passes the gradient at its input and output on. Never more than without.
        let inputs = trained_blocks * per_input + CHECKPOINT_BOUNDARY_COPIES;
        (
            (inputs * token_rows * d * F32 + per_block + embed).min(kept * per_block + embed),
            format!(
                "checkpointed: micro {b} x ({lu} + 2 x {li} tokens) x {d} wide x ({trained_blocks} blocks x {per_input} + {CHECKPOINT_BOUNDARY_COPIES} copies) + one block x {copies} copies{in_bf16}"
            ),
        )
    } else {
        (
            kept * per_block + embed,
            format!(
                "micro {b} x ({lu} + 2 x {li} tokens) x {d} wide x {kept} block(s) x {copies} copies{in_bf16}"
            ),
        )
    };
    MemoryTerm {
        name: "activations (GPT-2)",
        bytes,
        held: Held::Training,
        detail,
    }
}

/// Evaluation: every user's and item's representation, and a block of scores.
pub(super) fn evaluation_term(x: &Inputs<'_>) -> MemoryTerm {
    let (data, dim, d) = (x.data, x.dim, x.d);
    let (users, items) = (data.users, data.items);
    let eval_users = x.config.eval.batch_users as u64;
    let mut eval = (users + items) * dim * F32 + 3 * eval_users * items * F32;
    // With the item-item matrix a user row also holds every item's score, made in three copies
    // (the pools, the cold users' stand-in, the table).
    eval += 3 * users * item_item_values(x).min(items) * F32;
    if x.config.model.scorer == ScorerKind::Mlp {
        eval += eval_users * items * 2 * dim * F32;
    }
    if x.text == Some(TextMode::Dynamic) {
        eval +=
            ENCODE_ROWS * data.item_tokens.max(data.user_tokens) * d * (EMBEDDING_COPIES + 8) * F32;
    }
    MemoryTerm {
        name: "evaluation",
        bytes: eval,
        held: Held::Eval,
        detail: format!("tables + {eval_users} users x {items} items x 3 copies"),
    }
}

/// What the CUDA caching allocator holds beyond the live tensors.
pub(super) fn allocator_reserve(terms: &[MemoryTerm]) -> MemoryTerm {
    let tensors: u64 = terms
        .iter()
        .filter(|t| t.name != "CUDA context" && t.name != NCCL_TERM)
        .map(|t| t.bytes)
        .sum();
    MemoryTerm {
        name: "allocator reserve",
        bytes: (tensors as f64 * CUDA_ALLOCATOR_RESERVE) as u64,
        held: Held::Always,
        detail: format!(
            "{:.0}% of the tensors (caching allocator)",
            CUDA_ALLOCATOR_RESERVE * 100.0
        ),
    }
}

/// NCCL's own buffers, when more than one rank reduces through NCCL on GPUs.
pub(super) fn nccl_buffers(
    config: &Config,
    plan: &BatchPlan,
    device: DeviceKind,
) -> Option<MemoryTerm> {
    let nccl = config.dist.backend != crate::config::Backend::Tcp;
    (device == DeviceKind::Cuda && nccl && plan.world_size > 1).then(|| MemoryTerm {
        name: NCCL_TERM,
        bytes: NCCL_CHANNELS * 2 * NCCL_CONNECTION_BYTES + NCCL_NVLS_BYTES,
        held: Held::Always,
        detail: format!(
            "{NCCL_CHANNELS} channels x 2 connections x {} + NVLS {} (outside the caching allocator)",
            mib_text(NCCL_CONNECTION_BYTES),
            mib_text(NCCL_NVLS_BYTES)
        ),
    })
}
