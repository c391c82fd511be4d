//! Commits, shard uploads and copies through the fault-injecting proxy (tests/fault_proxy) in
//! front of the S3 test server: a response lost after the store applied a write must neither
//! fail the operation nor apply it twice, and random 503s and resets must leave every sample
//! exactly once. Skipped without `HSLAKE_TEST_S3_ENDPOINT` (scripts/test.sh starts moto).
//!
//! One proxy serves the whole test binary (the S3 client takes its endpoint from
//! `AWS_ENDPOINT`, a process-wide setting), so the tests take turns.
use std::collections::BTreeSet;
use std::sync::OnceLock;

use tokio::sync::{Mutex, MutexGuard};

use hslake_fault_proxy::{Fault, FaultProxy, Rule, RuleSet};
use hslake_schemas::{CapturePoint, DType, DatasetSchema};
use hslake_store::tools::s3_bucket::create_bucket;
use hslake_store::tools::synth::{write_dataset, SynthModel, SynthSpec};
use hslake_store::{
    copy_dataset, verify, Dataset, DatasetReader, DatasetWriter, Provenance, StoreError,
    WriterOptions,
};

struct Proxy {
    proxy: FaultProxy,
    /// The S3 test server behind the proxy.
    upstream: String,
}

/// The proxy, the turn of the calling test and a bucket of its own; `None` when no S3 test
/// server is configured.
async fn setup() -> Option<(&'static Proxy, MutexGuard<'static, ()>, String)> {
    static PROXY: OnceLock<Option<Proxy>> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::const_new(());
    let proxy = PROXY.get_or_init(|| {
        let Ok(upstream) = std::env::var("HSLAKE_TEST_S3_ENDPOINT") else {
            eprintln!(
                "skipped: HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts an S3 server)"
            );
            return None;
        };
        let proxy = FaultProxy::start(&upstream).expect("fault proxy starts");
        std::env::set_var("AWS_ENDPOINT", proxy.endpoint());
        std::env::set_var("AWS_ALLOW_HTTP", "true");
        // Quick retries, so each test stays within seconds.
        std::env::set_var("HSLAKE_S3_RETRY_TIMEOUT", "5");
        Some(Proxy { proxy, upstream })
    });
    let proxy = proxy.as_ref()?;
    let turn = TURN.lock().await;
    proxy.proxy.clear_rules();
    proxy.proxy.reset_counters();
    // Made on the server itself, not through the proxy's rules.
    let bucket = create_bucket(&proxy.upstream, "hslake-faults").expect("test bucket");
    Some((proxy, turn, bucket))
}

fn fresh_url(bucket: &str) -> String {
    format!("s3://{bucket}/{}", uuid::Uuid::new_v4().simple())
}

fn schema() -> DatasetSchema {
    DatasetSchema::new(
        "test-model",
        "LlamaForCausalLM",
        16,
        61,
        1000,
        DType::Bf16,
        vec![CapturePoint::LayerOutput(2)],
    )
    .unwrap()
}

fn small_opts() -> WriterOptions {
    WriterOptions {
        row_group_target_bytes: 1 << 10,
        shard_target_bytes: 3 << 10,
        ..Default::default()
    }
}

/// Install `rules`; their random draws are seeded by `HSLAKE_FAULT_SEED` (default 7).
fn rules(p: &Proxy, rules: Vec<Rule>) {
    let seed = std::env::var("HSLAKE_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    p.proxy.set_rules(&RuleSet::new(rules).seed(seed)).unwrap();
}

/// 503s and resets (before and after the store applied the request) on 3 % of requests each.
fn random_faults() -> Fault {
    Fault::Random {
        p: 0.03,
        of: vec![Fault::slow_down(), Fault::ResetBefore, Fault::ResetAfter],
    }
}

/// Write `ids` and commit once.
async fn write(ds: &Dataset, ids: impl Iterator<Item = u64>) -> Result<Option<u64>, StoreError> {
    let gen = SynthModel::new(schema(), (3, 12), 5);
    let mut w = DatasetWriter::new(ds, small_opts()).await?;
    for id in ids {
        w.append(&gen.sample(id)).await?;
    }
    w.commit().await
}

/// Every sample id of the newest version, sorted, with repeats kept.
async fn ids(ds: &Dataset) -> Vec<u64> {
    let mut ids = DatasetReader::open(ds, None)
        .await
        .unwrap()
        .sample_ids()
        .await
        .unwrap();
    ids.sort_unstable();
    ids
}

#[tokio::test]
async fn a_commit_whose_response_is_lost_reports_success_and_commits_once() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let url = fresh_url(&bucket);
    let ds = Dataset::create(&url, schema(), Provenance::default())
        .await
        .unwrap();
    // The commit's manifest put lands, and the writer hears a reset.
    rules(
        p,
        vec![Rule::new(Fault::ResetAfter)
            .method("PUT")
            .key(r"_hslake/versions/.*\.json")
            .header("If-None-Match")
            .nth(1, 1)],
    );
    assert_eq!(write(&ds, 0..10).await.unwrap(), Some(1));
    assert_eq!(p.proxy.counters().class("reset_after"), 1);
    p.proxy.clear_rules();
    assert_eq!(ds.versions().await.unwrap(), vec![0, 1]);
    assert_eq!(ids(&ds).await, (0..10).collect::<Vec<_>>());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

#[tokio::test]
async fn a_create_whose_response_is_lost_is_recognised() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let url = fresh_url(&bucket);
    rules(
        p,
        vec![Rule::new(Fault::ResetAfter)
            .method("PUT")
            .header("If-None-Match")
            .nth(1, 1)],
    );
    let ds = Dataset::create(&url, schema(), Provenance::default())
        .await
        .unwrap();
    assert_eq!(p.proxy.counters().class("reset_after"), 1);
    assert_eq!(ds.versions().await.unwrap(), vec![0]);
}

