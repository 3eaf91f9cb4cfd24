//! The store's key space, and which connection waits for which key: a write wakes only the
//! connections waiting for that key (no thundering herd), and a wait costs its keys once, not
//! once per write. A wait is registered once per distinct key however often it names it, and
//! ending it costs its own keys, not the other waits on them (a wait naming one key 80,000 times
//! beside another such wait used to stall the server for seconds).

use std::collections::{HashMap, HashSet};

use indexmap::IndexSet;

use crate::MAX_FRAME_BYTES;

/// A connection's `wait` in progress: `id` tells it apart from the connection's earlier waits,
/// whose registrations may still sit in [`KeySpace`] until their keys are written.
pub(super) struct PendingWait {
    pub(super) id: u64,
    pub(super) keys: Vec<String>,
    /// Registrations (distinct keys) not yet woken: when it reaches zero every key has been
    /// written.
    pub(super) missing: usize,
    pub(super) deadline: Option<std::time::Instant>,
}

/// (connection, wait id) of a registration.
pub(super) type Waiter = (usize, u64);

/// The wills connections left, by name: the connection, the key and the value to write when it
/// ends before the will is revoked.
#[derive(Default)]
pub(super) struct Wills {
    by_name: HashMap<String, (usize, String, Vec<u8>)>,
}

impl Wills {
    pub(super) fn leave(&mut self, name: String, conn: usize, key: String, value: Vec<u8>) {
        self.by_name.insert(name, (conn, key, value));
    }

    pub(super) fn revoke(&mut self, name: &str) {
        self.by_name.remove(name);
    }

    /// The key and value of will `name` if connection `conn` still holds it (taken out).
    pub(super) fn take(&mut self, name: &str, conn: usize) -> Option<(String, Vec<u8>)> {
        match self.by_name.get(name) {
            Some((holder, _, _)) if *holder == conn => self
                .by_name
                .remove(name)
                .map(|(_, key, value)| (key, value)),
            _ => None,
        }
    }
}

#[derive(Default)]
pub(super) struct KeySpace {
    values: HashMap<String, Vec<u8>>,
    /// Per key, the waits registered on it, in the order they came (removing one is O(1)).
    waiters: HashMap<String, IndexSet<Waiter>>,
}

