//! The `leases` of an `acquire` reply on the wire: a region's device (`cxl`: its
//! UUID, path and range, about 150 bytes of JSON) comes with the first lease of the
//! reply in that region only; the later leases of that region name none, and the
//! decoder ([`filled`]) gives them the first one's. maru-server's `acquire` builds its
//! reply so ([`Named`]: the device is made once per region and reply, not per
//! lease). A batch's leases lie in a region or two, so a reply names each device
//! once instead of once per lease.
//!
//! Nothing a lease proves changes: each lease still carries its own range, and a
//! `remote_cxl` lease the read token of exactly that range. A lease that names a
//! device keeps the one it names (only a lease that names none is filled, from an
//! earlier lease of its own region in the same reply). A reply with a device on every
//! lease (an older maru-server's) decodes as before.

use super::meta::LeaseGrant;
use serde::{Deserialize, Deserializer};

/// Regions whose device a reply names once at most, on each side (a batch's leases
/// lie in a region or two; past it a lease simply carries its device).
const NAMED_MAX: usize = 8;

/// The regions an `acquire` reply named the device of so far (maru-server's side of
/// the rule [`filled`] reads).
#[derive(Debug, Default)]
pub(crate) struct Named {
    regions: [u64; NAMED_MAX],
    len: usize,
}

impl Named {
    /// Whether the next lease of `region_id` in the reply carries its region's
    /// device: the region's first lease, and every lease of a region past the
    /// [`NAMED_MAX`] first regions.
    pub(crate) fn names(&mut self, region_id: u64) -> bool {
        if self.regions[..self.len].contains(&region_id) {
            return false;
        }
        if self.len < NAMED_MAX {
            self.regions[self.len] = region_id;
            self.len += 1;
        }
        true
    }
}

