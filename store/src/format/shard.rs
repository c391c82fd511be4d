//! How a shard's columns are written to Parquet. The columns themselves are the dataset
//! schema's Arrow form (`DatasetSchema::to_arrow`, docs/FORMAT.md); this sets, per column, the
//! compression and statistics the format specifies.
use arrow_schema::{DataType, Field, Schema};
use hslake_schemas::DatasetSchema;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::{KeyValue, ParquetMetaData};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::format::planes::{ValueChecksum, CHECKSUM_META_KEY};
use crate::format::tokens::TOKEN_CHECKSUM_COLUMN;
use crate::{Result, StoreError};

/// The Arrow schema of a shard of `schema`: the dataset schema's columns
/// (`DatasetSchema::to_arrow`) and, where values carry [`ValueChecksum::DEFAULT`] checksums,
/// last, each row's checksum of its tokens ([`TOKEN_CHECKSUM_COLUMN`]).
pub fn shard_schema(schema: &DatasetSchema, value_checksum: Option<ValueChecksum>) -> Schema {
    let arrow = schema.to_arrow();
    if value_checksum != Some(ValueChecksum::DEFAULT) {
        return arrow;
    }
    let mut fields: Vec<Field> = arrow.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(TOKEN_CHECKSUM_COLUMN, DataType::UInt32, false));
    Schema::new(fields).with_metadata(arrow.metadata().clone())
}

/// Parquet writer properties of a shard of `schema` at zstd `level`; with a `value_checksum`
/// the file declares that every tensor and scale value in it carries one of that kind.
pub fn writer_properties(
    schema: &DatasetSchema,
    level: i32,
    value_checksum: Option<ValueChecksum>,
) -> Result<WriterProperties> {
    let zstd = ZstdLevel::try_new(level)
        .map_err(|e| StoreError::Usage(format!("zstd level {level}: {e}")))?;
    let mut b = WriterProperties::builder()
        .set_compression(Compression::ZSTD(zstd))
        .set_dictionary_enabled(false)
        .set_statistics_enabled(EnabledStatistics::Chunk)
        .set_max_row_group_row_count(None)
        .set_created_by(format!("hslake {}", env!("CARGO_PKG_VERSION")));
    if let Some(kind) = value_checksum {
        // A plain key-value entry, so that any Parquet reader sees it; Arrow readers find it
        // in the schema metadata too.
        b = b.set_key_value_metadata(Some(vec![KeyValue::new(
            CHECKSUM_META_KEY.to_string(),
            kind.name().to_string(),
        )]));
    }
    // Checksums look random: min/max statistics of them are useless.
    b = b.set_column_statistics_enabled(
        ColumnPath::from(TOKEN_CHECKSUM_COLUMN),
        EnabledStatistics::None,
    );
    // Tensor and scale values are opaque byte strings: min/max statistics of them are useless
    // bytes. They arrive compressed (plane_zstd), so Parquet must not compress them again.
    // Each value is its own data page, so that a reader of some rows (the loader's sample
    // shuffle) fetches and parses only those rows' values, found through the offset index.
    for p in &schema.points {
        let scale = schema.dtype.has_scales().then(|| p.scale_column());
        for col in std::iter::once(p.column()).chain(scale) {
            b = b
                .set_column_statistics_enabled(
                    ColumnPath::from(col.clone()),
                    EnabledStatistics::None,
                )
                .set_column_data_page_size_limit(ColumnPath::from(col.clone()), 1)
                .set_column_compression(ColumnPath::from(col), Compression::UNCOMPRESSED);
        }
    }
    Ok(b.build())
}

