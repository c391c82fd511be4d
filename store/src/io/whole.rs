//! Whole-file reads of shards and the check of their size and checksum against the entry that
//! names them: what `cp` checks on both sides, and what settles an upload of unknown outcome.
use bytes::Bytes;
use object_store::ObjectStoreExt;

use crate::io::location::Location;
use crate::table::manifest::ShardEntry;
use crate::{Result, StoreError};

/// The whole of the dataset-relative file `rel` at `loc`.
pub async fn read_whole(loc: &Location, rel: &str) -> Result<Bytes> {
    let shown = format!("{}/{rel}", loc.url);
    loc.store
        .get(&loc.path(rel))
        .await
        .map_err(|e| StoreError::os(&shown, e))?
        .bytes()
        .await
        .map_err(|e| StoreError::os(&shown, e))
}

/// The size and CRC-32C of `bytes` (the file `shown`) against its entry `s`.
pub fn check(shown: &str, s: &ShardEntry, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 != s.bytes {
        return Err(StoreError::corrupt(
            shown,
            format!("{} bytes, the manifest says {}", bytes.len(), s.bytes),
        ));
    }
    let crc = crc32c::crc32c(bytes);
    if crc != s.crc32c {
        return Err(StoreError::corrupt(
            shown,
            format!(
                "checksum mismatch: crc32c {crc:08x}, the manifest says {:08x}",
                s.crc32c
            ),
        ));
    }
    Ok(())
}