/// Reads `leases`, giving each lease that names no device the device an earlier lease
/// of its region named in this reply.
pub(crate) fn filled<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Option<LeaseGrant>>, D::Error> {
    let mut leases: Vec<Option<LeaseGrant>> = Vec::deserialize(d)?;
    let mut named: Vec<(u64, usize)> = Vec::new();
    for i in 0..leases.len() {
        let Some(g) = &leases[i] else { continue };
        let region = g.region_id;
        if g.device.is_some() {
            if named.len() < NAMED_MAX && !named.iter().any(|&(r, _)| r == region) {
                named.push((region, i));
            }
            continue;
        }
        let Some(&(_, from)) = named.iter().find(|&&(r, _)| r == region) else {
            continue;
        };
        let device = leases[from].as_ref().and_then(|f| f.device.clone());
        if let Some(g) = &mut leases[i] {
            g.device = device;
        }
    }
    Ok(leases)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::meta::{DeviceRange, MetaReply};

    fn device(uuid: &str, at: u64) -> DeviceRange {
        DeviceRange {
            uuid: uuid.into(),
            path: "/dev/dax0.0".into(),
            region_offset: at,
            region_length: 1 << 30,
        }
    }

    /// A `cxl` lease (no read token: its reader checks none).
    fn lease(id: u64, region_id: u64, device: Option<DeviceRange>) -> Option<LeaseGrant> {
        Some(LeaseGrant {
            lease_id: id,
            region_id,
            offset: id << 18,
            length: 1 << 18,
            read_token: String::new(),
            agent: None,
            device,
            expires_in_ms: 60_000,
            boot_id: None,
        })
    }

    /// The leases as maru-server's `acquire` writes them: the device only where
    /// [`Named`] says.
    fn as_acquire_writes(leases: &[Option<LeaseGrant>]) -> Vec<Option<LeaseGrant>> {
        let mut named = Named::default();
        leases
            .iter()
            .map(|l| {
                let mut g = l.clone()?;
                if g.device.is_some() && !named.names(g.region_id) {
                    g.device = None;
                }
                Some(g)
            })
            .collect()
    }

    fn round_trip(leases: Vec<Option<LeaseGrant>>) -> (String, Vec<Option<LeaseGrant>>) {
        let json = serde_json::to_string(&MetaReply::Leases { leases }).expect("encode");
        let MetaReply::Leases { leases } = serde_json::from_str(&json).expect("decode") else {
            panic!("not leases: {json}");
        };
        (json, leases)
    }

    /// A reply of 32 leases in two regions (and a miss, a `remote_cxl` lease without a
    /// device) names each region's device once and decodes to the whole leases, every
    /// one with its device. Seen failing with `names` always false (the later leases
    /// of a region decoded without a device).
    #[test]
    fn a_reply_names_each_regions_device_once_and_decodes_whole() {
        let (a, b) = (device("uuid-a", 0), device("uuid-a", 1 << 30));
        let mut leases: Vec<Option<LeaseGrant>> = (0..32)
            .map(|i| {
                lease(
                    i,
                    if i < 20 { 5 } else { 6 },
                    Some(if i < 20 { a.clone() } else { b.clone() }),
                )
            })
            .collect();
        leases.insert(3, None);
        let mut remote = lease(40, 9, None);
        if let Some(g) = &mut remote {
            g.read_token = "ab".repeat(16);
            g.agent = Some("10.0.0.9:7000".into());
        }
        leases.push(remote);
        // Region 5 again after region 6: still named once.
        leases.push(lease(41, 5, Some(a.clone())));
        let (json, back) = round_trip(as_acquire_writes(&leases));
        assert_eq!(json.matches("uuid-a").count(), 2, "{json}");
        assert!(!json.contains("null,\"device\"") && !json.contains("\"agent\":null"));
        // Only the lease served by an agent carries a read token.
        assert_eq!(json.matches(r#""read_token":"""#).count(), 33, "{json}");
        assert_eq!(json.matches(&"ab".repeat(16)).count(), 1, "{json}");
        assert_eq!(back, leases);
    }

    /// Leases in more regions than a reply names the devices of: the regions past the
    /// first [`NAMED_MAX`] carry their device on every lease, and every lease decodes
    /// with its own region's device.
    #[test]
    fn past_the_named_regions_each_lease_carries_its_device() {
        let regions = NAMED_MAX as u64 + 3;
        let leases: Vec<Option<LeaseGrant>> = (0..4 * regions)
            .map(|i| {
                let r = i % regions;
                lease(i, r, Some(device(&format!("uuid-{r}"), r << 30)))
            })
            .collect();
        let (json, back) = round_trip(as_acquire_writes(&leases));
        assert_eq!(json.matches("uuid-0\"").count(), 1, "{json}");
        assert_eq!(json.matches(&format!("uuid-{}\"", regions - 1)).count(), 4);
        assert_eq!(back, leases);
    }

    /// A lease that names a device keeps it, also another than an earlier lease of
    /// its region named (nothing is overwritten), and a reply with a device and a
    /// read token on every lease, as an older maru-server writes it, decodes as
    /// written.
    #[test]
    fn a_named_device_is_kept_and_the_full_form_still_decodes() {
        let (a, other) = (device("uuid-a", 0), device("uuid-x", 4096));
        let leases = vec![
            lease(1, 5, Some(a.clone())),
            lease(2, 5, Some(other.clone())),
            lease(3, 5, None),
        ];
        let (json, back) = round_trip(leases);
        assert_eq!(json.matches("uuid-x").count(), 1);
        let devices: Vec<_> = back
            .iter()
            .map(|l| l.as_ref().and_then(|g| g.device.clone()))
            .collect();
        assert_eq!(devices, vec![Some(a.clone()), Some(other), Some(a)]);
        let full = r#"{"kind":"leases","leases":[
            {"lease_id":1,"region_id":5,"offset":0,"length":8,"read_token":"ab","agent":null,
             "device":{"uuid":"u","path":"/p","region_offset":0,"region_length":64},"expires_in_ms":9},
            null,
            {"lease_id":2,"region_id":5,"offset":8,"length":8,"read_token":"cd","agent":null,
             "device":{"uuid":"u","path":"/p","region_offset":0,"region_length":64},"expires_in_ms":9}]}"#;
        let MetaReply::Leases { leases } = serde_json::from_str(full).expect("decode") else {
            panic!("not leases");
        };
        assert_eq!(leases.len(), 3);
        assert!(leases[0]
            .as_ref()
            .is_some_and(|g| g.device.is_some() && g.read_token == "ab"));
        assert_eq!(
            leases[0].as_ref().and_then(|g| g.device.clone()),
            leases[2].as_ref().and_then(|g| g.device.clone())
        );
    }

    /// A lease with no device of its own whose region no earlier lease named (a
    /// `remote_cxl` region, or a lease ahead of its region's first) stays without one.
    #[test]
    fn no_device_is_made_up() {
        let json = r#"{"kind":"leases","leases":[
            {"lease_id":2,"region_id":5,"offset":8,"length":8,"read_token":"cd","expires_in_ms":9},
            {"lease_id":1,"region_id":6,"offset":0,"length":8,"read_token":"ab",
             "device":{"uuid":"u","path":"/p","region_offset":0,"region_length":64},"expires_in_ms":9}]}"#;
        let MetaReply::Leases { leases } = serde_json::from_str(json).expect("decode") else {
            panic!("not leases");
        };
        assert!(leases[0]
            .as_ref()
            .is_some_and(|g| g.device.is_none() && g.agent.is_none()));
        assert!(leases[1].as_ref().is_some_and(|g| g.device.is_some()));
    }
}
