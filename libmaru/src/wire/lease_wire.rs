//! The `leases` of an `acquire` reply on the wire: a region's device (`cxl`: its
//! UUID, path and range, about 150 bytes of JSON) is written with the first lease of
//! the reply in that region and left out of the leases after it in the same region,
//! which the decoder fills in from that first one. A batch's leases lie in a region
//! or two, so a reply names each device once instead of once per lease.
//!
//! Nothing a lease proves changes: each lease still carries its own range and the
//! read token of exactly that range, and a lease that names a device keeps the one it
//! names (only a lease that names none is filled, from an earlier lease of its own
//! region in the same reply). A reply with a device on every lease (an older
//! maru-server's) decodes as before.

use super::meta::{DeviceRange, LeaseGrant};
use serde::ser::{SerializeSeq, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Devices remembered per reply at most, on each side (a batch's leases lie in a
/// region or two; past it a lease simply carries its device).
const NAMED_MAX: usize = 8;

/// One lease as written: `device` left out when an earlier lease of the reply named
/// the same device for the same region (and `agent`, `boot_id` when absent).
struct Thin<'a> {
    g: &'a LeaseGrant,
    device: Option<&'a DeviceRange>,
}

impl Serialize for Thin<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let g = self.g;
        let mut st = s.serialize_struct("LeaseGrant", 9)?;
        st.serialize_field("lease_id", &g.lease_id)?;
        st.serialize_field("region_id", &g.region_id)?;
        st.serialize_field("offset", &g.offset)?;
        st.serialize_field("length", &g.length)?;
        st.serialize_field("read_token", &g.read_token)?;
        match &g.agent {
            Some(a) => st.serialize_field("agent", a)?,
            None => st.skip_field("agent")?,
        }
        match self.device {
            Some(d) => st.serialize_field("device", d)?,
            None => st.skip_field("device")?,
        }
        st.serialize_field("expires_in_ms", &g.expires_in_ms)?;
        match &g.boot_id {
            Some(b) => st.serialize_field("boot_id", b)?,
            None => st.skip_field("boot_id")?,
        }
        st.end()
    }
}

/// Writes `leases` naming each region's device once (see the module).
pub(super) fn thin<S: Serializer>(leases: &[Option<LeaseGrant>], s: S) -> Result<S::Ok, S::Error> {
    let mut seq = s.serialize_seq(Some(leases.len()))?;
    let mut named: Vec<(u64, &DeviceRange)> = Vec::new();
    for l in leases {
        let Some(g) = l else {
            seq.serialize_element(&None::<()>)?;
            continue;
        };
        let device = match &g.device {
            Some(d) if named.iter().any(|&(r, n)| r == g.region_id && n == d) => None,
            Some(d) => {
                if named.len() < NAMED_MAX {
                    named.push((g.region_id, d));
                }
                Some(d)
            }
            None => None,
        };
        seq.serialize_element(&Thin { g, device })?;
    }
    seq.end()
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
    use crate::wire::meta::MetaReply;

    fn device(uuid: &str, at: u64) -> DeviceRange {
        DeviceRange {
            uuid: uuid.into(),
            path: "/dev/dax0.0".into(),
            region_offset: at,
            region_length: 1 << 30,
        }
    }

    fn lease(id: u64, region_id: u64, device: Option<DeviceRange>) -> Option<LeaseGrant> {
        Some(LeaseGrant {
            lease_id: id,
            region_id,
            offset: id << 18,
            length: 1 << 18,
            read_token: format!("{id:032x}"),
            agent: None,
            device,
            expires_in_ms: 60_000,
            boot_id: None,
        })
    }

    /// A reply of 32 leases in two regions (and a miss, a `remote_cxl` lease without a
    /// device) names each region's device once and decodes to the same leases, every
    /// one with its device.
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
        leases.push(lease(40, 9, None));
        // Region 5 again after region 6: still named once.
        leases.push(lease(41, 5, Some(a.clone())));
        let reply = MetaReply::Leases { leases };
        let json = serde_json::to_string(&reply).expect("encode");
        assert_eq!(json.matches("uuid-a").count(), 2, "{json}");
        assert!(!json.contains("null,\"device\"") && !json.contains("\"agent\":null"));
        let back: MetaReply = serde_json::from_str(&json).expect("decode");
        assert_eq!(back, reply);
    }

    /// A lease that names a device keeps it, also another than an earlier lease of
    /// its region named (nothing is overwritten), and a reply with a device on every
    /// lease, as an older maru-server writes it, decodes as written.
    #[test]
    fn a_named_device_is_kept_and_the_full_form_still_decodes() {
        let (a, other) = (device("uuid-a", 0), device("uuid-x", 4096));
        let reply = MetaReply::Leases {
            leases: vec![
                lease(1, 5, Some(a.clone())),
                lease(2, 5, Some(other.clone())),
                lease(3, 5, Some(a.clone())),
            ],
        };
        let json = serde_json::to_string(&reply).expect("encode");
        assert_eq!(json.matches("uuid-x").count(), 1);
        let back: MetaReply = serde_json::from_str(&json).expect("decode");
        assert_eq!(back, reply);
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
        assert!(leases[0].as_ref().is_some_and(|g| g.device.is_some()));
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
