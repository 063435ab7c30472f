//! The tenants of the event loop: the class of each key clients proved (one per
//! tenant, one for handshakes, one for a daemon without a key) and each tenant's share
//! of the connections, which says whom a full server pushes out.

use crate::auth::Keyring;
use std::collections::HashMap;

/// A class of connections ([`super::fair::FairQueue`], [`super::room::FrameRoom`]):
/// one per tenant.
pub(super) type Class = u32;
/// The class of every connection still in its handshake.
pub(super) const PRE_AUTH: Class = 0;
/// The class of the clients of a daemon that has no key.
pub(super) const NO_KEY: Class = 1;

/// The classes of the keys clients proved, by the key's name (a daemon's keyring
/// names a handful: its tenants).
#[derive(Default)]
pub(super) struct Classes {
    by_name: HashMap<String, Class>,
}

impl Classes {
    pub(super) fn of(&mut self, key_name: Option<&str>) -> Class {
        let Some(name) = key_name else {
            return NO_KEY;
        };
        if let Some(c) = self.by_name.get(name) {
            return *c;
        }
        let c = self.by_name.len() as Class + NO_KEY + 1;
        self.by_name.insert(name.to_string(), c);
        c
    }
}

/// The share of `total` connections of the key named `name` in `keys`: its own limit
/// when its configuration gives one, else an even part of what the limits given leave
/// (all of it for a daemon with one key, as before shares). At least one.
pub(super) fn connection_share(keys: &Keyring, name: &str, total: usize) -> usize {
    if let Some(l) = keys.connection_limit(name) {
        return l.max(1);
    }
    let (limited, named) = keys.connection_limits();
    let rest = keys.len().saturating_sub(named).max(1);
    (total.saturating_sub(limited) / rest).max(1)
}

/// Whom a new connection pushes out when every slot is taken and the handshakes
/// are under their share: an idle connection of the tenant furthest over its share
/// of the connections (the one silent longest), never one of a tenant within its
/// share. `conns`: (class, key name, idle, last frame) of each connection past its
/// handshake.
pub(super) fn over_share_victim<'a, T: Copy + 'a>(
    keys: &Keyring,
    total: usize,
    conns: impl Iterator<Item = (T, Class, &'a str, bool, u64)>,
) -> Option<T> {
    // Per class: its count, its name, its idle connection silent longest.
    type PerClass<'n, T> = (usize, &'n str, Option<(u64, T)>);
    let mut per: HashMap<Class, PerClass<'a, T>> = HashMap::new();
    for (t, class, name, idle, last) in conns {
        let e = per.entry(class).or_insert((0, name, None));
        e.0 += 1;
        if idle && e.2.is_none_or(|(l, _)| last < l) {
            e.2 = Some((last, t));
        }
    }
    per.into_values()
        .filter_map(|(n, name, idle)| {
            let over = n.checked_sub(connection_share(keys, name, total))?;
            Some((over, idle?))
        })
        .filter(|(over, _)| *over > 0)
        .max_by_key(|(over, (last, _))| (*over, std::cmp::Reverse(*last)))
        .map(|(_, (_, t))| t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::SharedKey;

    fn ring(names: &[&str]) -> Keyring {
        let named = names
            .iter()
            .map(|n| (n.to_string(), SharedKey::generate().unwrap()))
            .collect();
        Keyring::new(named).unwrap()
    }

    #[test]
    fn a_single_key_daemon_has_all_connections_as_its_share() {
        assert_eq!(
            connection_share(
                &Keyring::single(SharedKey::generate().unwrap()),
                "default",
                100
            ),
            100
        );
        let r = ring(&["a", "b", "c", "d"]);
        assert_eq!(connection_share(&r, "a", 100), 25);
    }

    #[test]
    fn the_victim_is_an_idle_connection_of_the_tenant_furthest_over_never_one_within() {
        let r = ring(&["alpha", "beta", "gamma"]);
        let (a, b, g) = (2u32, 3u32, 4u32);
        // 30 connections, shares of 10: beta holds 16 (6 over), gamma 11 (1 over).
        let mut conns: Vec<(usize, Class, &str, bool, u64)> = Vec::new();
        for i in 0..3 {
            conns.push((i, a, "alpha", true, 0));
        }
        for i in 0..16 {
            conns.push((100 + i, b, "beta", true, 50 + i as u64));
        }
        for i in 0..11 {
            conns.push((200 + i, g, "gamma", true, 0));
        }
        assert_eq!(
            over_share_victim(&r, 30, conns.iter().copied()),
            Some(100),
            "beta's connection silent longest"
        );
        // Beta busy everywhere: gamma's idle one goes; alpha's never.
        for c in conns.iter_mut().filter(|c| c.1 == b) {
            c.3 = false;
        }
        assert_eq!(over_share_victim(&r, 30, conns.iter().copied()), Some(200));
        // Nobody over its share: nobody is pushed out.
        let within: Vec<_> = conns
            .iter()
            .copied()
            .filter(|c| c.0 < 110 || c.0 >= 200 && c.0 < 210)
            .collect();
        assert_eq!(over_share_victim(&r, 30, within.into_iter()), None);
        // A limit from the configuration: alpha may hold 2, so its 3 put it over.
        r.replace_limited(
            vec![("alpha".into(), SharedKey::generate().unwrap())],
            HashMap::from([("alpha".to_string(), 2)]),
        )
        .unwrap();
        let only_alpha: Vec<_> = conns.iter().copied().filter(|c| c.1 == a).collect();
        assert!(over_share_victim(&r, 30, only_alpha.into_iter()).is_some());
    }
}
