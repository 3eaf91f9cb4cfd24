//! The data a recommender trains on, ready for a model: MovieLens-1M's or -100k's files (or synthetic ones
//! in their format, generated once per size and seed) read, filtered to implicit feedback,
//! split per user, and each user's and item's metadata as text; and the data's shape for the
//! memory estimate.
//!
//! All ranks read the same files and get the same split (it is seeded); only generating the
//! synthetic files is coordinated (rank 0 first, then a barrier).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::config::{Config, ModelKind};
use common::memory::DataShape;
use runtime::collective::{Collective, OpContext};
use tracing::info;

use crate::data::{self, ColdShares, Dataset, RawData};
use crate::model::gpt2::Tokenizer;
use crate::RecError;

/// The interactions and the metadata text of every (dense) user and item.
pub struct RecData {
    pub dataset: Dataset,
    pub user_texts: Vec<String>,
    pub item_texts: Vec<String>,
    /// Every (dense) item's title as in `movies.dat`, for people reading recommendations.
    pub item_titles: Vec<String>,
    /// Per dense user: every item they rated, whatever the stars (a recommendation leaves
    /// out what they have seen, not only what they liked), sorted.
    pub rated: Vec<Vec<u32>>,
    /// Where the files came from, for logs.
    pub source: PathBuf,
    /// Their layout (ML-1M's or ML-100k's).
    pub format: data::DataFormat,
}

impl RecData {
    /// Implicit feedback, split and texts from parsed ML-1M files.
    pub fn from_raw(
        raw: &RawData,
        min_rating: u8,
        seed: u64,
        cold: ColdShares,
        source: PathBuf,
        format: data::DataFormat,
    ) -> RecData {
        let dataset = data::build_dataset(raw, min_rating, seed, cold);
        let users: HashMap<u32, &data::User> = raw.users.iter().map(|u| (u.id, u)).collect();
        let movies: HashMap<u32, &data::Movie> = raw.movies.iter().map(|m| (m.id, m)).collect();
        // Every rated user and movie exists (the reader checks), so the lookups succeed.
        let user_texts = dataset
            .user_ids
            .iter()
            .map(|id| {
                users
                    .get(id)
                    .map_or_else(String::new, |u| data::user_text(u))
            })
            .collect();
        let item_texts = dataset
            .item_ids
            .iter()
            .map(|id| {
                movies
                    .get(id)
                    .map_or_else(String::new, |m| data::item_text(m))
            })
            .collect();
        let item_titles = dataset
            .item_ids
            .iter()
            .map(|id| {
                movies
                    .get(id)
                    .map_or_else(String::new, |m| m.title.trim().to_string())
            })
            .collect();
        let rated = rated_items(raw, &dataset);
        RecData {
            dataset,
            user_texts,
            item_texts,
            item_titles,
            rated,
            source,
            format,
        }
    }

    /// Number of training interactions.
    pub fn train_interactions(&self) -> usize {
        self.dataset.train.iter().map(Vec::len).sum()
    }
}

/// Per dense user, the dense items they rated at any rating (items without a dense id, rated
/// only below `min_rating` by everyone, are no candidates anyway).
fn rated_items(raw: &RawData, ds: &Dataset) -> Vec<Vec<u32>> {
    let dense = |ids: &[u32]| -> HashMap<u32, u32> {
        ids.iter()
            .enumerate()
            .map(|(d, &o)| (o, d as u32))
            .collect()
    };
    let (users, items) = (dense(&ds.user_ids), dense(&ds.item_ids));
    let mut rated = vec![Vec::new(); ds.user_ids.len()];
    for r in &raw.ratings {
        if let (Some(&u), Some(&i)) = (users.get(&r.user), items.get(&r.movie)) {
            rated[u as usize].push(i);
        }
    }
    for list in &mut rated {
        list.sort_unstable();
        list.dedup();
    }
    rated
}

/// Where the synthetic data of `config` (`data.dir` unset) is generated:
/// `<output_dir>/data/synthetic-<size>-seed<seed>-v<generator version>/`.
pub fn synthetic_dir(config: &Config) -> PathBuf {
    common::data_layout::synthetic_dir(config)
}