/// Refuses a footer whose row groups, column chunks or pages do not lie inside the file's
/// `file_len` bytes: a flipped bit there (a negative offset or size) is not an error to the
/// Parquet reader but an assertion deep inside a read, that is a panic.
pub(crate) fn check_footer(
    meta: &ParquetMetaData,
    file_len: u64,
) -> std::result::Result<(), String> {
    let inside = |start: i64, len: i64| {
        start >= 0
            && len >= 0
            && (start as u64)
                .checked_add(len as u64)
                .is_some_and(|end| end <= file_len)
    };
    for (g, rg) in meta.row_groups().iter().enumerate() {
        if rg.num_rows() < 0 {
            return Err(format!("row group {g} has {} rows", rg.num_rows()));
        }
        for col in rg.columns() {
            let start = col
                .dictionary_page_offset()
                .unwrap_or(col.data_page_offset());
            let len = col.compressed_size();
            if !inside(start, len) || !inside(col.data_page_offset(), 0) {
                return Err(format!(
                    "row group {g}, column {}: {len} bytes at offset {start} (data pages at {}) \
                     do not lie inside the file's {file_len} bytes",
                    col.column_path(),
                    col.data_page_offset()
                ));
            }
        }
    }
    for (g, columns) in meta.offset_index().into_iter().flatten().enumerate() {
        for (c, index) in columns.iter().enumerate() {
            for p in index.page_locations() {
                let len = i64::from(p.compressed_page_size);
                if !inside(p.offset, len) || p.first_row_index < 0 {
                    return Err(format!(
                        "row group {g}, column {c}: a page of {len} bytes at offset {} (first \
                         row {}) does not lie inside the file's {file_len} bytes",
                        p.offset, p.first_row_index
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Refuses a footer whose row groups are not those its manifest entry claims (`claimed`: rows
/// of each, in file order). Readers plan their reads by the entry (the loader's units, Ray's
/// read tasks), so the first read of a shard checks the claim against the file: a row group the
/// file lacks, rows it does not hold, or rows it holds beyond the claim are an error naming the
/// file, never rows silently lost or added. `verify` reports the same.
pub fn check_row_groups(
    meta: &ParquetMetaData,
    claimed: &[u64],
) -> std::result::Result<(), String> {
    let found = meta.num_row_groups();
    if found != claimed.len() {
        return Err(format!(
            "the file has {found} row groups, the manifest says {}",
            claimed.len()
        ));
    }
    for (g, (rg, &want)) in meta.row_groups().iter().zip(claimed).enumerate() {
        let rows = rg.num_rows();
        if u64::try_from(rows).ok() != Some(want) {
            return Err(format!(
                "row group {g} holds {rows} rows, the manifest says {want}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use hslake_schemas::{CapturePoint, DType};

    use super::*;

    #[test]
    fn tensor_and_scale_columns_are_stored_uncompressed_without_statistics() {
        let schema = DatasetSchema::new(
            "m",
            "LlamaForCausalLM",
            8,
            4,
            100,
            DType::Fp8E4m3,
            vec![CapturePoint::LayerOutput(2)],
        )
        .unwrap();
        let props = writer_properties(&schema, 3, Some(ValueChecksum::Crc32)).unwrap();
        for col in ["layer_2", "layer_2_scale"] {
            let path = ColumnPath::from(col);
            assert_eq!(props.compression(&path), Compression::UNCOMPRESSED, "{col}");
            assert_eq!(props.statistics_enabled(&path), EnabledStatistics::None);
            assert_eq!(props.column_data_page_size_limit(&path), 1, "{col}");
        }
        let ids = ColumnPath::from("sample_id");
        assert!(matches!(props.compression(&ids), Compression::ZSTD(_)));
        assert_eq!(props.statistics_enabled(&ids), EnabledStatistics::Chunk);
        assert!(writer_properties(&schema, 99, None).is_err());
        let kv = props.key_value_metadata().unwrap();
        assert_eq!(kv[0].key, CHECKSUM_META_KEY);
        assert_eq!(kv[0].value.as_deref(), Some("crc32"));
        let off = writer_properties(&schema, 3, None).unwrap();
        assert!(off.key_value_metadata().is_none());
    }
}
