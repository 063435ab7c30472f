//! A reconnecting request/reply link to one daemon: connects on first use, drops the
//! connection after any failure whose outcome is unknown, and connects again on the
//! next call. Used for the RM (from the agent and maru-server) and for agents (from
//! maru-server and workers).

use super::{Client, ClientError, ClientOptions};
use crate::wire::WireError;
use serde::{de::DeserializeOwned, Serialize};
use std::time::{Duration, Instant};

/// Why a call on a link failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The daemon answered with an error (only code `refused` is a refusal).
    #[error("{0}")]
    Remote(WireError),
    /// The daemon could not be reached, or the call's outcome is unknown.
    #[error("{0}")]
    Unreachable(String),
    /// The daemon reached, but a key proof failed (ours or its own).
    #[error("{0}")]
    Auth(String),
    /// The daemon reached, but refused to talk (version) or broke the protocol.
    #[error("{0}")]
    Rejected(String),
}

/// A check run on the welcome of every new connection.
pub type WelcomeCheck = fn(&Client) -> Result<(), String>;

pub struct Link {
    addr: String,
    opts: ClientOptions,
    client: Option<Client>,
    /// Checks the welcome of a new connection (e.g. that an agent reports a boot id).
    check: Option<WelcomeCheck>,
}

impl Link {
    pub fn new(addr: impl Into<String>, opts: ClientOptions) -> Link {
        Link {
            addr: addr.into(),
            opts,
            client: None,
            check: None,
        }
    }

    /// Runs `check` on every new connection; a failure counts as unreachable.
    pub fn with_check(mut self, check: WelcomeCheck) -> Link {
        self.check = Some(check);
        self
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The live connection (connecting if needed).
    pub fn client(&mut self) -> Result<&mut Client, LinkError> {
        self.connect(None)
    }

    /// As [`Link::client`], a connection made now (and its handshake) within `limit`.
    pub fn client_within(&mut self, limit: Duration) -> Result<&mut Client, LinkError> {
        self.connect(Some(limit))
    }

    fn connect(&mut self, limit: Option<Duration>) -> Result<&mut Client, LinkError> {
        // A daemon closes connections idle past its timeout: notice that before a
        // call is lost on it, and connect afresh.
        if self.client.as_ref().is_some_and(Client::is_stale) {
            self.client = None;
        }
        if self.client.is_none() {
            let what = self.opts.service;
            let c = match limit {
                Some(l) => Client::connect_within(&self.addr, &self.opts, l),
                None => Client::connect(&self.addr, &self.opts),
            };
            let c = c.map_err(|e| match e {
                ClientError::Auth { .. } => {
                    LinkError::Auth(format!("{what} at {}: {e}", self.addr))
                }
                ClientError::Protocol { .. } | ClientError::Remote(_) => {
                    LinkError::Rejected(format!("{what} at {}: {e}", self.addr))
                }
                _ => LinkError::Unreachable(format!("{what} at {}: {e}", self.addr)),
            })?;
            if let Some(check) = self.check {
                check(&c)
                    .map_err(|m| LinkError::Unreachable(format!("{what} at {}: {m}", self.addr)))?;
            }
            self.client = Some(c);
        }
        self.client
            .as_mut()
            .ok_or_else(|| LinkError::Unreachable("no connection".into()))
    }

    /// How long calls poll for their reply before they block (see `ClientOptions`).
    pub fn set_reply_spin(&mut self, spin: Duration) {
        self.opts.reply_spin = spin;
        if let Some(c) = &mut self.client {
            c.set_reply_spin(spin);
        }
    }

    /// Presents `secret` in the hello of every later connection (a session secret
    /// maru-server handed out: a reconnect proves the session is this client's).
    pub fn set_resume(&mut self, secret: Option<String>) {
        self.opts.resume = secret;
    }

    /// Forgets the connection (the next call reconnects).
    pub fn reset(&mut self) {
        self.client = None;
    }

    /// Drops a connection the daemon closed while it sat idle (see
    /// [`Client::is_stale`]); whether a connection is open now.
    pub fn refresh(&mut self) -> bool {
        if self.client.as_ref().is_some_and(Client::is_stale) {
            self.client = None;
        }
        self.client.is_some()
    }

    /// Whether a connection is open now.
    pub fn is_connected(&self) -> bool {
        self.client.is_some()
    }

    pub fn call<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
    ) -> Result<Rep, LinkError> {
        self.call_inner(req, None)
    }

    /// As [`Link::call`], with the connect (if one is needed), its handshake, the
    /// request and its reply all within `limit`.
    pub fn call_within<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
        limit: Duration,
    ) -> Result<Rep, LinkError> {
        self.call_inner(req, Some(limit))
    }

    #[allow(clippy::disallowed_methods)] // a driver: the limit starts now
    fn call_inner<Req: Serialize, Rep: DeserializeOwned>(
        &mut self,
        req: &Req,
        limit: Option<Duration>,
    ) -> Result<Rep, LinkError> {
        let until = limit.map(|l| Instant::now() + l);
        let c = self.connect(limit)?;
        let r = match until {
            Some(u) => c.call_within::<Req, Rep>(req, u.saturating_duration_since(Instant::now())),
            None => c.call::<Req, Rep>(req),
        };
        match r {
            Ok(r) => Ok(r),
            Err(ClientError::Remote(e)) => Err(LinkError::Remote(e)),
            Err(e) => {
                self.client = None;
                let (what, addr) = (self.opts.service, &self.addr);
                Err(LinkError::Unreachable(format!("{what} at {addr}: {e}")))
            }
        }
    }
}
