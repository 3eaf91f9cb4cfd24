//! Using a trained recommender: top-K items for a user (what they interacted with left out),
//! users described only by demographics, and the final user and item vectors exported for
//! serving from any language.
//!
//! Owns: ranking for serving, parsing a new user's description, and the export
//! format (`vectors.safetensors` + `ids.json`, put in place together or not at all). Must not:
//! train, load checkpoints or talk to other ranks (the caller builds the model and loads its
//! weights), or write through a link planted in the export directory.

use std::path::Path;

use common::files::{OutputError, Staging};
use serde_json::json;
use tch::{Kind, Tensor};

use crate::data::{age_group_name, Age, Dataset, Gender, Occupation, User};
use crate::eval::top_k;
use crate::model::recommender::Scorer;
use crate::task::RecTask;
use crate::RecError;

/// The `k` best items (dense id, score) for each user representation in `users` [b, dim] (or
/// [b, dim + n] with the item-item matrix) against `items` [n, dim], leaving out `exclude[row]`.
pub fn top_items(
    task: &RecTask,
    users: &Tensor,
    items: &Tensor,
    exclude: &[Vec<u32>],
    k: usize,
) -> Result<Vec<Vec<(u32, f32)>>, RecError> {
    let scores = task
        .score_tables(users, items)
        .f_to_kind(Kind::Float)?
        .f_contiguous()?;
    let n = items.size()[0] as usize;
    let flat = Vec::<f32>::try_from(scores.f_view([-1])?)?;
    Ok(flat
        .chunks(n.max(1))
        .zip(exclude)
        .map(|(row, ex)| {
            top_k(row, ex, k)
                .into_iter()
                .map(|i| (i, row[i as usize]))
                .collect()
        })
        .collect())
}

/// [`parse_new_user`] against the data the model was trained on: with ML-100k's names, the
/// occupation must be one that the data's users have (`user_texts`), as a name the model never
/// saw in training would be encoded as a stranger; the error lists them.
pub fn parse_new_user_of(spec: &str, years: bool, user_texts: &[String]) -> Result<User, String> {
    let user = parse_new_user(spec, years)?;
    if let Occupation::Named(name) = &user.occupation {
        let known: std::collections::BTreeSet<&str> = user_texts
            .iter()
            .filter_map(|t| crate::data::occupation_of_text(t))
            .collect();
        if !known.is_empty() && !known.contains(name.as_str()) {
            let list: Vec<&str> = known.into_iter().collect();
            return Err(format!(
                "--new-user {spec:?}: occupation {name:?} is not one of this data's: {}",
                list.join(", ")
            ));
        }
    }
    Ok(user)
}

/// A user known only by gender, age and occupation, as `GENDER,AGE,OCCUPATION`: ML-1M's
/// `users.dat` codes (`F,25,12`), or for a model trained on ML-100k its years and occupation
/// names (`F,31,librarian`). `years` says which the model's data used.
pub fn parse_new_user(spec: &str, years: bool) -> Result<User, String> {
    let bad = |why: String| format!("--new-user {spec:?}: {why}");
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    let example = if years { "F,31,librarian" } else { "F,25,12" };
    let [gender, age, occupation] = parts[..] else {
        return Err(bad(format!(
            "expected GENDER,AGE,OCCUPATION, e.g. {example}"
        )));
    };
    let gender = match gender {
        "F" | "f" => Gender::F,
        "M" | "m" => Gender::M,
        other => return Err(bad(format!("gender must be F or M (got {other:?})"))),
    };
    let age = if years {
        age.parse::<u8>()
            .ok()
            .filter(|a| (1..=120).contains(a))
            .map(Age::Years)
            .ok_or_else(|| bad(format!("age must be years 1..=120 (got {age:?})")))?
    } else {
        age.parse::<u8>()
            .ok()
            .filter(|a| age_group_name(*a) != "unknown")
            .map(Age::Group)
            .ok_or_else(|| {
                bad(format!(
                    "age must be one of ML-1M's codes 1, 18, 25, 35, 45, 50, 56 (got {age:?})"
                ))
            })?
    };
    let occupation = if years {
        let ok = !occupation.is_empty()
            && occupation.len() <= 40
            && occupation
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || " -/".contains(c));
        if !ok {
            return Err(bad(format!(
                "occupation must be a word such as librarian (got {occupation:?})"
            )));
        }
        Occupation::Named(occupation.to_lowercase())
    } else {
        occupation
            .parse::<u8>()
            .ok()
            .filter(|o| *o <= 20)
            .map(Occupation::Code)
            .ok_or_else(|| {
                bad(format!(
                    "occupation must be a code 0..=20 (got {occupation:?})"
                ))
            })?
    };
    Ok(User {
        id: 0,
        gender,
        age,
        occupation,
        zip: String::new(),
    })
}

