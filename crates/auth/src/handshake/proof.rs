//! The keyed hashes of the handshake, and its nonces.
//!
//! ```text
//! Ps = HMAC-SHA256(K, "rally server" | label | Nc | Ns)
//! Pc = HMAC-SHA256(K, "rally client" | label | Ns | Nc)
//! ```
//!
//! The two prefixes are as long as each other and differ, so a proof of one side is never a
//! proof of the other (a server's proof cannot be reflected back as a client's). The label is
//! the only part of variable length, between a fixed prefix and 64 bytes of nonces, so the
//! input says unambiguously which service it is for. Both proofs cover both nonces, and each
//! side draws its own nonce from the OS random source for every handshake: a proof recorded
//! from one exchange answers no other. Proofs are checked with `hmac`'s `verify_slice`, which
//! compares in constant time.

use hmac::Mac;

use super::wire::{Nonce, Tag, NONCE_LEN};
use crate::secret::JobSecret;

/// The server proof's prefix.
const SERVER: &[u8; 12] = b"rally server";
/// The client proof's prefix.
const CLIENT: &[u8; 12] = b"rally client";

/// The OS random source failed: no handshake can be run without fresh nonces.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot draw a handshake nonce from the OS random source: {0}")]
pub struct NonceError(String);

/// A fresh nonce from the OS random source.
pub fn fresh_nonce() -> Result<Nonce, NonceError> {
    let mut nonce = [0; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| NonceError(e.to_string()))?;
    Ok(nonce)
}

fn mac(
    secret: &JobSecret,
    prefix: &[u8; 12],
    label: &str,
    a: &Nonce,
    b: &Nonce,
) -> hmac::Hmac<sha2::Sha256> {
    let mut mac = secret.mac();
    mac.update(prefix);
    mac.update(label.as_bytes());
    mac.update(a);
    mac.update(b);
    mac
}

/// Ps, the server's proof.
pub(crate) fn server_proof(secret: &JobSecret, label: &str, nc: &Nonce, ns: &Nonce) -> Tag {
    mac(secret, SERVER, label, nc, ns)
        .finalize()
        .into_bytes()
        .into()
}

/// Pc, the client's proof.
pub(crate) fn client_proof(secret: &JobSecret, label: &str, nc: &Nonce, ns: &Nonce) -> Tag {
    mac(secret, CLIENT, label, ns, nc)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `tag` is Ps, compared in constant time.
pub(crate) fn is_server_proof(
    secret: &JobSecret,
    label: &str,
    nc: &Nonce,
    ns: &Nonce,
    tag: &Tag,
) -> bool {
    mac(secret, SERVER, label, nc, ns).verify_slice(tag).is_ok()
}

/// Whether `tag` is Pc, compared in constant time.
pub(crate) fn is_client_proof(
    secret: &JobSecret,
    label: &str,
    nc: &Nonce,
    ns: &Nonce,
    tag: &Tag,
) -> bool {
    mac(secret, CLIENT, label, ns, nc).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(tag: &Tag) -> String {
        tag.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn nonces() -> (Nonce, Nonce) {
        let nc: Nonce = std::array::from_fn(|i| i as u8);
        let ns: Nonce = std::array::from_fn(|i| 100 + i as u8);
        (nc, ns)
    }

    #[test]
    fn proofs_match_known_answers() {
        // Computed with Python's hmac module: hmac.new(K, b"rally server" + b"store" + nc + ns,
        // sha256) and the same with b"rally client" + b"store" + ns + nc.
        let secret = JobSecret::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
        let (nc, ns) = nonces();
        let ps = server_proof(&secret, "store", &nc, &ns);
        let pc = client_proof(&secret, "store", &nc, &ns);
        assert_eq!(
            hex(&ps),
            "96182f7368babe4b2c4db347825372886bfa946094d57a73cf2f3f1e690b0596"
        );
        assert_eq!(
            hex(&pc),
            "bc812581faca268b455a6e91c9294388e5aa871134e8e5202ba73679a6292b08"
        );
        assert!(is_server_proof(&secret, "store", &nc, &ns, &ps));
        assert!(is_client_proof(&secret, "store", &nc, &ns, &pc));
    }

    #[test]
    fn a_proof_is_bound_to_its_side_label_nonces_and_secret() {
        let secret = JobSecret::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
        let other = JobSecret::from_bytes(b"0123456789abcdeF".to_vec()).unwrap();
        let (nc, ns) = nonces();
        let ps = server_proof(&secret, "store", &nc, &ns);
        assert!(
            !is_client_proof(&secret, "store", &nc, &ns, &ps),
            "reflected"
        );
        assert!(
            !is_server_proof(&secret, "rpc", &nc, &ns, &ps),
            "other label"
        );
        assert!(
            !is_server_proof(&secret, "store", &ns, &nc, &ps),
            "nonces swapped"
        );
        assert!(
            !is_server_proof(&other, "store", &nc, &ns, &ps),
            "other secret"
        );
        let mut flipped = ps;
        flipped[31] ^= 1;
        assert!(!is_server_proof(&secret, "store", &nc, &ns, &flipped));
    }

    #[test]
    fn nonces_are_fresh() {
        let a = fresh_nonce().unwrap();
        let b = fresh_nonce().unwrap();
        assert_ne!(a, b);
    }
}
