//! How a shard's columns are written to Parquet. The columns themselves are the dataset
//! schema's Arrow form (`DatasetSchema::to_arrow`, docs/FORMAT.md); this sets, per column, the
//! compression and statistics the format specifies.
use arrow_schema::{DataType, Field, Schema};
use hslake_schemas::DatasetSchema;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::format::decode::TOKEN_CHECKSUM_COLUMN;
use crate::format::planes::{ValueChecksum, CHECKSUM_META_KEY};
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
