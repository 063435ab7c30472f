//! The key proof, both directions, over per-connection nonces.
//!
//! The client sends nonce `Nc`, the server answers with nonce `Ns` and
//! `HMAC(key, "server", Nc, Ns)`; the client checks it and answers
//! `HMAC(key, "client", Nc, Ns)`. Both nonces are fresh per connection, so a proof
//! recorded on one connection is worthless on the next (the server's nonce differs),
//! and the direction labels keep a side from reflecting the other's proof back.

use super::{ct_eq, from_hex, hmac_parts, to_hex, SharedKey};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// The peer's proof does not match: it does not hold our key (or replays an old proof).
    #[error("key proof failed: the peer does not hold the same key file (check that both sides read the same key)")]
    BadProof,
    /// A nonce or proof that is not 32 bytes of hex.
    #[error("malformed {0} in the key proof")]
    Malformed(&'static str),
    /// The server requires a key and we have none, or we require one and it asked for none.
    #[error("{0}")]
    KeyMismatch(&'static str),
}

fn nonce_bytes(hex: &str, what: &'static str) -> Result<Vec<u8>, ProofError> {
    match from_hex(hex) {
        Some(b) if b.len() == 32 => Ok(b),
        _ => Err(ProofError::Malformed(what)),
    }
}

fn proof(key: &SharedKey, label: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> [u8; 32] {
    hmac_parts(
        key.bytes(),
        &[b"maru-key-proof", label, client_nonce, server_nonce],
    )
}

/// The server side of one connection's proof.
pub struct ServerProof {
    client_nonce: Vec<u8>,
    server_nonce: Vec<u8>,
}

impl ServerProof {
    /// Starts from the client's nonce (hex) and our fresh nonce (hex).
    pub fn new(client_nonce: &str, server_nonce: &str) -> Result<ServerProof, ProofError> {
        Ok(ServerProof {
            client_nonce: nonce_bytes(client_nonce, "client nonce")?,
            server_nonce: nonce_bytes(server_nonce, "server nonce")?,
        })
    }

    /// What the server sends to prove it holds the key.
    pub fn server_proof(&self, key: &SharedKey) -> String {
        to_hex(&proof(
            key,
            b"server",
            &self.client_nonce,
            &self.server_nonce,
        ))
    }

    /// Checks the client's proof.
    pub fn check_client(&self, key: &SharedKey, client_proof: &str) -> Result<(), ProofError> {
        let got = from_hex(client_proof).ok_or(ProofError::Malformed("client proof"))?;
        let want = proof(key, b"client", &self.client_nonce, &self.server_nonce);
        if ct_eq(&got, &want) {
            Ok(())
        } else {
            Err(ProofError::BadProof)
        }
    }
}

/// The client side of one connection's proof.
pub struct ClientProof {
    client_nonce: Vec<u8>,
}

impl ClientProof {
    pub fn new(client_nonce: &str) -> Result<ClientProof, ProofError> {
        Ok(ClientProof {
            client_nonce: nonce_bytes(client_nonce, "client nonce")?,
        })
    }

    /// Checks the server's proof and returns ours to send.
    pub fn answer(
        &self,
        key: &SharedKey,
        server_nonce: &str,
        server_proof: &str,
    ) -> Result<String, ProofError> {
        let sn = nonce_bytes(server_nonce, "server nonce")?;
        let got = from_hex(server_proof).ok_or(ProofError::Malformed("server proof"))?;
        let want = proof(key, b"server", &self.client_nonce, &sn);
        if !ct_eq(&got, &want) {
            return Err(ProofError::BadProof);
        }
        Ok(to_hex(&proof(key, b"client", &self.client_nonce, &sn)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::fresh_nonce;

    fn key(b: &[u8]) -> SharedKey {
        SharedKey::from_bytes(b.to_vec()).unwrap()
    }

    #[test]
    fn both_sides_prove_the_key() {
        let k = key(&[7u8; 32]);
        let (nc, ns) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
        let s = ServerProof::new(&nc, &ns).unwrap();
        let c = ClientProof::new(&nc).unwrap();
        let answer = c.answer(&k, &ns, &s.server_proof(&k)).unwrap();
        s.check_client(&k, &answer).unwrap();
    }

    #[test]
    fn a_wrong_key_fails_both_ways() {
        let (good, bad) = (key(&[7u8; 32]), key(&[8u8; 32]));
        let (nc, ns) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
        let s = ServerProof::new(&nc, &ns).unwrap();
        let c = ClientProof::new(&nc).unwrap();
        // A server without the key cannot convince the client.
        assert_eq!(
            c.answer(&good, &ns, &s.server_proof(&bad)),
            Err(ProofError::BadProof)
        );
        // A client without the key cannot convince the server.
        let forged = ClientProof::new(&nc)
            .unwrap()
            .answer(&bad, &ns, &s.server_proof(&bad))
            .unwrap();
        assert_eq!(s.check_client(&good, &forged), Err(ProofError::BadProof));
    }

    #[test]
    fn a_replayed_proof_fails_on_a_new_connection() {
        let k = key(&[7u8; 32]);
        let nc = fresh_nonce().unwrap();
        let ns1 = fresh_nonce().unwrap();
        let s1 = ServerProof::new(&nc, &ns1).unwrap();
        let recorded = ClientProof::new(&nc)
            .unwrap()
            .answer(&k, &ns1, &s1.server_proof(&k))
            .unwrap();
        // Same client nonce replayed by an attacker, but the server picks a fresh nonce.
        let s2 = ServerProof::new(&nc, &fresh_nonce().unwrap()).unwrap();
        assert_eq!(s2.check_client(&k, &recorded), Err(ProofError::BadProof));
        // Reflecting the server's own proof back does not pass either.
        assert_eq!(
            s1.check_client(&k, &s1.server_proof(&k)),
            Err(ProofError::BadProof)
        );
    }

    #[test]
    fn malformed_inputs_are_errors() {
        assert!(ServerProof::new("zz", &fresh_nonce().unwrap()).is_err());
        assert!(ClientProof::new("00").is_err());
        let k = key(&[1u8; 32]);
        let nc = fresh_nonce().unwrap();
        let c = ClientProof::new(&nc).unwrap();
        assert!(c.answer(&k, &fresh_nonce().unwrap(), "not hex").is_err());
    }
}
