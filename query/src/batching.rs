//! How many rows a query's batches hold: DataFusion's fixed row count (8192) unless the rows
//! are wide, then as many as fit in a byte target.
//!
//! Every operator buffers whole batches, outside the query's memory pool: the Parquet scan's
//! output, a cross join's output (one left row repeated beside a right batch), the batches
//! that repartitioning and filters coalesce back up to the row count, each function's result.
//! At 8192 rows a batch of tensors of 160 tokens × 512 bf16 is 1.3 GB, and a cross join of a
//! 37 MB dataset with itself held 3.7 GB resident in one query against a 1.5 GB pool. With the
//! row count derived from the widest row the plan can carry, every one of those batches stays
//! near the target, whatever operator made it. The row count never changes a result: only how
//! the same rows are cut into batches.
use datafusion::arrow::datatypes::{DataType, Field};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::Result;
use datafusion::datasource::source_as_provider;
use datafusion::logical_expr::LogicalPlan;
use hslake_schemas::{TensorFieldMeta, TENSOR_META_KEY};

use crate::table::ShardTable;
use crate::tensor::TensorKind;

/// Bytes of rows one batch aims to hold, by default: a few tens of MB, so the handful of
/// batches each operator of a running query buffers stays small beside its memory pool.
pub const BATCH_BYTES: usize = 32 << 20;

/// Rows per batch for rows of `row_bytes`: as many as fit in `target` bytes, at least one and
/// at most `rows` (DataFusion's configured batch size).
pub fn batch_rows(row_bytes: u64, target: usize, rows: usize) -> usize {
    let fit = (target as u64).checked_div(row_bytes).unwrap_or(u64::MAX);
    usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .clamp(1, rows.max(1))
}

/// The widest row `plan` can carry, estimated in bytes: the sum of the rows of every scan of
/// the `samples` table in it (a join's output row holds a row of each side; a union's rows are
/// narrower than the sum, so it is an upper bound there). A scan's row is its projected
/// columns at the table's widest shard's average tokens per row (see
/// [`ShardTable::tokens_per_row`]). Values functions build are not counted: the per-value cap
/// and the pool bound those.
pub fn widest_row(plan: &LogicalPlan) -> Result<u64> {
    let mut bytes = 0u64;
    plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            let table = source_as_provider(&scan.source).ok();
            if let Some(t) = table
                .as_deref()
                .and_then(|p| p.downcast_ref::<ShardTable>())
            {
                let fields = scan.projected_schema.fields();
                bytes = bytes.saturating_add(row_bytes(
                    fields.iter().map(|f| f.as_ref()),
                    t.tokens_per_row(),
                ));
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    Ok(bytes)
}

/// Bytes of one row of `fields` holding `tokens` tokens: fixed-width columns at their width,
/// token lists and tensors at their bytes per token (a tensor's raw size; stored values are
/// compressed, so usually smaller).
fn row_bytes<'a>(fields: impl Iterator<Item = &'a Field>, tokens: u64) -> u64 {
    fields
        .map(|f| match token_bytes(f) {
            Some(per_token) => tokens.saturating_mul(per_token),
            None => f.data_type().primitive_width().unwrap_or(8) as u64,
        })
        .fold(0, u64::saturating_add)
}