#[tokio::test]
async fn a_shard_upload_whose_response_is_lost_is_committed_once() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let url = fresh_url(&bucket);
    let ds = Dataset::create(&url, schema(), Provenance::default())
        .await
        .unwrap();
    rules(
        p,
        vec![Rule::new(Fault::ResetAfter)
            .method("PUT")
            .key(r"/data/[^/]+\.parquet")
            .nth(1, 1)],
    );
    assert_eq!(write(&ds, 0..10).await.unwrap(), Some(1));
    assert_eq!(p.proxy.counters().class("reset_after"), 1);
    p.proxy.clear_rules();
    assert_eq!(ids(&ds).await, (0..10).collect::<Vec<_>>());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

#[tokio::test]
async fn a_copy_whose_puts_lose_their_responses_completes() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let src = Dataset::create(
        &format!("memory://faults-{}", uuid::Uuid::new_v4().simple()),
        schema(),
        Provenance::default(),
    )
    .await
    .unwrap();
    write(&src, 0..10).await.unwrap();
    write(&src, 10..20).await.unwrap();
    rules(
        p,
        vec![
            Rule::new(Fault::ResetAfter)
                .name("manifest")
                .method("PUT")
                .header("If-None-Match")
                .nth(2, 2),
            Rule::new(Fault::ResetAfter)
                .name("shard")
                .method("PUT")
                .key(r"/data/")
                .nth(1, 1),
        ],
    );
    let dst = fresh_url(&bucket);
    let rep = copy_dataset(&src, &dst, |_| {}).await.unwrap();
    assert_eq!(rep.versions, 3);
    assert_eq!(p.proxy.counters().class("reset_after"), 2);
    p.proxy.clear_rules();
    let back = Dataset::open(&dst).await.unwrap();
    assert_eq!(back.versions().await.unwrap(), vec![0, 1, 2]);
    assert_eq!(ids(&back).await, (0..20).collect::<Vec<_>>());
    assert!(verify(&back, None, |_| {}).await.unwrap().is_clean());
}

/// A writer that, like a capture with `--resume`, retries until each of its ids is committed:
/// after a failure it re-reads what is committed and writes only the rest.
async fn write_until_committed(ds: Dataset, mine: Vec<u64>) -> u32 {
    let mut failures = 0;
    for _ in 0..20 {
        let done: BTreeSet<u64> = match DatasetReader::open(&ds, None).await {
            Ok(r) => match r.sample_ids().await {
                Ok(ids) => ids.into_iter().collect(),
                Err(_) => {
                    failures += 1;
                    continue;
                }
            },
            Err(_) => {
                failures += 1;
                continue;
            }
        };
        let rest: Vec<u64> = mine.iter().copied().filter(|i| !done.contains(i)).collect();
        if rest.is_empty() {
            return failures;
        }
        if write(&ds, rest.into_iter()).await.is_err() {
            failures += 1;
        }
    }
    panic!("writer gave up after 20 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_writers_under_random_503s_and_resets_hold_every_sample_once() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let url = fresh_url(&bucket);
    let ds = Dataset::create(&url, schema(), Provenance::default())
        .await
        .unwrap();
    rules(
        p,
        vec![Rule::new(Fault::Random {
            p: 0.03,
            of: vec![Fault::slow_down(), Fault::ResetBefore, Fault::ResetAfter],
        })],
    );
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let ds = ds.clone();
            // Interleaved ids, so every commit's range overlaps the others'.
            let mine: Vec<u64> = (0..60).filter(|i| i % 4 == w).collect();
            tokio::spawn(write_until_committed(ds, mine))
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let faults = p.proxy.counters().total_faults();
    p.proxy.clear_rules();
    assert!(faults > 0, "some faults were injected");
    assert_eq!(ids(&ds).await, (0..60).collect::<Vec<_>>());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synth_under_random_503s_and_resets_completes_with_every_sample_once() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    rules(p, vec![Rule::new(random_faults())]);
    let url = fresh_url(&bucket);
    let spec = SynthSpec {
        samples: 40,
        seq_len: (3, 12),
        hidden: 16,
        layers: vec![2],
        final_norm: false,
        num_layers: None,
        vocab_size: 1000,
        dtype: DType::Bf16,
        seed: 3,
        first_id: 0,
        writer: small_opts(),
        commit_every: 5,
    };
    let ds = write_dataset(&url, &spec, || {}).await.unwrap().dataset;
    let faults = p.proxy.counters().total_faults();
    p.proxy.clear_rules();
    assert!(faults > 0, "some faults were injected");
    assert_eq!(ids(&ds).await, (0..40).collect::<Vec<_>>());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

#[tokio::test]
async fn a_versions_listing_cut_short_is_retried() {
    let Some((p, _turn, bucket)) = setup().await else {
        return;
    };
    let url = fresh_url(&bucket);
    let ds = Dataset::create(&url, schema(), Provenance::default())
        .await
        .unwrap();
    // object_store retries a failed listing request, but not a body that ends early.
    rules(
        p,
        vec![Rule::new(Fault::Truncate { bytes: Some(40) })
            .method("GET")
            .key("list-type")
            .nth(1, 2)],
    );
    assert_eq!(ds.versions().await.unwrap(), vec![0]);
    assert_eq!(p.proxy.counters().class("truncate"), 2);
}
