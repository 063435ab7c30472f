//! maru-server's durable directory as read back from disk: records of every table
//! (keys in their binary form, scopes, sessions and regions in JSON) from any bytes.
//! A record decodes or gives an error, never a panic; a key record that decodes
//! encodes back to the same bytes; and whatever decodes (duplicate ids, sessions of
//! unknown scopes, keys outside their region, pages beyond a region, huge counts)
//! restores a core or is refused, never a panic or unbounded memory, and the restored
//! core then checks itself against an RM that holds none or all of its regions.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::meta::records::{
    decode_json, decode_key, encode_key, Image, RegionRecord, ScopeRecord, SessionRecord,
};
use maru::meta::{MetaConfig, MetaCore, Tenants};
use maru::wire::rm::RegionInfo;

fuzz_target!(|data: &[u8]| {
    let mut image = Image::default();
    // A flags byte (bit 0: the RM holds every recorded region), then records: a kind
    // byte, a 2-byte little-endian length, that many bytes.
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let mut id = 0u64;
    while rest.len() >= 3 {
        let kind = rest[0];
        let n = (u16::from_le_bytes([rest[1], rest[2]]) as usize).min(rest.len() - 3);
        let body = &rest[3..3 + n];
        rest = &rest[3 + n..];
        id += 1;
        match kind % 5 {
            0 => {
                if let Ok(k) = decode_key(id, body) {
                    assert_eq!(encode_key(&k), body, "a key record re-encodes as read");
                    image.keys.push(k);
                }
            }
            1 => {
                if let Ok(s) = decode_json::<ScopeRecord>("scope", body) {
                    image.scopes.push(s);
                }
            }
            2 => {
                if let Ok(s) = decode_json::<SessionRecord>("session", body) {
                    image.sessions.push(s);
                }
            }
            3 => {
                if let Ok(r) = decode_json::<RegionRecord>("region", body) {
                    image.regions.push(r);
                }
            }
            _ => {
                // The store's counters.
                let mut b = [0u8; 8];
                let m = body.len().min(8);
                b[..m].copy_from_slice(&body[..m]);
                match body.first().copied().unwrap_or(0) % 3 {
                    0 => image.next_session = u64::from_le_bytes(b),
                    1 => image.run = u64::from_le_bytes(b),
                    _ => image.lease_timeout_ms = u64::from_le_bytes(b),
                }
            }
        }
    }
    let cfg = MetaConfig {
        region_size: 256 << 10,
        chunk_size: 64 << 10,
        session_timeout_ms: 5_000,
        lease_timeout_ms: 3_000,
        max_sessions: 4,
        ..MetaConfig::default()
    };
    let held: Vec<RegionInfo> = image
        .regions
        .iter()
        .map(|r| RegionInfo {
            region_id: r.handle.region_id,
            pool_id: r.pool.pool_id,
            offset: r.handle.offset,
            length: r.handle.length,
            owner: "maru-server/fuzz".into(),
            requested: r.handle.length,
            state: "allocated".into(),
            holds: Vec::new(),
            token: Some(r.handle.token.clone()),
        })
        .collect();
    let all = flags & 1 == 1;
    let Ok((mut core, _)) = MetaCore::restore(cfg, Tenants::default(), image, 1_000) else {
        return;
    };
    let _ = core.recovered_rm(if all { &held } else { &[] }, 1_000);
    let _ = core.total_stats();
});
