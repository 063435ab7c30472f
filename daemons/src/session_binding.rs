//! Who each of maru-server's connections acts as ([`SessionBinding`]): the owner and
//! tenant of a connection, and the session secrets that let a later connection of the
//! same tenant resume its sessions.

use crate::meta_store::{SecretOp, SecretRecord};
use maru::meta::records::Sealed;
use maru::net::ConnId;
use std::collections::HashMap;

/// Who each connection acts as. A session belongs to the connection that opened it
/// (its *owner*), never to the client id a peer declares: a new connection acts on an
/// existing session only when its hello presents that session's secret and it proved
/// the key of the same tenant. The tenant is the keyring's name of the key the
/// connection proved (the `default` tenant without a key).
///
/// Secrets are kept by a keyed hash only (so the durable directory never holds one
/// that would open a session), and an owner's name carries the server's run number,
/// so a connection of a later run never takes the name of an owner recorded by an
/// earlier one.
#[derive(Default)]
pub struct SessionBinding {
    /// The owner and tenant of each open connection.
    conns: HashMap<ConnId, Bound>,
    /// Hash of a session secret → the owner and tenant whose sessions it opens.
    secrets: HashMap<String, Bound>,
    next_prune_ms: u64,
    /// Starts of this server on its state directory (0 without one).
    run: u64,
}

/// Whom a connection acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    pub owner: String,
    pub tenant: String,
}

/// How often secrets of owners without a live session are forgotten.
const PRUNE_MS: u64 = 5_000;

/// The keyed hash a session secret is kept under.
pub fn secret_hash(secret: &str) -> String {
    maru::auth::to_hex(&maru::auth::hmac_parts(
        b"maru-server session secret",
        &[secret.as_bytes()],
    ))
}

impl SessionBinding {
    /// A binding for run `run` of the server, knowing the secrets an earlier run
    /// handed out (by hash).
    pub fn restored(run: u64, secrets: Vec<(String, SecretRecord)>) -> SessionBinding {
        SessionBinding {
            run,
            secrets: secrets
                .into_iter()
                .map(|(h, r)| {
                    (
                        h,
                        Bound {
                            owner: r.owner,
                            tenant: r.tenant,
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }
    }

    fn own(&self, client_id: &str, conn: ConnId) -> String {
        if self.run == 0 {
            format!("{client_id}#{conn}")
        } else {
            format!("{client_id}#{}.{conn}", self.run)
        }
    }

    /// Binds a new connection: to the owner of the session secret it presents when
    /// it proved that owner's tenant, or else to an owner of its own.
    pub fn open(&mut self, conn: ConnId, client_id: &str, tenant: &str, resume: Option<&str>) {
        let known = resume.and_then(|r| self.secrets.get(&secret_hash(r)).cloned());
        let bound = match known {
            Some(b) if b.tenant == tenant => b,
            Some(b) => {
                log::warn!(
                    "connection {conn} of {} (tenant {tenant}) presented the session secret of \
                     tenant {}: refused, it acts as itself",
                    maru::net::clip(client_id),
                    b.tenant
                );
                Bound {
                    owner: self.own(client_id, conn),
                    tenant: tenant.to_string(),
                }
            }
            None => {
                if resume.is_some() {
                    log::info!(
                        "connection {conn} of {} presented an unknown session secret",
                        maru::net::clip(client_id)
                    );
                }
                Bound {
                    owner: self.own(client_id, conn),
                    tenant: tenant.to_string(),
                }
            }
        };
        self.conns.insert(conn, bound);
    }

    pub fn bound(&self, conn: ConnId) -> Option<&Bound> {
        self.conns.get(&conn)
    }

    /// A new secret for a session `conn` opened, and what to keep of it.
    pub fn new_secret(&mut self, conn: ConnId) -> Option<(String, SecretOp)> {
        let bound = self.conns.get(&conn)?.clone();
        let secret = maru::auth::to_hex(&maru::auth::random_bytes(16).ok()?);
        let hash = secret_hash(&secret);
        self.secrets.insert(hash.clone(), bound.clone());
        let keep = SecretOp::Put(
            hash,
            SecretRecord {
                owner: bound.owner,
                tenant: bound.tenant,
                check: 0,
            }
            .sealed(),
        );
        Some((secret, keep))
    }

    /// A connection closed; returns its owner when no other open connection acts
    /// as it.
    pub fn close(&mut self, conn: ConnId) -> Option<String> {
        let b = self.conns.remove(&conn)?;
        (!self.conns.values().any(|q| q.owner == b.owner)).then_some(b.owner)
    }

    /// Forgets every secret of `tenant` (its key was removed or changed): no later
    /// connection resumes what the old key opened. Returns what to remove from the
    /// kept ones.
    pub fn forget_tenant(&mut self, tenant: &str) -> Vec<SecretOp> {
        let gone: Vec<String> = self
            .secrets
            .iter()
            .filter(|(_, b)| b.tenant == tenant)
            .map(|(h, _)| h.clone())
            .collect();
        for h in &gone {
            self.secrets.remove(h);
        }
        gone.into_iter().map(SecretOp::Delete).collect()
    }

    /// Forgets secrets whose owner has no live session (at most every few seconds);
    /// returns what to remove from the kept ones.
    pub fn prune(&mut self, now_ms: u64, live: impl Fn(&str) -> bool) -> Vec<SecretOp> {
        if now_ms < self.next_prune_ms {
            return Vec::new();
        }
        self.next_prune_ms = now_ms + PRUNE_MS;
        let gone: Vec<String> = self
            .secrets
            .iter()
            .filter(|(_, b)| !live(&b.owner))
            .map(|(h, _)| h.clone())
            .collect();
        for h in &gone {
            self.secrets.remove(h);
        }
        gone.into_iter().map(SecretOp::Delete).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_secret_resumes_only_under_the_tenant_that_opened_it() {
        let mut b = SessionBinding::default();
        b.open(1, "engine", "victim", None);
        let (secret, _) = b.new_secret(1).unwrap();
        let owner = b.bound(1).unwrap().owner.clone();
        // Another connection of the same tenant with the secret acts as the owner.
        b.open(2, "engine", "victim", Some(&secret));
        assert_eq!(b.bound(2).unwrap().owner, owner);
        // A key holder of another tenant who learned the secret does not.
        b.open(3, "engine", "attacker", Some(&secret));
        let thief = b.bound(3).unwrap();
        assert_ne!(thief.owner, owner);
        assert_eq!(thief.tenant, "attacker");
        // Nor does a declared client id by itself.
        b.open(4, "engine", "victim", None);
        assert_ne!(b.bound(4).unwrap().owner, owner);
    }
}