/// The export's files, in the order they are put in place.
pub const EXPORT_FILES: [&str; 2] = ["vectors.safetensors", "ids.json"];

/// Writes `dir/vectors.safetensors` (`users` [n_users, dim], `items` [n_items, dim], f32: a
/// user's score for an item is the dot product of their rows; `dim + n_items` wide with the
/// item-item matrix) and `dir/ids.json` (the original
/// ML-1M id and text of every row, and which rows are cold start), all or nothing: both are
/// written into a private staging directory inside `dir`, then renamed into place together
/// (a link at either name is replaced, not written through; a name held by a directory is
/// refused before either file moves; a failure leaves the previous export as it was).
pub fn export_vectors(
    dir: &Path,
    task: &RecTask,
    ds: &Dataset,
    titles: &[String],
) -> Result<(), RecError> {
    if task.scorer() != Scorer::Dot {
        return Err(RecError::Invalid(
            "model.scorer = \"mlp\": its scores are not a product of user and item vectors, so vectors alone cannot serve it".into(),
        ));
    }
    let out = |e: OutputError| RecError::Invalid(e.to_string());
    let (users, items) = task.tables();
    // With the item-item matrix a user row ends with its item-item scores: an identity after
    // each item's row keeps the score a plain dot product.
    let extra = users.size()[1] - items.size()[1];
    let items = if extra > 0 {
        let eye = Tensor::eye(extra, (items.kind(), items.device()));
        Tensor::cat(&[items, eye], 1)
    } else {
        items
    };
    let tensors = [
        (
            "users",
            users.to_device(tch::Device::Cpu).to_kind(Kind::Float),
        ),
        (
            "items",
            items.to_device(tch::Device::Cpu).to_kind(Kind::Float),
        ),
    ];
    let ids = json!({
        "score": "dot product of a users row and an items row",
        "users": ds.user_ids,
        "items": ds.item_ids,
        "item_titles": titles,
        "cold_users_from_row": ds.n_warm_users,
        "cold_items_from_row": ds.n_warm_items,
    });
    let [vectors, ids_json] = EXPORT_FILES;
    let staging = Staging::new(dir).map_err(out)?;
    // By path, inside the staging directory this call just created (mode 0700): nothing else
    // can have put a link there.
    Tensor::write_safetensors(&tensors, staging.path(vectors))?;
    staging
        .write(ids_json, format!("{ids:#}\n").as_bytes())
        .map_err(out)?;
    staging.commit(&EXPORT_FILES).map_err(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_users_are_parsed_with_ml1m_codes_and_bad_ones_named() {
        let u = parse_new_user("F,25,12", false).unwrap();
        assert_eq!(
            (u.gender, u.age, u.occupation),
            (Gender::F, Age::Group(25), Occupation::Code(12))
        );
        assert_eq!(
            parse_new_user(" m , 56 , 0 ", false).unwrap().age,
            Age::Group(56)
        );
        for (spec, why) in [
            ("F,25", "expected GENDER,AGE,OCCUPATION"),
            ("X,25,1", "gender must be F or M"),
            ("F,26,1", "age must be one of ML-1M's codes"),
            ("F,25,21", "occupation must be a code 0..=20"),
            ("F,25,x", "occupation must be a code"),
        ] {
            let err = parse_new_user(spec, false).unwrap_err();
            assert!(err.contains(why) && err.contains(spec), "{err}");
        }
    }

    #[test]
    fn a_new_users_named_occupation_must_be_one_of_the_datas() {
        let texts = vec![
            "User: male, aged 24, works as technician.".to_string(),
            "User: female, aged 53, works as other.".to_string(),
        ];
        let u = parse_new_user_of("F,31,Technician", true, &texts).unwrap();
        assert_eq!(u.occupation, Occupation::Named("technician".into()));
        let err = parse_new_user_of("F,25,12", true, &texts).unwrap_err();
        assert!(
            err.contains("occupation \"12\" is not one of this data's: other, technician"),
            "{err}"
        );
        // ML-1M's codes are checked by the parser alone.
        assert!(parse_new_user_of("F,25,12", false, &texts).is_ok());
    }

    #[test]
    fn new_users_of_ml100k_give_years_and_an_occupation_name() {
        let u = parse_new_user("F,31,Librarian", true).unwrap();
        assert_eq!(
            (u.age, u.occupation),
            (Age::Years(31), Occupation::Named("librarian".into()))
        );
        for (spec, why) in [
            ("F,0,writer", "age must be years"),
            ("F,31,", "occupation must be a word"),
            ("F,31,a;b", "occupation must be a word"),
        ] {
            let err = parse_new_user(spec, true).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
    }
}
