//! Writing query results as a text table, CSV, JSON lines or Parquet.
use std::io::Write;
use std::str::FromStr;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;

use crate::{QueryError, Result};

/// Output format of query results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// An aligned text table.
    Table,
    /// CSV with a header line.
    Csv,
    /// One JSON object per row (JSON lines).
    Json,
    /// A Parquet file (zstd).
    Parquet,
}

impl FromStr for OutputFormat {
    type Err = QueryError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "table" => Ok(OutputFormat::Table),
            "csv" => Ok(OutputFormat::Csv),
            "json" => Ok(OutputFormat::Json),
            "parquet" => Ok(OutputFormat::Parquet),
            _ => Err(QueryError::Output {
                format: s.into(),
                detail: "unknown format; expected table, csv, json or parquet".into(),
            }),
        }
    }
}

impl OutputFormat {
    fn name(self) -> &'static str {
        match self {
            OutputFormat::Table => "table",
            OutputFormat::Csv => "csv",
            OutputFormat::Json => "json",
            OutputFormat::Parquet => "parquet",
        }
    }
}

/// Write `batches` (all of `schema`) to `out` in `format`.
pub fn write_batches<W: Write + Send>(
    format: OutputFormat,
    schema: SchemaRef,
    batches: &[RecordBatch],
    mut out: W,
) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| QueryError::Output {
        format: format.name().into(),
        detail: e.to_string(),
    };
    match format {
        OutputFormat::Table => {
            let table = if batches.iter().all(|b| b.num_rows() == 0) {
                // Still show the column names of an empty result.
                datafusion::arrow::util::pretty::pretty_format_batches(&[RecordBatch::new_empty(
                    schema,
                )])
            } else {
                datafusion::arrow::util::pretty::pretty_format_batches(batches)
            }
            .map_err(|e| err(&e))?;
            writeln!(out, "{table}").map_err(|e| err(&e))?;
        }
        OutputFormat::Csv => {
            let mut w = datafusion::arrow::csv::WriterBuilder::new()
                .with_header(true)
                .build(&mut out);
            if batches.is_empty() {
                w.write(&RecordBatch::new_empty(schema))
                    .map_err(|e| err(&e))?;
            }
            for b in batches {
                w.write(b).map_err(|e| err(&e))?;
            }
        }
        OutputFormat::Json => {
            let mut w = datafusion::arrow::json::LineDelimitedWriter::new(&mut out);
            for b in batches {
                w.write(b).map_err(|e| err(&e))?;
            }
            w.finish().map_err(|e| err(&e))?;
        }
        OutputFormat::Parquet => {
            let props = parquet::file::properties::WriterProperties::builder()
                .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
                .build();
            let mut w = parquet::arrow::ArrowWriter::try_new(&mut out, schema, Some(props))
                .map_err(|e| err(&e))?;
            for b in batches {
                w.write(b).map_err(|e| err(&e))?;
            }
            w.close().map_err(|e| err(&e))?;
        }
    }
    out.flush().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Int32Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("b", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from(vec![Some(1), None])),
                Arc::new(StringArray::from(vec!["x", "y"])),
            ],
        )
        .unwrap()
    }

    fn render(f: OutputFormat) -> String {
        let b = batch();
        let mut out = Vec::new();
        write_batches(f, b.schema(), &[b], &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn writes_csv_with_header_and_empty_null() {
        assert_eq!(render(OutputFormat::Csv), "a,b\n1,x\n,y\n");
    }

    #[test]
    fn writes_json_lines_omitting_nulls() {
        assert_eq!(
            render(OutputFormat::Json),
            "{\"a\":1,\"b\":\"x\"}\n{\"b\":\"y\"}\n"
        );
    }

    #[test]
    fn rejects_unknown_format_with_the_choices() {
        let e = "xml".parse::<OutputFormat>().unwrap_err().to_string();
        assert!(e.contains("expected table, csv, json or parquet"), "{e}");
    }
}
