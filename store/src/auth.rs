//! The handshake's cryptography: both sides prove that they know the run id without sending it,
//! each with an HMAC-SHA256 over a fresh nonce from either side.
//!
//! The key is `HMAC-SHA256(run id, "gptrec-store-v2")`, never the id itself. The server proves
//! `HMAC(key, "server" || client nonce || server nonce)`, the client
//! `HMAC(key, "client" || server nonce || client nonce)`: the labels keep one side's proof from
//! being reflected as the other's, and the fresh nonces keep a recorded proof from being replayed
//! on another connection.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub(crate) const NONCE_BYTES: usize = 32;

/// A value used once: 32 bytes from the operating system's generator.
pub(crate) type Nonce = [u8; NONCE_BYTES];

/// An HMAC-SHA256 output.
pub(crate) type Proof = [u8; NONCE_BYTES];

/// What both sides derive from the run id; it never leaves the process (no `Debug` either).
pub(crate) struct Key([u8; 32]);

/// HMAC-SHA256 of `parts` (concatenated) under `key`.
fn mac(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    for part in parts {
        mac.update(part);
    }
    mac
}

/// A 32-byte key for one purpose (`label`), derived from the run id: `HMAC-SHA256(id, label)`.
pub(crate) fn derive(run_id: &str, label: &[u8]) -> [u8; 32] {
    mac(run_id.as_bytes(), &[label])
        .finalize()
        .into_bytes()
        .into()
}

impl Key {
    pub(crate) fn new(run_id: &str) -> Key {
        Key(derive(run_id, b"gptrec-store-v2"))
    }

    /// What the server sends to prove that it knows the run id.
    pub(crate) fn server_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        mac(&self.0, &[b"server", client, server])
            .finalize()
            .into_bytes()
            .into()
    }

    /// What the client sends to prove that it knows the run id.
    pub(crate) fn client_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        mac(&self.0, &[b"client", server, client])
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the server's proof for these nonces (compared in constant time).
    pub(crate) fn server_proved(&self, client: &Nonce, server: &Nonce, proof: &Proof) -> bool {
        mac(&self.0, &[b"server", client, server])
            .verify_slice(proof)
            .is_ok()
    }

    /// Whether `proof` is the client's proof for these nonces (compared in constant time).
    pub(crate) fn client_proved(&self, client: &Nonce, server: &Nonce, proof: &Proof) -> bool {
        mac(&self.0, &[b"client", server, client])
            .verify_slice(proof)
            .is_ok()
    }
}

/// A fresh nonce, or why the operating system gave no random bytes.
pub(crate) fn nonce() -> Result<Nonce, String> {
    let mut bytes = [0u8; NONCE_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_the_key_the_side_and_both_nonces() {
        let (a, b) = (Key::new("job-a"), Key::new("job-b"));
        let (cn, sn) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(cn, sn);
        let proof = a.server_proof(&cn, &sn);
        assert!(a.server_proved(&cn, &sn, &proof));
        assert!(!b.server_proved(&cn, &sn, &proof));
        assert!(!a.server_proved(&sn, &cn, &proof));
        assert!(!a.server_proved(&cn, &nonce().unwrap(), &proof));
        // Reflection: the server's proof is not a client's proof, nor the other way round.
        assert!(!a.client_proved(&cn, &sn, &proof));
        let client = a.client_proof(&cn, &sn);
        assert!(a.client_proved(&cn, &sn, &client));
        assert!(!a.server_proved(&cn, &sn, &client));
        assert!(!b.client_proved(&cn, &sn, &client));
        // The key is not the id in any form that a proof would show.
        assert_ne!(&a.0[..], b"job-a".as_slice());
    }
}
