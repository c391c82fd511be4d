//! Benchmark behind the JSONL reader's choice of decoder: serde_json (one `Value` per line, as
//! `capture/src/input/jsonl.rs` reads) against arrow-json (lines decoded into record batches,
//! token lists as `List<Float64>` so that no fraction is silently truncated, then converted to
//! integers), on 4,000 synthetic samples of 2,048 token ids and a loss mask.
//!
//! ```text
//! cargo run --release -p hslake-capture --example jsonl_decoders
//! ```
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::types::Float64Type;
use arrow_array::Array;
use arrow_schema::{DataType, Field, Schema};

/// Token ids and loss-mask values read, through serde_json.
fn serde_lines(data: &[u8]) -> usize {
    let mut n = 0;
    for line in data.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v: serde_json::Value = serde_json::from_slice(line).expect("valid JSON");
        for field in ["input_ids", "loss_mask"] {
            let ints: Option<Vec<i64>> = v[field]
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_i64()).collect());
            n += ints.expect("integers").len();
        }
    }
    n
}

/// The same, through arrow-json in chunks of 1,024 lines.
fn arrow_lines(data: &[u8]) -> usize {
    let list = |name| {
        let item = Field::new("item", DataType::Float64, true);
        Field::new(name, DataType::List(Arc::new(item)), true)
    };
    let schema = Arc::new(Schema::new(vec![list("input_ids"), list("loss_mask")]));
    let mut decoder = arrow_json::ReaderBuilder::new(schema)
        .with_batch_size(1024)
        .build_decoder()
        .expect("decoder");
    let mut n = 0;
    let mut rest = data;
    loop {
        let used = decoder.decode(rest).expect("valid JSON");
        rest = &rest[used..];
        let Some(batch) = decoder.flush().expect("decodable") else {
            break;
        };
        for column in batch.columns() {
            let lists = column.as_list::<i32>();
            for row in 0..lists.len() {
                let values = lists.value(row);
                let values = values.as_primitive::<Float64Type>();
                let ints: Vec<i64> = values.values().iter().map(|&v| v as i64).collect();
                n += ints.len();
            }
        }
    }
    n
}

fn main() {
    let mut data = Vec::new();
    let mut x = 7u64;
    for i in 0..4000usize {
        let ids: Vec<u64> = (0..2048)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                (x >> 33) % 128_000
            })
            .collect();
        let mask: Vec<u8> = (0..2048).map(|t| u8::from(t > 600)).collect();
        let line = serde_json::json!({"id": i, "input_ids": ids, "loss_mask": mask});
        writeln!(data, "{line}").expect("in memory");
    }
    let mb = data.len() as f64 / 1e6;
    for round in 0..3 {
        let t = Instant::now();
        let a = serde_lines(&data);
        let serde_secs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let b = arrow_lines(&data);
        let arrow_secs = t.elapsed().as_secs_f64();
        assert_eq!(a, b, "both decoders read every value");
        println!(
            "round {round}: {mb:.0} MB, serde_json {:.0} MB/s, arrow-json {:.0} MB/s",
            mb / serde_secs,
            mb / arrow_secs
        );
    }
}