/// Bytes one token adds to a value of `field`, if its values grow with the token count: a
/// tensor's or scale column's row of elements, a token list's element.
fn token_bytes(field: &Field) -> Option<u64> {
    match field.data_type() {
        DataType::LargeBinary => {
            let meta: TensorFieldMeta =
                serde_json::from_str(field.metadata().get(TENSOR_META_KEY)?).ok()?;
            let kind = TensorKind::from_meta(&meta).ok()?;
            Some((kind.hidden * kind.dtype.size()) as u64)
        }
        DataType::List(item) | DataType::LargeList(item) => {
            Some(item.data_type().primitive_width().unwrap_or(8) as u64)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use hslake_schemas::DType;

    use super::*;
    use crate::{testdata, QuerySession};

    #[test]
    fn rows_fill_the_target_within_one_and_the_configured_count() {
        assert_eq!(batch_rows(0, 32 << 20, 8192), 8192);
        assert_eq!(batch_rows(100, 32 << 20, 8192), 8192);
        assert_eq!(batch_rows(1 << 20, 32 << 20, 8192), 32);
        assert_eq!(batch_rows(3 << 20, 32 << 20, 8192), 10);
        assert_eq!(batch_rows(64 << 20, 32 << 20, 8192), 1);
        assert_eq!(batch_rows(u64::MAX, 1, 0), 1);
    }

    async fn widest(session: &QuerySession, sql: &str) -> u64 {
        let plan = session
            .sql(sql)
            .await
            .unwrap()
            .into_optimized_plan()
            .unwrap();
        widest_row(&plan).unwrap()
    }

    #[tokio::test]
    async fn a_rows_width_counts_the_projected_tensors_of_every_scan() {
        // Samples of 3 to 6 tokens; f32 tensors of HIDDEN channels: 16 bytes a token.
        testdata::write("memory://batching-widest", DType::F32, 8, 2).await;
        let session = QuerySession::open("memory://batching-widest", None)
            .await
            .unwrap();
        let tokens = {
            let m = &session.datasets()[0].manifest;
            m.shards
                .iter()
                .map(|s| s.tokens.div_ceil(s.rows))
                .max()
                .unwrap()
        };
        let tensor = tokens * (testdata::HIDDEN * 4) as u64;
        assert_eq!(
            widest(&session, "SELECT count(*), max(seq_len) FROM samples").await,
            4,
            "seq_len only"
        );
        let one = widest(&session, "SELECT layer_2 FROM samples").await;
        assert_eq!(one, tensor, "layer_2 only");
        let norm = widest(&session, "SELECT tensor_norm(layer_2) FROM samples").await;
        assert_eq!(
            norm,
            tensor + 4 + 8,
            "the function also reads seq_len and sample_id"
        );
        let both = widest(&session, "SELECT layer_2, layer_30 FROM samples").await;
        assert_eq!(both, 2 * tensor);
        let joined = widest(
            &session,
            "SELECT a.layer_2, b.layer_2 FROM samples a, samples b",
        )
        .await;
        assert_eq!(
            joined,
            2 * tensor,
            "a cross join's row holds one of each side"
        );
        let ids = widest(&session, "SELECT input_ids FROM samples").await;
        assert_eq!(ids, tokens * 4);
    }

    /// Bytes of the binary values in `b` (the tensors it carries).
    fn value_bytes(b: &RecordBatch) -> usize {
        b.columns()
            .iter()
            .filter_map(|c| c.as_binary_opt::<i64>())
            .map(|c| c.value_data().len())
            .sum()
    }

    #[tokio::test]
    async fn wide_rows_come_in_batches_near_the_byte_target_with_the_same_result() {
        testdata::write("memory://batching-cross", DType::F32, 40, 2).await;
        let mut session = QuerySession::open("memory://batching-cross", None)
            .await
            .unwrap();
        // The sort emits what it collected in batches of the configured row count, like the
        // coalescing after a cross join that held gigabytes in one query.
        let sql = "SELECT a.sample_id AS a, b.sample_id AS b, a.layer_2 AS x, \
                   b.layer_30 AS y FROM samples a, samples b ORDER BY a, b";
        let whole = session.query(sql).await.unwrap();
        const TARGET: usize = 4 << 10;
        // Stored values carry a header and a checksum beside their raw bytes, and rows are
        // sized at their shard's average: a batch may pass the target by that much.
        let bound = 2 * TARGET;
        assert!(
            whole.iter().any(|b| value_bytes(b) > bound),
            "the default target cuts nothing here, so the bound below is a real check"
        );
        session.set_batch_bytes(TARGET);
        let cut = session.query(sql).await.unwrap();
        for b in &cut {
            assert!(
                value_bytes(b) <= bound,
                "a batch of {} rows holds {} bytes of tensors",
                b.num_rows(),
                value_bytes(b)
            );
        }
        assert_eq!(cut.iter().map(|b| b.num_rows()).sum::<usize>(), 1600);
        assert!(cut.len() > whole.len());
        assert_eq!(
            pretty_format_batches(&whole).unwrap().to_string(),
            pretty_format_batches(&cut).unwrap().to_string()
        );
    }
}
