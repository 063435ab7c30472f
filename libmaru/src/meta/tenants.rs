//! Tenants: who may write and read which namespaces, and what each may hold.
//!
//! A key names a principal, its *tenant* (the handshake proves the key; the tenant is
//! the server's name for it, never a name the client declares). Namespaces belong to
//! tenants: a session may publish, pin and remove only in a namespace its tenant
//! *writes*, and opens only in one its tenant writes or *reads*. Each namespace has
//! at most one writing tenant, so no other key holder can publish first into it (cache
//! poisoning) or pin or remove its keys. Sessions of one tenant share keys as
//! before: among them the first publish of a key wins; a tenant is one trust domain.
//!
//! Patterns: a namespace name, or a prefix ending in `*` (`llama-*`; `*` alone is
//! every namespace). The `default` tenant (maru-server's own key) writes, unless the
//! tenants file says otherwise, every namespace no other tenant writes.
//!
//! Limits count per tenant, not per connection or session: sessions, regions (a
//! storing tenant's share of the pool, and an optional cap), pins, and requests parked
//! while the RM allocates.

use super::config::ConfigError;
use std::fmt;

/// The tenant of maru-server's own key (and of every client of a server without a key).
pub const DEFAULT_TENANT: &str = crate::auth::DEFAULT_KEY_NAME;

/// Longest tenant name.
pub const MAX_TENANT_NAME: usize = 64;

/// A namespace pattern: an exact name, or a prefix (`name*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NsPattern {
    Exact(String),
    Prefix(String),
}

impl NsPattern {
    pub fn parse(s: &str) -> Result<NsPattern, ConfigError> {
        let bad = |why: &str| {
            Err(ConfigError(format!(
                "namespace pattern {:?}: {why}",
                s.chars().take(64).collect::<String>()
            )))
        };
        if s.len() > crate::wire::meta::MAX_NAME_LEN || s.chars().any(char::is_control) {
            return bad("at most 1024 bytes, no control characters");
        }
        match s.strip_suffix('*') {
            Some(p) if p.contains('*') => bad("'*' only at the end"),
            Some(p) => Ok(NsPattern::Prefix(p.to_string())),
            None if s.contains('*') => bad("'*' only at the end"),
            None => Ok(NsPattern::Exact(s.to_string())),
        }
    }

    pub fn matches(&self, ns: &str) -> bool {
        match self {
            NsPattern::Exact(e) => e == ns,
            NsPattern::Prefix(p) => ns.starts_with(p.as_str()),
        }
    }

    /// Whether some namespace matches both.
    pub fn overlaps(&self, other: &NsPattern) -> bool {
        use NsPattern::*;
        match (self, other) {
            (Exact(a), Exact(b)) => a == b,
            (Exact(a), Prefix(p)) | (Prefix(p), Exact(a)) => a.starts_with(p.as_str()),
            (Prefix(p), Prefix(q)) => p.starts_with(q.as_str()) || q.starts_with(p.as_str()),
        }
    }
}

impl fmt::Display for NsPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NsPattern::Exact(e) => write!(f, "{e}"),
            NsPattern::Prefix(p) => write!(f, "{p}*"),
        }
    }
}

/// What a tenant may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantLimits {
    /// Live sessions (and opens waiting for their first region).
    pub max_sessions: usize,
    /// Regions held by its sessions, on top of its share of a pool several tenants
    /// store in (0: the share only).
    pub max_regions: usize,
    /// Pins held by its sessions (each session's distinct pinned keys, summed).
    pub max_pins: usize,
    /// Requests waiting for a region from the RM.
    pub max_parked: usize,
}

/// Default limits of a tenant.
pub const DEFAULT_LIMITS: TenantLimits = TenantLimits {
    max_sessions: 64,
    max_regions: 0,
    max_pins: 65_536,
    max_parked: 32,
};

