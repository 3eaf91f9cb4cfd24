//! Sealed values: what keeps torchrun's agent store, which authenticates nobody, from handing a
//! run's secrets to whoever can reach it, or a forged value to the run.
//!
//! A value is sealed with ChaCha20-Poly1305 under `key = HMAC-SHA256(run id, "gptrec-c10d-seal-v1")`
//! and a fresh random 96-bit nonce, with the store key it is written under (prefix included) as
//! associated data: `"gps1" || nonce || ciphertext || tag`. Reading it back needs the run id,
//! and a value written by anyone who does not know the id, or moved from another key, does not
//! open. This module owns that format only; which values go through it is [`c10d`](super::c10d)'s
//! business (counters cannot: the server adds to them in the clear).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};

/// Marks a sealed value (and its format's version).
const MAGIC: &[u8; 4] = b"gps1";

/// Bytes a sealed value has beyond its plaintext: magic, nonce, tag.
pub(crate) const OVERHEAD: usize = MAGIC.len() + NONCE_LEN + 16;

/// The run's sealing key (no `Debug`: it must not reach a log).
pub(crate) struct Seal(LessSafeKey);

impl Seal {
    pub(crate) fn new(run_id: &str) -> Seal {
        let derived = crate::auth::derive(run_id, b"gptrec-c10d-seal-v1");
        // A 32-byte key is what ChaCha20-Poly1305 takes: `new` cannot fail for it.
        let key = UnboundKey::new(&CHACHA20_POLY1305, &derived)
            .unwrap_or_else(|_| unreachable!("ChaCha20-Poly1305 takes 32-byte keys"));
        Seal(LessSafeKey::new(key))
    }

    /// `value`, sealed for the store key `key`; an error only when the OS gives no random bytes.
    pub(crate) fn seal(&self, key: &str, value: &[u8]) -> Result<Vec<u8>, String> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| format!("no random numbers from the OS: {e}"))?;
        let mut body = value.to_vec();
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key.as_bytes()),
                &mut body,
            )
            .map_err(|_| format!("cannot seal a {}-byte value", value.len()))?;
        let mut sealed = Vec::with_capacity(OVERHEAD + value.len());
        sealed.extend_from_slice(MAGIC);
        sealed.extend_from_slice(&nonce);
        sealed.extend_from_slice(&body);
        Ok(sealed)
    }

    /// The plaintext of `sealed` read under the store key `key`, or `None` when it was not
    /// sealed with this run's key for this store key (forged, moved, truncated, or a counter).
    pub(crate) fn open(&self, key: &str, sealed: &[u8]) -> Option<Vec<u8>> {
        let rest = sealed.strip_prefix(MAGIC)?;
        if rest.len() < NONCE_LEN + 16 {
            return None;
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut body = body.to_vec();
        let plain = self
            .0
            .open_in_place(nonce, Aad::from(key.as_bytes()), &mut body)
            .ok()?;
        Some(plain.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_opens_only_with_the_run_id_and_under_its_key() {
        let seal = Seal::new("run-a");
        let sealed = seal.seal("p/tcp/secret", b"the ring secret").unwrap();
        assert_eq!(sealed.len(), OVERHEAD + 15);
        assert!(!sealed.windows(15).any(|w| w == b"the ring secret"));
        assert_eq!(
            seal.open("p/tcp/secret", &sealed).as_deref(),
            Some(&b"the ring secret"[..])
        );
        assert_eq!(Seal::new("run-b").open("p/tcp/secret", &sealed), None);
        assert_eq!(seal.open("p/tcp/addr/0", &sealed), None);
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(seal.open("p/tcp/secret", &flipped), None);
        for junk in [
            &b""[..],
            b"gps1",
            b"12",
            b"127.0.0.1:4000",
            &sealed[..sealed.len() - 1],
        ] {
            assert_eq!(seal.open("p/tcp/secret", junk), None);
        }
        // Two seals of one value differ (fresh nonces), and both open.
        let again = seal.seal("p/tcp/secret", b"the ring secret").unwrap();
        assert_ne!(again, sealed);
        assert!(seal.open("p/tcp/secret", &again).is_some());
        assert_eq!(
            seal.open("k", &seal.seal("k", b"").unwrap()),
            Some(Vec::new())
        );
    }
}
