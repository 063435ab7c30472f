//! The upgrade of a state directory of record format 1 (the release before checks)
//! into this format, once, at the first start on it.

use super::*;

/// A key record of record format 1: format 2's without the check at its end (and
/// version byte 1).
fn decode_key_format1(id: u64, bytes: &[u8]) -> Result<KeyRecord, RecordError> {
    match bytes.first() {
        Some(1) => {}
        v => {
            return Err(RecordError(format!(
                "key {id}: record version {v:?}, format 1 has version 1"
            )))
        }
    }
    let mut b = Vec::with_capacity(bytes.len() + 8);
    b.push(2);
    b.extend_from_slice(&bytes[1..]);
    b.extend_from_slice(&[0; 8]);
    decode_key(id, &b)
}

/// Writes `rows` (key, encoded record) into `table` as part of the format 1 upgrade.
pub(super) fn insert_all<'k, K: redb::Key + 'static>(
    txn: &redb::WriteTransaction,
    table: TableDefinition<K, &[u8]>,
    p: &Path,
    rows: impl IntoIterator<Item = (K::SelfType<'k>, Vec<u8>)>,
) -> Result<(), Fail> {
    let mut t = txn.open_table(table).map_err(fail(p, "upgrade"))?;
    for (k, v) in rows {
        t.insert(k, v.as_slice()).map_err(fail(p, "upgrade"))?;
    }
    Ok(())
}

/// A directory of record format 1 (the release before checks: records without a
/// check, bare scalars) is sealed into this format once, in one commit: every table
/// read as format 1 wrote it, [`maru::meta::seal_format1`] drops what it cannot
/// vouch for, and the rest is written back sealed (secrets too). Logs what it did.
pub(super) fn upgrade_format1(
    db: &Database,
    p: &Path,
) -> Result<Option<maru::meta::Sealed1>, Fail> {
    let txn = db.begin_write().map_err(fail(p, "begin"))?;
    {
        let meta = txn.open_table(META).map_err(fail(p, "meta"))?;
        let f = get_scalar(&meta, "format").map_err(fail(p, "meta"))?;
        if f.text() != Some("1") {
            return Ok(None);
        }
    }
    let mut img = Image::default();
    let mut undecoded = 0u64;
    let mut bad = |table: &str, id: String, e: String| {
        undecoded += 1;
        log::warn!(
            "upgrade from record format 1: {}: record {id} of table {table} does not decode \
             ({e}): dropped, never served",
            p.display()
        );
    };
    let mut secrets = Vec::new();
    let mut used_ids = Vec::new();
    {
        let t = txn.open_table(SCOPES).map_err(fail(p, "scopes"))?;
        read_records(&t, p, AS_SCOPES, &mut img.scopes, &mut bad, any_scope)?;
        let t = txn.open_table(SESSIONS).map_err(fail(p, "sessions"))?;
        read_records(
            &t,
            p,
            AS_SESSIONS,
            &mut img.sessions,
            &mut bad,
            |id, s| match s.id {
                named if named == id => Ok(()),
                named => Err(format!("it names {named}")),
            },
        )?;
        let t = txn.open_table(REGIONS).map_err(fail(p, "regions"))?;
        read_records(&t, p, AS_REGIONS, &mut img.regions, &mut bad, own_region)?;
        let t = txn.open_table(KEYS).map_err(fail(p, "keys"))?;
        for item in t.iter().map_err(fail(p, "keys"))? {
            let (k, v) = item.map_err(fail(p, "keys"))?;
            match decode_key_format1(k.value(), v.value()) {
                Ok(rec) => img.keys.push(rec),
                Err(e) => bad("keys", k.value().to_string(), e.0),
            }
        }
        let t = txn.open_table(SECRETS).map_err(fail(p, "secrets"))?;
        for item in t.iter().map_err(fail(p, "secrets"))? {
            let (k, v) = item.map_err(fail(p, "secrets"))?;
            match decode_json::<SecretRecord>("secret", v.value()) {
                Ok(s) => secrets.push((k.value().to_string(), s.sealed())),
                Err(e) => bad("secrets", "(a secret's hash)".into(), e.0),
            }
        }
        let t = txn.open_table(USED).map_err(fail(p, "used"))?;
        for item in t.iter().map_err(fail(p, "used"))? {
            used_ids.push(item.map_err(fail(p, "used"))?.0.value());
        }
    }
    let mut done = maru::meta::seal_format1(&mut img);
    done.dropped += undecoded;
    let kept: std::collections::BTreeSet<u64> = img.keys.iter().map(|k| k.id).collect();
    {
        for name in ["keys", "regions", "sessions"] {
            let def: TableDefinition<u64, &[u8]> = TableDefinition::new(name);
            txn.delete_table(def).map_err(fail(p, "upgrade"))?;
        }
        txn.delete_table(SCOPES).map_err(fail(p, "upgrade"))?;
        txn.delete_table(SECRETS).map_err(fail(p, "upgrade"))?;
        let scopes = img.scopes.iter().map(|s| (s.id, encode_json(s)));
        insert_all(&txn, SCOPES, p, scopes)?;
        let sessions = img.sessions.iter().map(|s| (s.id, encode_json(s)));
        insert_all(&txn, SESSIONS, p, sessions)?;
        let regions = img.regions.iter();
        insert_all(
            &txn,
            REGIONS,
            p,
            regions.map(|g| (g.handle.region_id, encode_json(g))),
        )?;
        insert_all(
            &txn,
            KEYS,
            p,
            img.keys.iter().map(|k| (k.id, encode_key(k))),
        )?;
        let secrets = secrets.iter().map(|(h, s)| (h.as_str(), encode_json(s)));
        insert_all(&txn, SECRETS, p, secrets)?;
        let mut t = txn.open_table(USED).map_err(fail(p, "upgrade"))?;
        for id in used_ids.iter().filter(|id| !kept.contains(id)) {
            t.remove(*id).map_err(fail(p, "upgrade"))?;
        }
        let mut meta = txn.open_table(META).map_err(fail(p, "upgrade"))?;
        put_scalar(&mut meta, "format", &FORMAT.to_string()).map_err(fail(p, "upgrade"))?;
    }
    txn.commit().map_err(fail(p, "commit"))?;
    log::warn!(
        "{}: upgraded from record format 1 to format {FORMAT}: {} records sealed ({} keys, {} \
         regions, {} sessions, {} scopes, {} secrets), {} dropped (see above; their keys are \
         misses)",
        p.display(),
        done.kept + secrets.len() as u64,
        img.keys.len(),
        img.regions.len(),
        img.sessions.len(),
        img.scopes.len(),
        secrets.len(),
        done.dropped
    );
    Ok(Some(done))
}