/// Limits of the default tenant when no tenants file says otherwise: it is every
/// client of a server with one key, so only the server-wide session limit bounds its
/// sessions.
pub const DEFAULT_TENANT_LIMITS: TenantLimits = TenantLimits {
    max_sessions: usize::MAX,
    max_regions: 0,
    max_pins: 1 << 20,
    max_parked: 256,
};

impl Default for TenantLimits {
    fn default() -> Self {
        DEFAULT_LIMITS
    }
}

/// One tenant as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSpec {
    pub name: String,
    /// Namespaces it writes (and reads). None: every namespace no other tenant writes.
    pub write: Option<Vec<NsPattern>>,
    /// Namespaces it reads besides those it writes.
    pub read: Vec<NsPattern>,
    pub limits: TenantLimits,
}

impl TenantSpec {
    /// The default tenant (maru-server's own key), writing every namespace no other
    /// tenant writes.
    pub fn unclaimed(limits: TenantLimits) -> TenantSpec {
        TenantSpec {
            name: DEFAULT_TENANT.to_string(),
            write: None,
            read: Vec::new(),
            limits,
        }
    }

    /// A tenant writing `write` (and reading it), with default limits.
    pub fn writer(name: &str, write: &[&str]) -> Result<TenantSpec, ConfigError> {
        Ok(TenantSpec {
            name: name.to_string(),
            write: Some(
                write
                    .iter()
                    .map(|p| NsPattern::parse(p))
                    .collect::<Result<_, _>>()?,
            ),
            read: Vec::new(),
            limits: TenantLimits::default(),
        })
    }
}

/// What a tenant may do in a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    None,
    /// exists, acquire, release leases.
    Read,
    /// Also publish, pin, remove, and take regions and pages to store.
    Write,
}

/// Every tenant and its namespaces, checked once when built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenants {
    specs: Vec<TenantSpec>,
}

/// Whether a tenant name is usable in logs, records and files.
pub fn check_tenant_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TENANT_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "tenant name {:?}: 1 to {MAX_TENANT_NAME} letters, digits, '-', '_' or '.'",
            name.chars().take(80).collect::<String>()
        )))
    }
}

impl Default for Tenants {
    /// The default tenant alone, writing every namespace.
    fn default() -> Self {
        Tenants {
            specs: vec![TenantSpec::unclaimed(DEFAULT_TENANT_LIMITS)],
        }
    }
}

impl Tenants {
    /// Checks names (distinct, usable) and namespaces: at most one tenant writes any
    /// namespace, and at most one writes "every namespace no other tenant writes".
    pub fn new(specs: Vec<TenantSpec>) -> Result<Tenants, ConfigError> {
        for (i, t) in specs.iter().enumerate() {
            check_tenant_name(&t.name)?;
            if specs[..i].iter().any(|o| o.name == t.name) {
                return Err(ConfigError(format!("tenant {} is given twice", t.name)));
            }
            if t.write.is_none() && specs[..i].iter().any(|o| o.write.is_none()) {
                return Err(ConfigError(format!(
                    "tenant {} writes every unclaimed namespace, as another tenant does: \
                     give it its namespaces (write = [...])",
                    t.name
                )));
            }
            let limits = &t.limits;
            if limits.max_sessions == 0 || limits.max_parked == 0 {
                return Err(ConfigError(format!(
                    "tenant {}: max_sessions and max_parked must be at least 1",
                    t.name
                )));
            }
            for o in &specs[..i] {
                for p in t.write.iter().flatten() {
                    if let Some(q) = o.write.iter().flatten().find(|q| p.overlaps(q)) {
                        return Err(ConfigError(format!(
                            "namespace {p} of tenant {} overlaps {q} of tenant {}: a namespace \
                             has one writing tenant (others may read it)",
                            t.name, o.name
                        )));
                    }
                }
            }
        }
        Ok(Tenants { specs })
    }

