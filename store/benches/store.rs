//! `cargo bench -p hslake-store`: the shard-format benchmark in a release build, on synthetic
//! activations, on a dataset named by HSLAKE_BENCH_FROM, or on the `.npy` directory named by
//! HSLAKE_BENCH_NPY (real activations from `benchmarks/cpu/real_activations.py`).
//! Knobs: HSLAKE_BENCH_SAMPLES, HSLAKE_BENCH_HIDDEN, HSLAKE_BENCH_SEQ (MIN:MAX), HSLAKE_BENCH_LEVEL,
//! HSLAKE_BENCH_ROW_GROUP_MB.
use futures::TryStreamExt;
use hslake_schemas::{CapturePoint, DType, DatasetSchema, Sample};
use hslake_store::tools::bench::{bench_layouts, bench_store};
use hslake_store::tools::synth::SynthModel;
use hslake_store::{Dataset, DatasetReader};

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

async fn samples() -> (DatasetSchema, Vec<Sample>) {
    let n: usize = env("HSLAKE_BENCH_SAMPLES", 200);
    if let Ok(dir) = std::env::var("HSLAKE_BENCH_NPY") {
        return hslake_store::tools::bench::samples_from_npy(dir.as_ref(), n).expect("npy samples");
    }
    if let Ok(url) = std::env::var("HSLAKE_BENCH_FROM") {
        let r = DatasetReader::open(&Dataset::open(&url).await.expect("open"), None)
            .await
            .expect("reader");
        let mut out = vec![];
        let mut scan = r.scan(None);
        while let Some(b) = scan.try_next().await.expect("scan") {
            out.extend(
                hslake_store::format::codec::decode_samples(r.schema(), &b).expect("decode"),
            );
        }
        out.truncate(n);
        return (r.schema().clone(), out);
    }
    let h: usize = env("HSLAKE_BENCH_HIDDEN", 1024);
    let seq: String = env("HSLAKE_BENCH_SEQ", "256:1024".to_string());
    let (lo, hi) = seq
        .split_once(':')
        .map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap()))
        .unwrap();
    let points = [2, 16, 29, 31].map(CapturePoint::LayerOutput).to_vec();
    let schema =
        DatasetSchema::new("synthetic", "Synthetic", h, 32, 32000, DType::Bf16, points).unwrap();
    let gen = SynthModel::new(schema.clone(), (lo, hi), 0);
    (
        schema.clone(),
        (0..n as u64).map(|i| gen.sample(i)).collect(),
    )
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let level: i32 = env("HSLAKE_BENCH_LEVEL", 1);
    let (schema, samples) = rt.block_on(samples());
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/bench", dir.path().display());
    let opts = hslake_store::WriterOptions {
        zstd_level: level,
        row_group_target_bytes: env("HSLAKE_BENCH_ROW_GROUP_MB", 8u64) << 20,
        ..Default::default()
    };
    let st = rt
        .block_on(bench_store(&url, schema.clone(), &samples, opts))
        .unwrap();
    let layouts = bench_layouts(&schema, &samples, level).unwrap();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({"store": st, "layouts": layouts}))
            .unwrap()
    );
}