impl KeySpace {
    pub(super) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.values.get(key)
    }

    /// Writes `key`; returns the registrations it wakes.
    pub(super) fn set(&mut self, key: String, value: Vec<u8>) -> Vec<Waiter> {
        let woken = self.waiters.remove(&key).unwrap_or_default();
        self.values.insert(key, value);
        woken.into_iter().collect()
    }

    /// Adds `delta` to the counter `key` (0 when missing; kept as decimal text, as PyTorch does);
    /// the new value and the registrations it wakes, or why it cannot.
    pub(super) fn add(&mut self, key: String, delta: i64) -> Result<(i64, Vec<Waiter>), String> {
        let current = match self.values.get(&key) {
            None => 0,
            Some(bytes) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.trim().parse::<i64>().ok())
                .ok_or_else(|| format!("the value of key {key:?} is not a decimal integer"))?,
        };
        let next = current
            .checked_add(delta)
            .ok_or_else(|| format!("adding {delta} to {current} (key {key:?}) overflows i64"))?;
        Ok((next, self.set(key, next.to_string().into_bytes())))
    }

    /// Removes `key` (an ephemeral key whose connection ended). Waits that counted it stay
    /// registered; [`KeySpace::values`] re-checks before any of them is answered.
    pub(super) fn remove(&mut self, key: &str) {
        self.values.remove(key);
    }

    /// Every key's value, when every key exists now.
    /// Why the values of `keys` (as many times as each is named) cannot be one answer: more
    /// bytes than a message may hold. Found from the sizes, before anything is copied, so that
    /// a key named many times costs nothing when it is refused.
    pub(super) fn too_big(&self, keys: &[String]) -> Option<String> {
        // A value's bytes and a little framing each.
        let bytes = keys
            .iter()
            .map(|k| self.get(k).map_or(0, Vec::len).saturating_add(16))
            .fold(0usize, usize::saturating_add);
        (bytes > MAX_FRAME_BYTES).then(|| {
            format!(
                "the answer would hold about {} MiB, over the {} MiB limit of one message ({} keys asked for; name each key once, or ask for fewer at a time)",
                bytes >> 20,
                MAX_FRAME_BYTES >> 20,
                keys.len()
            )
        })
    }

    pub(super) fn values(&self, keys: &[String]) -> Option<Vec<Vec<u8>>> {
        keys.iter()
            .map(|key| self.values.get(key).cloned())
            .collect()
    }

    /// The keys of `keys` that do not exist now.
    pub(super) fn missing(&self, keys: &[String]) -> Vec<String> {
        keys.iter()
            .filter(|key| !self.values.contains_key(key.as_str()))
            .cloned()
            .collect()
    }

    /// Registers `waiter` once on each distinct key of `keys` that does not exist yet; returns
    /// how many.
    pub(super) fn register(&mut self, waiter: Waiter, keys: &[String]) -> usize {
        let mut seen = HashSet::new();
        let mut missing = 0;
        for key in keys {
            if !self.values.contains_key(key.as_str()) && seen.insert(key.as_str()) {
                self.waiters.entry(key.clone()).or_default().insert(waiter);
                missing += 1;
            }
        }
        missing
    }

    /// Drops `waiter`'s registrations on `keys` (its wait ended without them): O(1) per key.
    pub(super) fn forget(&mut self, waiter: Waiter, keys: &[String]) {
        for key in keys {
            if let Some(set) = self.waiters.get_mut(key.as_str()) {
                set.swap_remove(&waiter);
                if set.is_empty() {
                    self.waiters.remove(key.as_str());
                }
            }
        }
    }

    /// Keys and registrations held now (tests).
    #[cfg(test)]
    pub(super) fn registrations(&self) -> usize {
        self.waiters.values().map(IndexSet::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> Vec<String> {
        names.iter().map(|k| k.to_string()).collect()
    }

    #[test]
    fn a_write_wakes_only_the_waits_for_its_key() {
        let mut space = KeySpace::default();
        space.set("a".into(), b"1".to_vec());
        assert_eq!(space.register((1, 0), &keys(&["a", "b"])), 1);
        assert_eq!(space.register((2, 0), &keys(&["c"])), 1);
        assert!(space.set("x".into(), vec![]).is_empty());
        assert_eq!(space.set("b".into(), vec![]), vec![(1, 0)]);
        assert_eq!(
            space.values(&keys(&["a", "b"])),
            Some(vec![b"1".to_vec(), vec![]])
        );
        assert_eq!(space.registrations(), 1);
        space.forget((2, 0), &keys(&["c"]));
        assert_eq!(space.registrations(), 0);
    }

    #[test]
    fn a_key_named_many_times_is_registered_once_and_forgotten_once() {
        let mut space = KeySpace::default();
        let many = vec!["k".to_string(); 1000];
        assert_eq!(space.register((1, 0), &many), 1);
        assert_eq!(space.register((2, 0), &many), 1);
        assert_eq!(space.registrations(), 2);
        space.forget((1, 0), &many);
        assert_eq!(space.registrations(), 1);
        assert_eq!(space.set("k".into(), vec![]), vec![(2, 0)]);
        assert_eq!(space.registrations(), 0);
    }

    #[test]
    fn counters_are_decimal_text_and_refuse_overflow_and_text() {
        let mut space = KeySpace::default();
        assert_eq!(space.add("n".into(), 2).unwrap().0, 2);
        assert_eq!(space.add("n".into(), -5).unwrap().0, -3);
        assert_eq!(space.get("n"), Some(&b"-3".to_vec()));
        space.set("t".into(), b"text".to_vec());
        assert!(space
            .add("t".into(), 1)
            .unwrap_err()
            .contains("not a decimal"));
        space.set("m".into(), i64::MAX.to_string().into_bytes());
        assert!(space.add("m".into(), 1).unwrap_err().contains("overflows"));
    }

    #[test]
    fn a_removed_key_is_missing_again() {
        let mut space = KeySpace::default();
        space.set("e".into(), b"v".to_vec());
        space.remove("e");
        assert_eq!(space.values(&keys(&["e"])), None);
        assert_eq!(space.missing(&keys(&["e", "f"])), keys(&["e", "f"]));
    }
}