    pub fn get(&self, name: &str) -> Option<&TenantSpec> {
        self.specs.iter().find(|t| t.name == name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.specs.iter().map(|t| t.name.as_str())
    }

    /// The tenant's limits (an unknown tenant may hold nothing: it has no access).
    pub fn limits(&self, tenant: &str) -> TenantLimits {
        self.get(tenant).map_or(DEFAULT_LIMITS, |t| t.limits)
    }

    /// The tenant that writes `ns`, if any.
    pub fn writer_of(&self, ns: &str) -> Option<&str> {
        let explicit = self
            .specs
            .iter()
            .find(|t| t.write.iter().flatten().any(|p| p.matches(ns)));
        explicit
            .or_else(|| self.specs.iter().find(|t| t.write.is_none()))
            .map(|t| t.name.as_str())
    }

    /// What `tenant` may do in namespace `ns`.
    pub fn access(&self, tenant: &str, ns: &str) -> Access {
        let Some(t) = self.get(tenant) else {
            return Access::None;
        };
        if self.writer_of(ns) == Some(tenant) {
            Access::Write
        } else if t.read.iter().any(|p| p.matches(ns)) {
            Access::Read
        } else {
            Access::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, write: Option<&[&str]>, read: &[&str]) -> TenantSpec {
        TenantSpec {
            name: name.into(),
            write: write.map(|w| w.iter().map(|p| NsPattern::parse(p).unwrap()).collect()),
            read: read.iter().map(|p| NsPattern::parse(p).unwrap()).collect(),
            limits: TenantLimits::default(),
        }
    }

    #[test]
    fn a_namespace_is_written_by_one_tenant_and_read_by_those_allowed() {
        let t = Tenants::new(vec![
            spec("default", None, &[]),
            spec("alpha", Some(&["llama-8b", "alpha-*"]), &["shared-*"]),
            spec("beta", Some(&["shared-docs"]), &[]),
        ])
        .unwrap();
        assert_eq!(t.access("alpha", "llama-8b"), Access::Write);
        assert_eq!(t.access("alpha", "alpha-x"), Access::Write);
        assert_eq!(t.access("alpha", "shared-docs"), Access::Read);
        assert_eq!(t.access("beta", "shared-docs"), Access::Write);
        assert_eq!(t.access("beta", "llama-8b"), Access::None);
        // The default tenant writes what nobody else writes, and nothing else.
        assert_eq!(t.access("default", "other"), Access::Write);
        assert_eq!(t.access("default", "llama-8b"), Access::None);
        assert_eq!(t.access("nobody", "other"), Access::None);
        assert_eq!(t.writer_of("alpha-1"), Some("alpha"));
    }

    #[test]
    fn two_tenants_cannot_write_one_namespace() {
        for (a, b) in [
            (&["ns"][..], &["ns"][..]),
            (&["ns-*"], &["ns-1"]),
            (&["a*"], &["ab*"]),
            (&["*"], &["x"]),
        ] {
            let e =
                Tenants::new(vec![spec("a", Some(a), &[]), spec("b", Some(b), &[])]).unwrap_err();
            assert!(e.0.contains("one writing tenant"), "{e}");
        }
        assert!(Tenants::new(vec![
            spec("a", Some(&["ab*"]), &[]),
            spec("b", Some(&["ac"]), &["ab*"])
        ])
        .is_ok());
        assert!(Tenants::new(vec![spec("a", None, &[]), spec("b", None, &[])]).is_err());
        assert!(Tenants::new(vec![spec("a", None, &[]), spec("a", Some(&["x"]), &[])]).is_err());
        assert!(Tenants::new(vec![spec("bad name", None, &[])]).is_err());
    }

    #[test]
    fn patterns_take_a_star_only_at_the_end() {
        assert_eq!(
            NsPattern::parse("*").unwrap(),
            NsPattern::Prefix(String::new())
        );
        assert!(NsPattern::parse("a*b").is_err());
        assert!(NsPattern::parse("a**").is_err());
        assert!(NsPattern::parse("a\nb").is_err());
        assert!(NsPattern::parse("*").unwrap().matches(""));
        assert!(!NsPattern::parse("ab").unwrap().matches("abc"));
    }
}
