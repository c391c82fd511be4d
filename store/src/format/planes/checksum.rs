//! The kinds of value checksum, and the shard's declaration of which one its values carry.
/// Parquet key-value (and so Arrow schema) metadata key by which a shard declares that every
/// tensor and scale value in it carries a checksum, and which ([`ValueChecksum::name`]).
pub const CHECKSUM_META_KEY: &str = "hslake.value_checksum";

/// The Content_Checksum_flag of a zstd frame header descriptor (RFC 8878, 3.1.1.1.1).
pub(super) const CHECKSUM_FLAG: u8 = 1 << 2;

/// Bytes of a trailing value checksum.
pub(super) const TRAILER: usize = 4;

/// A kind of value checksum, as a shard declares it under [`CHECKSUM_META_KEY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueChecksum {
    /// Format 2: every zstd frame carries zstd's content checksum (the low 32 bits of XXH64 of
    /// the decompressed plane), which zstd checks while decompressing.
    ZstdXxh64,
    /// Format 3: the value ends with the CRC-32 (ISO-HDLC, as zlib, gzip and PNG compute it) of
    /// all its bytes before it (the header of frame lengths and the frames), a little-endian u32.
    Crc32,
}

impl ValueChecksum {
    /// What hslake writes unless told otherwise.
    pub const DEFAULT: ValueChecksum = ValueChecksum::Crc32;

    /// Every kind, in the order benchmarks report them.
    pub const ALL: [ValueChecksum; 2] = [ValueChecksum::ZstdXxh64, ValueChecksum::Crc32];

    /// The name a shard declares it by.
    pub const fn name(self) -> &'static str {
        match self {
            ValueChecksum::ZstdXxh64 => "zstd_xxh64",
            ValueChecksum::Crc32 => "crc32",
        }
    }

    /// The kind declared as `name`, if this build reads it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// This kind's checksum of `bytes` (what a value's trailer holds over the bytes before
    /// it), or `None` for the kind that lives inside zstd frames.
    pub fn checksum(self, bytes: &[u8]) -> Option<u32> {
        let mut sum = self.running()?;
        sum.update(bytes);
        Some(sum.finalize())
    }

    /// A trailing checksum to compute piece by piece, or `None` (zstd checksums).
    pub(super) fn running(self) -> Option<crc32fast::Hasher> {
        match self {
            ValueChecksum::ZstdXxh64 => None,
            ValueChecksum::Crc32 => Some(crc32fast::Hasher::new()),
        }
    }

    pub(super) fn has_trailer(self) -> bool {
        self != ValueChecksum::ZstdXxh64
    }
}

impl std::fmt::Display for ValueChecksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a reader holds a value's checksum to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checksums {
    /// Whatever the value carries is checked, and it may carry nothing: values of files that do
    /// not declare [`CHECKSUM_META_KEY`] (written without checksums), or values seen apart from
    /// their file (SQL). A value whose frames end exactly [`TRAILER`] bytes before its end has a
    /// [`ValueChecksum::DEFAULT`] trailer; frames with zstd's checksum flag are checked by zstd.
    #[default]
    IfPresent,
    /// Every value must carry this kind of checksum: its file declares it.
    Declared(ValueChecksum),
}

impl Checksums {
    /// The requirement a file's (Arrow schema or Parquet key-value) metadata declares; a
    /// declared kind this build does not know is refused, never read as no checksum.
    pub fn declared_by(
        metadata: &std::collections::HashMap<String, String>,
    ) -> Result<Self, String> {
        match metadata.get(CHECKSUM_META_KEY) {
            None => Ok(Checksums::IfPresent),
            Some(v) => ValueChecksum::from_name(v)
                .map(Checksums::Declared)
                .ok_or_else(|| {
                    let known: Vec<&str> = ValueChecksum::ALL.iter().map(|k| k.name()).collect();
                    format!(
                        "{CHECKSUM_META_KEY} = {v:?} is not a value checksum this build reads \
                         (expected one of {})",
                        known.join(", ")
                    )
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_by_reads_the_metadata_key_and_refuses_unknown_kinds() {
        let mut meta = std::collections::HashMap::new();
        assert_eq!(Checksums::declared_by(&meta), Ok(Checksums::IfPresent));
        for kind in ValueChecksum::ALL {
            meta.insert(CHECKSUM_META_KEY.to_string(), kind.name().to_string());
            assert_eq!(Checksums::declared_by(&meta), Ok(Checksums::Declared(kind)));
        }
        // A flipped byte in the declared kind is not read as "no checksums".
        meta.insert(CHECKSUM_META_KEY.to_string(), "crc33".to_string());
        let err = Checksums::declared_by(&meta).unwrap_err();
        assert!(err.contains("\"crc33\"") && err.contains("crc32"), "{err}");
    }
}
