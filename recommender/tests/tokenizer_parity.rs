//! Our tokenisation of the metadata texts is GPT-2's: the fixture
//! (`scripts/parity/tokenizer_fixture.py`) holds movie titles in ML-1M's style (latin-1
//! accents, the `&#8230;` entity, titles past the 64 tokens the model reads) and every user
//! text, with the ids `transformers`' GPT-2 tokenizer and OpenAI's original encoder gave them.
//! Each text is rebuilt with our `item_text`/`user_text` (so the fixture is the texts the model
//! really reads) and tokenised with our r50k_base tokenizer.

use std::path::PathBuf;

use recommender::data::{item_text, user_text, Age, Gender, Movie, Occupation, User};
use recommender::model::gpt2::Tokenizer;
use serde_json::Value;

fn fixture() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer-parity.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The text our data code builds for a fixture entry.
fn our_text(entry: &Value) -> String {
    match entry["kind"].as_str().unwrap() {
        "movie" => item_text(&Movie {
            id: 1,
            title: entry["title"].as_str().unwrap().to_string(),
            year: None,
            genres: serde_json::from_value(entry["genres"].clone()).unwrap(),
        }),
        "user" => user_text(&User {
            id: 1,
            gender: if entry["gender"] == "F" {
                Gender::F
            } else {
                Gender::M
            },
            age: Age::Group(entry["age"].as_u64().unwrap() as u8),
            occupation: Occupation::Code(entry["occupation"].as_u64().unwrap() as u8),
            zip: String::new(),
        }),
        other => panic!("unknown fixture kind {other}"),
    }
}

#[test]
fn our_tokenizer_gives_gpt2_ids_for_the_texts_the_model_reads() {
    let fixture = fixture();
    let entries = fixture["entries"].as_array().unwrap();
    let tok = Tokenizer::new().unwrap();
    let (mut movies, mut users, mut long) = (0, 0, 0);
    for entry in entries {
        let text = our_text(entry);
        assert_eq!(text, entry["text"].as_str().unwrap(), "our text differs");
        let want: Vec<i64> = serde_json::from_value(entry["ids"].clone()).unwrap();
        assert_eq!(tok.encode(&text), want, "token ids of {text:?}");
        // What the model reads of it: the first 64 tokens, as `truncation=True,
        // max_length=64` would give.
        let (ids, mask) = tok.encode_batch(std::slice::from_ref(&text), 64);
        let real = mask.sum(tch::Kind::Int64).int64_value(&[]) as usize;
        let read: Vec<i64> = Vec::try_from(ids.narrow(1, 0, real as i64).reshape([-1])).unwrap();
        assert_eq!(read, want[..want.len().min(64)], "cut text {text:?}");
        assert_eq!(tok.decode(&want).unwrap(), text, "ids decode back");
        match entry["kind"].as_str() {
            Some("movie") => movies += 1,
            _ => users += 1,
        }
        long += usize::from(want.len() > 64);
    }
    // Every user text (2 genders x 7 ages x 21 occupations), the movies, one past 64 tokens.
    assert_eq!(users, 294);
    assert!(movies >= 30, "{movies} movies");
    assert_eq!(long, 1);
}