/// Reads `data.dir`, or — when it is unset — synthetic data generated once into
/// `<output_dir>/data/synthetic-<size>-seed<seed>-v<generator version>/` (rank 0 first; a rank that still does not
/// see it after the barrier, e.g. on another machine, writes its own identical copy).
pub fn load_data(
    config: &Config,
    comm: &mut dyn Collective,
    ctx: OpContext,
) -> Result<RecData, RecError> {
    let dir = match &config.data.dir {
        Some(dir) => dir.clone(),
        None => {
            let dir = synthetic_dir(config);
            if comm.rank() == 0 {
                generate_once(&dir, config)?;
            }
            comm.barrier(ctx)?;
            generate_once(&dir, config)?;
            dir
        }
    };
    let (raw, format) = data::read_movielens(&dir)?;
    data::check_positives(&raw, config.data.min_rating, &dir.join(format.files()[0]))?;
    if let Some(duplicates) = raw.duplicates.as_ref().filter(|_| comm.rank() == 0) {
        tracing::warn!("{}", duplicates.warning(config.data.min_rating));
    }
    let cold = ColdShares {
        items: config.data.cold_items,
        users: config.data.cold_users,
    };
    Ok(RecData::from_raw(
        &raw,
        config.data.min_rating,
        config.data.split_seed_or(config.run.seed),
        cold,
        dir,
        format,
    ))
}

/// Generates the synthetic files into `dir` unless it exists: into a temporary sibling, then
/// renamed, so `dir` is either absent or complete.
fn generate_once(dir: &Path, config: &Config) -> Result<(), RecError> {
    if dir.join("ratings.dat").is_file() {
        return Ok(());
    }
    let parent = dir.parent().unwrap_or(Path::new("."));
    let io = |path: &Path, e: std::io::Error| RecError::Invalid(format!("{}: {e}", path.display()));
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("data"),
        std::process::id()
    ));
    data::generate_ml1m(&tmp, config.data.synthetic, config.run.seed)?;
    match std::fs::rename(&tmp, dir) {
        Ok(()) => {
            info!("generated synthetic data into {}", dir.display());
            Ok(())
        }
        // Someone else finished first: theirs is identical.
        Err(_) if dir.join("ratings.dat").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => Err(io(dir, e)),
    }
}

/// The data's shape for the memory estimate: counts from the data, and (when the model reads
/// text) the longest user and item text in tokens after `model.max_text_tokens`.
pub fn data_shape(config: &Config, data: &RecData) -> Result<DataShape, RecError> {
    let ds = &data.dataset;
    let mut shape = DataShape::assumed(config);
    shape.users = u64::from(ds.n_users);
    shape.items = u64::from(ds.n_items);
    shape.interactions = [&ds.train, &ds.valid, &ds.test]
        .iter()
        .map(|lists| lists.iter().map(Vec::len).sum::<usize>() as u64)
        .sum();
    shape.source = format!("measured on {}", data.source.display());
    if config.model.kind == ModelKind::Gpt2rec {
        let tok = Tokenizer::new()?;
        let cap = config.model.max_text_tokens;
        let longest = |texts: &[String]| -> u64 {
            texts
                .iter()
                .map(|t| tok.encode(t).len().min(cap))
                .max()
                .unwrap_or(1) as u64
        };
        shape.user_tokens = longest(&data.user_texts);
        shape.item_tokens = longest(&data.item_texts);
    }
    Ok(shape)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tiny_data(dir: &Path) -> RecData {
        data::generate_ml1m(dir, common::config::SyntheticSize::Tiny, 3).unwrap();
        let raw = data::read_ml1m(dir).unwrap();
        RecData::from_raw(
            &raw,
            3,
            3,
            ColdShares::default(),
            dir.to_path_buf(),
            data::DataFormat::Ml1m,
        )
    }

    #[test]
    fn texts_follow_the_dense_ids() {
        let dir = tempfile::tempdir().unwrap();
        let d = tiny_data(&dir.path().join("d"));
        assert_eq!(d.user_texts.len(), d.dataset.n_users as usize);
        assert_eq!(d.item_texts.len(), d.dataset.n_items as usize);
        assert!(d.item_texts.iter().all(|t| t.starts_with("Movie: ")));
        assert!(d.user_texts.iter().all(|t| t.starts_with("User: ")));
    }
}
