//! `cargo bench -p hslake-store --bench commit_check`: what the commit's duplicate-id and
//! shard-presence checks cost as a dataset grows to thousands of shards.
//!
//! Every commit adds one shard whose ids are spread over the whole id space (shard k holds
//! k, k+S, k+2S, k+3S), so every head shard's id range overlaps it: the worst case for the
//! range filter. Phase 1 (in this process, ids cached as a long capture has them) times
//! commits as the head grows; phase 2 times one commit in a fresh process, which must read the
//! ids of every shard once. Knobs: HSLAKE_BENCH_SHARDS (default 3000), HSLAKE_BENCH_DIR (keep
//! the dataset there; a second run with the same dir measures phase 2 only).
use std::time::Instant;

use hslake_schemas::{CapturePoint, DType, DatasetSchema};
use hslake_store::tools::synth::SynthModel;
use hslake_store::{Dataset, DatasetWriter, Provenance, WriterOptions};

const PER_SHARD: u64 = 4;

/// Milliseconds the commit took, and whether it landed.
async fn commit_shard(
    ds: &Dataset,
    gen: &SynthModel,
    ids: impl Iterator<Item = u64>,
) -> (f64, bool) {
    let mut w = DatasetWriter::new(ds, WriterOptions::default())
        .await
        .unwrap();
    for id in ids {
        w.append(&gen.sample(id)).await.unwrap();
    }
    let t = Instant::now();
    let landed = w.commit().await.is_ok();
    (t.elapsed().as_secs_f64() * 1e3, landed)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let shards: u64 = std::env::var("HSLAKE_BENCH_SHARDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let tmp = tempfile::tempdir().unwrap();
    let dir = std::env::var("HSLAKE_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| tmp.path().join("ds"));
    let url = format!("file://{}", dir.display());
    let schema = DatasetSchema::new(
        "bench",
        "LlamaForCausalLM",
        16,
        4,
        1000,
        DType::Bf16,
        vec![CapturePoint::LayerOutput(1)],
    )
    .unwrap();
    let gen = SynthModel::new(schema.clone(), (2, 4), 0);
    rt.block_on(async {
        let ds = match Dataset::open(&url).await {
            Ok(ds) => ds,
            Err(_) => {
                let ds = Dataset::create(&url, schema.clone(), Provenance::default())
                    .await
                    .unwrap();
                let mut window = vec![];
                for k in 0..shards {
                    let (ms, landed) =
                        commit_shard(&ds, &gen, (0..PER_SHARD).map(|j| k + j * shards)).await;
                    assert!(landed, "commit {k}");
                    window.push(ms);
                    if (k + 1) % 500 == 0 || k + 1 == shards {
                        let mean = window.iter().sum::<f64>() / window.len() as f64;
                        println!(
                            "phase 1: head of {:>5} shards: commit {mean:.2} ms (mean of the last {})",
                            k + 1,
                            window.len()
                        );
                        window.clear();
                    }
                }
                println!("phase 2: run again with HSLAKE_BENCH_DIR={} for a fresh process", dir.display());
                return;
            }
        };
        let n = ds.manifest(None).await.unwrap().shards.len() as u64;
        let held = PER_SHARD * n;
        let t = Instant::now();
        let m = ds.manifest(None).await.unwrap();
        let json = m.to_json();
        println!(
            "phase 2 (fresh process, {n} shards): reading and writing the head manifest alone ({} KB): {:.1} ms",
            json.len() >> 10,
            t.elapsed().as_secs_f64() * 1e3
        );
        let (ms, landed) = commit_shard(&ds, &gen, [held + 1, held + 2].into_iter()).await;
        println!("phase 2 (fresh process, {n} shards): commit outside every range: {ms:.1} ms (landed: {landed})");
        // Its range [n/2, held + 10] meets every shard's: the ids of all are read, once.
        let (ms, landed) = commit_shard(&ds, &gen, [n / 2, held + 10].into_iter()).await;
        println!("phase 2 (fresh process, {n} shards): commit overlapping every range: {ms:.1} ms (landed: {landed}, refused: id {} is held)", n / 2);
        let (ms, landed) = commit_shard(&ds, &gen, [n / 2 + 1, held + 11].into_iter()).await;
        println!("phase 2 (same process, ids now cached): the same again: {ms:.1} ms (landed: {landed})");
    });
}
