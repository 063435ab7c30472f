//! The resource manager's pools and regions as text tables, one way for every tool that
//! shows them (`maru-rm-ctl pools` / `regions` / `holds`, the RM part of `maru-usage`).

use maru::wire::rm::{HoldInfo, PoolInfo, RegionInfo};
use std::fmt::Write as _;

/// Bytes as MiB with one decimal.
pub fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

/// The pools, one a line. With `regions` (what the RM listed of them), a REGIONS
/// column says how many each pool holds.
pub fn pools(pools: &[PoolInfo], regions: Option<&[RegionInfo]>) -> String {
    let mut o = String::new();
    let count = |label: &str| {
        if regions.is_some() {
            format!(" {label:>7}")
        } else {
            String::new()
        }
    };
    let _ = writeln!(
        o,
        "{:<4} {:<32} {:<7} {:>10} {:>10} {:>10} {:>7}{}  UUID",
        "POOL",
        "PATH",
        "KIND",
        "TOTAL_MiB",
        "FREE_MiB",
        "DRAIN_MiB",
        "ALIGN_K",
        count("REGIONS")
    );
    for p in pools {
        let n = regions.map(|rs| rs.iter().filter(|r| r.pool_id == p.pool_id).count());
        let _ = writeln!(
            o,
            "{:<4} {:<32} {:<7} {:>10} {:>10} {:>10} {:>7}{}  {}",
            p.pool_id,
            p.path,
            p.kind,
            mib(p.total),
            mib(p.free),
            mib(p.draining),
            p.align >> 10,
            n.map(|n| count(&n.to_string())).unwrap_or_default(),
            p.uuid
        );
    }
    o
}

/// The regions, one a line, with their holds as `node@epoch` (`-`: none).
pub fn regions(regions: &[RegionInfo]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<7} {:<36} {:<4} {:>14} {:>9} {:<9} HOLDS",
        "REGION", "OWNER", "POOL", "OFFSET", "LEN_MiB", "STATE"
    );
    for r in regions {
        let holds: Vec<String> = r
            .holds
            .iter()
            .map(|h| format!("{}@{}", h.node, h.epoch))
            .collect();
        let _ = writeln!(
            o,
            "{:<7} {:<36} {:<4} {:>14} {:>9} {:<9} {}",
            r.region_id,
            r.owner,
            r.pool_id,
            r.offset,
            mib(r.length),
            r.state,
            if holds.is_empty() {
                "-".to_string()
            } else {
                holds.join(",")
            }
        );
    }
    o
}

/// The holds, one a line: which node holds which region, at which epoch.
pub fn holds(holds: &[HoldInfo]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:<7} {:<36} EPOCH", "REGION", "NODE");
    for h in holds {
        let _ = writeln!(o, "{:<7} {:<36} {}", h.region_id, h.node, h.epoch);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(region_id: u64, pool_id: u32, holds: Vec<HoldInfo>) -> RegionInfo {
        RegionInfo {
            region_id,
            owner: "maru-server@h".into(),
            pool_id,
            offset: 2 << 20,
            length: 64 << 20,
            requested: 64 << 20,
            state: "allocated".into(),
            holds,
            token: None,
        }
    }

    #[test]
    fn each_pool_and_region_is_one_line_under_its_header() {
        let pool = PoolInfo {
            pool_id: 0,
            path: "/dev/shm/p".into(),
            uuid: "u-1".into(),
            kind: "file".into(),
            total: 256 << 20,
            free: 128 << 20,
            align: 2 << 20,
            draining: 0,
        };
        let held = vec![HoldInfo {
            region_id: 1,
            node: "mem0".into(),
            epoch: 7,
        }];
        let rs = [
            region(1, 0, held),
            region(2, 0, vec![]),
            region(3, 1, vec![]),
        ];
        // Line `line` of `t`, its cells one space apart.
        let cells = |t: &str, line: usize| -> String {
            let l = t.lines().nth(line).unwrap_or_default();
            l.split_whitespace().collect::<Vec<_>>().join(" ")
        };
        let bare = pools(std::slice::from_ref(&pool), None);
        assert_eq!(bare.lines().count(), 2, "{bare}");
        assert_eq!(
            cells(&bare, 1),
            "0 /dev/shm/p file 256.0 128.0 0.0 2048 u-1",
            "{bare}"
        );
        assert!(!bare.contains("REGIONS"), "{bare}");
        let counted = pools(std::slice::from_ref(&pool), Some(&rs));
        assert_eq!(
            cells(&counted, 0).split(' ').nth(7),
            Some("REGIONS"),
            "{counted}"
        );
        assert_eq!(
            cells(&counted, 1).split(' ').nth(7),
            Some("2"),
            "pool 0 holds 2 of the 3\n{counted}"
        );
        let t = regions(&rs);
        assert_eq!(t.lines().count(), 4, "{t}");
        assert_eq!(
            cells(&t, 1),
            "1 maru-server@h 0 2097152 64.0 allocated mem0@7",
            "{t}"
        );
        assert_eq!(cells(&t, 2).split(' ').nth(6), Some("-"), "no hold\n{t}");
        let t = holds(&rs[0].holds);
        assert_eq!(cells(&t, 0), "REGION NODE EPOCH", "{t}");
        assert_eq!(cells(&t, 1), "1 mem0 7", "{t}");
    }
}
