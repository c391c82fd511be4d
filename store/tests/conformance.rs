//! One suite, every backend: each behaviour runs against memory://, a local directory and,
//! when `HSLAKE_TEST_S3_ENDPOINT` is set (scripts/test.sh starts moto_server, then SeaweedFS),
//! real S3.
use std::collections::BTreeMap;
use std::time::Duration;

use hslake_schemas::{CapturePoint, DType, DatasetSchema, FinitePolicy, Sample, TensorData};
use hslake_store::tools::s3_bucket::create_bucket;
use hslake_store::tools::synth::{write_dataset, SynthModel, SynthSpec};
use hslake_store::{
    copy_dataset, repair, vacuum, verify, Appended, Dataset, DatasetReader, DatasetWriter, Marked,
    Provenance, RepairOptions, RepeatedShard, StoreError, VacuumOptions, VacuumPlan, WriterOptions,
    MIN_GRACE,
};
use object_store::{ObjectStoreExt, PutPayload};

/// A fresh, empty dataset URL on one backend.
#[derive(Clone, Copy, Debug)]
enum Backend {
    Memory,
    Local,
    S3,
}

fn unique() -> String {
    format!("{}-{}", std::process::id(), uuid::Uuid::new_v4().simple())
}

fn fresh_url(b: Backend) -> Option<String> {
    match b {
        Backend::Memory => Some(format!("memory://{}", unique())),
        Backend::Local => {
            let dir = std::env::temp_dir()
                .join("hslake-conformance")
                .join(unique());
            Some(format!("file://{}", dir.display()))
        }
        Backend::S3 => {
            let Ok(endpoint) = std::env::var("HSLAKE_TEST_S3_ENDPOINT") else {
                eprintln!("skipped: HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts an S3 server)");
                return None;
            };
            // A bucket per dataset: tests run at once, and never create one bucket together.
            let bucket = create_bucket(&endpoint, "hslake-conformance").expect("test bucket");
            Some(format!("s3://{bucket}/{}", unique()))
        }
    }
}

fn schema(dtype: DType, hidden: usize, points: &[u32]) -> DatasetSchema {
    DatasetSchema::new(
        "test-model",
        "LlamaForCausalLM",
        hidden,
        61,
        1000,
        dtype,
        points
            .iter()
            .map(|&i| CapturePoint::LayerOutput(i))
            .collect(),
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

/// Vacuum options with any grace: a test runs no writer it does not control.
fn sweep(grace: Duration, dry_run: bool) -> VacuumOptions {
    VacuumOptions {
        grace,
        no_writers: true,
        dry_run,
    }
}

async fn write_synth(
    ds: &Dataset,
    ids: std::ops::Range<u64>,
    seed: u64,
    commit_every: u64,
) -> Vec<Sample> {
    let m = ds.manifest(None).await.unwrap();
    let gen = SynthModel::new(m.schema, (3, 12), seed);
    let mut w = DatasetWriter::new(ds, small_opts()).await.unwrap();
    let mut out = vec![];
    for id in ids {
        let s = gen.sample(id);
        assert_eq!(w.append(&s).await.unwrap(), Appended::Written);
        out.push(s);
        if (id + 1) % commit_every == 0 {
            w.commit().await.unwrap();
        }
    }
    w.commit().await.unwrap();
    out
}

async fn round_trip_is_bit_exact_for_every_dtype(b: Backend) {
    for dtype in DType::ALL {
        let Some(url) = fresh_url(b) else { return };
        let ds = Dataset::create(&url, schema(dtype, 16, &[2, 30]), Provenance::default())
            .await
            .unwrap();
        let written = write_synth(&ds, 0..25, 7, 10).await;
        let r = DatasetReader::open(&ds, None).await.unwrap();
        assert_eq!(r.manifest().num_samples(), 25);
        for s in &written {
            let back = r.get_sample(s.sample_id).await.unwrap();
            assert_eq!(&back, s, "{dtype} sample {}", s.sample_id);
        }
        if dtype == DType::Fp8E4m3 {
            assert!(written[0].tensors[0]
                .scales
                .as_ref()
                .unwrap()
                .iter()
                .all(|s| *s > 0.0));
        }
    }
}

async fn nan_bits_survive_under_record_policy(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 4, &[1]), Provenance::default())
        .await
        .unwrap();
    let opts = WriterOptions {
        finite_policy: FinitePolicy::Record,
        ..small_opts()
    };
    let mut w = DatasetWriter::new(&ds, opts).await.unwrap();
    let bits = [
        0x7fc1u16, 0xff80, 0x3f80, 0x0001, 0x8000, 0x7f80, 0x4049, 0xc2f7,
    ];
    let s = Sample {
        sample_id: 3,
        input_ids: vec![1, 2],
        loss_mask: vec![1, 1],
        tensors: vec![TensorData::from_bf16_bits(&bits, vec![2, 4])],
    };
    w.append(&s).await.unwrap();
    w.commit().await.unwrap();
    let r = DatasetReader::open(&ds, None).await.unwrap();
    assert_eq!(r.get_sample(3).await.unwrap(), s);
}

async fn rejects_tp_shard_shape_and_commits_nothing(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    // The seed deployment's failure: [512] where [512, 7168] was due.
    let ds = Dataset::create(
        &url,
        schema(DType::Bf16, 7168, &[2, 30]),
        Provenance::default(),
    )
    .await
    .unwrap();
    let mut w = DatasetWriter::new(&ds, WriterOptions::default())
        .await
        .unwrap();
    let s = Sample {
        sample_id: 0,
        input_ids: vec![1; 512],
        loss_mask: vec![1; 512],
        tensors: vec![
            TensorData::zeros(DType::Bf16, vec![512, 7168]),
            TensorData::zeros(DType::Bf16, vec![512]),
        ],
    };
    let err = w.append(&s).await.unwrap_err();
    assert!(matches!(err, StoreError::InvalidSample { .. }));
    assert!(
        err.to_string()
            .contains("layer 30: expected shape [512, 7168], got [512]"),
        "{err}"
    );
    assert_eq!(w.commit().await.unwrap(), None);
    assert_eq!(ds.versions().await.unwrap(), vec![0]);
    assert_eq!(
        DatasetReader::open(&ds, None)
            .await
            .unwrap()
            .manifest()
            .num_samples(),
        0
    );
}

async fn verify_names_flipped_byte_and_truncated_shard(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..40, 1, 100).await;
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
    let m = ds.manifest(None).await.unwrap();
    assert!(
        m.shards.len() >= 2,
        "small shard target gives several shards"
    );
    let store = ds.object_store();
    let (a, t) = (&m.shards[0], &m.shards[1]);
    let pa = ds.object_path(&a.path);
    let mut bytes = store
        .get(&pa)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    store.put(&pa, PutPayload::from(bytes)).await.unwrap();
    let pt = ds.object_path(&t.path);
    let bytes = store.get(&pt).await.unwrap().bytes().await.unwrap();
    store
        .put(&pt, PutPayload::from(bytes.slice(..bytes.len() - 100)))
        .await
        .unwrap();
    let report = verify(&ds, None, |_| {}).await.unwrap();
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(
        text.iter()
            .any(|p| p.contains(&a.path) && p.contains("checksum mismatch")),
        "{text:#?}"
    );
    assert!(
        text.iter()
            .any(|p| p.contains(&t.path) && p.contains("truncated")),
        "{text:#?}"
    );
}

async fn concurrent_writers_never_lose_a_commit(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap();
    let (d1, d2) = (ds.clone(), ds.clone());
    let t1 = tokio::spawn(async move { write_synth(&d1, 0..30, 1, 2).await });
    let t2 = tokio::spawn(async move { write_synth(&d2, 1000..1030, 2, 3).await });
    t1.await.unwrap();
    t2.await.unwrap();
    let mut ids = DatasetReader::open(&ds, None)
        .await
        .unwrap()
        .sample_ids()
        .await
        .unwrap();
    ids.sort_unstable();
    let want: Vec<u64> = (0..30).chain(1000..1030).collect();
    assert_eq!(ids, want);
}

async fn crash_before_commit_leaves_previous_version_and_vacuum_removes_orphan(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..5, 1, 100).await;
    let before = ds.manifest(None).await.unwrap();
    {
        // Shards are written (small targets close them) but the writer dies before commit.
        let gen = SynthModel::new(before.schema.clone(), (3, 12), 9);
        let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
        for id in 100..140 {
            w.append(&gen.sample(id)).await.unwrap();
        }
        assert!(w.uncommitted_samples() > 0);
        drop(w);
    }
    let after = ds.manifest(None).await.unwrap();
    assert_eq!(after, before);
    let dry = vacuum(&ds, sweep(Duration::ZERO, true)).await.unwrap();
    assert!(!dry.deleted.is_empty(), "orphans found");
    let rec = vacuum(&ds, sweep(Duration::from_secs(3600), false))
        .await
        .unwrap();
    assert!(
        rec.deleted.is_empty() && !rec.too_recent.is_empty(),
        "grace period protects young files"
    );
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert_eq!(rep.deleted, dry.deleted);
    assert!(vacuum(&ds, sweep(Duration::ZERO, true))
        .await
        .unwrap()
        .deleted
        .is_empty());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

async fn readers_pin_a_version(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..4, 1, 100).await;
    let pinned = DatasetReader::open(&ds, None).await.unwrap();
    write_synth(&ds, 4..8, 1, 100).await;
    assert_eq!(pinned.sample_ids().await.unwrap().len(), 4);
    assert_eq!(
        DatasetReader::open(&ds, None)
            .await
            .unwrap()
            .sample_ids()
            .await
            .unwrap()
            .len(),
        8
    );
    let old = DatasetReader::open(&ds, Some(pinned.manifest().version))
        .await
        .unwrap();
    assert_eq!(old.manifest().num_samples(), 4);
}

async fn one_sample_takes_one_ranged_read_once_the_footer_is_cached(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(
        &url,
        schema(DType::Bf16, 16, &[2, 30]),
        Provenance::default(),
    )
    .await
    .unwrap();
    write_synth(&ds, 0..40, 1, 100).await;
    let r = DatasetReader::open(&ds, None).await.unwrap();
    for i in 0..r.manifest().shards.len() {
        r.shard_metadata(i).await.unwrap();
    }
    let (_, req0) = r.io();
    r.get_sample(23).await.unwrap();
    let (_, req1) = r.io();
    assert!(req1 - req0 <= 2, "{} requests", req1 - req0);
}

async fn read_rows_returns_only_the_selected_rows_of_a_row_group(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(
        &url,
        schema(DType::Bf16, 16, &[2, 30]),
        Provenance::default(),
    )
    .await
    .unwrap();
    write_synth(&ds, 0..40, 1, 100).await;
    let r = DatasetReader::open(&ds, None).await.unwrap();
    let (shard, rg) = r
        .manifest()
        .shards
        .iter()
        .enumerate()
        .find_map(|(i, s)| s.row_groups.iter().position(|&n| n >= 3).map(|g| (i, g)))
        .expect("a row group of at least 3 rows");
    let whole = r.read_row_group(shard, rg, None).await.unwrap();
    let n = whole.num_rows();
    for rows in [vec![0], vec![n - 1], vec![0, 2], (1..n).collect::<Vec<_>>()] {
        let got = r.read_rows(shard, rg, &rows, None).await.unwrap();
        assert_eq!(got.num_rows(), rows.len(), "{rows:?}");
        for (i, &row) in rows.iter().enumerate() {
            assert_eq!(got.slice(i, 1), whole.slice(row, 1), "{rows:?} row {row}");
        }
    }
    let cols = ["sample_id".to_string(), "layer_30".to_string()];
    let got = r.read_rows(shard, rg, &[1], Some(&cols)).await.unwrap();
    assert_eq!(
        got.column_by_name("sample_id").unwrap(),
        &whole.column_by_name("sample_id").unwrap().slice(1, 1)
    );
    // With the footer cached, one row costs its own pages (located by the offset index), not
    // the row group's.
    let (b0, _) = r.io();
    r.read_row_group(shard, rg, None).await.unwrap();
    let (b1, _) = r.io();
    r.read_rows(shard, rg, &[1], None).await.unwrap();
    let (b2, _) = r.io();
    assert!(
        2 * (b2 - b1) < b1 - b0,
        "one of {n} rows read {} bytes, the row group {}",
        b2 - b1,
        b1 - b0
    );
    let err = r.read_rows(shard, rg, &[n], None).await.unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "row {n} of row group {rg} is out of range: it has {n} rows"
        )),
        "{err}"
    );
    let err = r.read_rows(shard, rg, &[2, 1], None).await.unwrap_err();
    assert!(err.to_string().contains("ascending and distinct"), "{err}");
}

async fn copy_round_trips_to_another_store(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let written = write_synth(&ds, 0..20, 4, 7).await;
    let mid = fresh_url(Backend::Local).unwrap();
    let rep = copy_dataset(&ds, &mid, |_| {}).await.unwrap();
    assert_eq!(rep.versions, ds.versions().await.unwrap().len());
    let back_url = fresh_url(b).unwrap();
    copy_dataset(&Dataset::open(&mid).await.unwrap(), &back_url, |_| {})
        .await
        .unwrap();
    let back = Dataset::open(&back_url).await.unwrap();
    assert!(verify(&back, None, |_| {}).await.unwrap().is_clean());
    let r = DatasetReader::open(&back, None).await.unwrap();
    for s in &written {
        assert_eq!(&r.get_sample(s.sample_id).await.unwrap(), s);
    }
    let err = copy_dataset(&ds, &back_url, |_| {}).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
}

async fn bad_input_gets_named_errors(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let err = Dataset::open(&url).await.unwrap_err();
    assert!(err.to_string().contains("not an hslake dataset"), "{err}");
    let ds = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap();
    let err = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }));
    let err = Dataset::open_or_create(&url, schema(DType::F16, 8, &[1]), Provenance::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("dtype"), "{err}");
    let err = ds.manifest(Some(9)).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("{}: version 9 does not exist (latest is 0)", ds.url())
    );
    // A manifest written by a future hslake.
    let mut m = ds.manifest(None).await.unwrap();
    m.version = 1;
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["format_version"] = (hslake_schemas::FORMAT_VERSION + 1).into();
    let path = ds.object_path(&hslake_store::manifest_path(1));
    ds.object_store()
        .put(&path, PutPayload::from(serde_json::to_vec(&json).unwrap()))
        .await
        .unwrap();
    let err = Dataset::open(&url)
        .await
        .unwrap()
        .manifest(None)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "format version {} is newer",
            hslake_schemas::FORMAT_VERSION + 1
        )),
        "{err}"
    );
    let mut w = DatasetWriter::new(&ds, WriterOptions::default()).await;
    assert!(w.as_mut().is_err());
    let _ = BTreeMap::<String, String>::new();
}

/// Samples and the number of shards of the newest version.
async fn counts(ds: &Dataset) -> (u64, usize) {
    let m = ds.manifest(None).await.unwrap();
    (m.num_samples(), m.shards.len())
}

async fn commit_refuses_sample_ids_the_head_holds(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..6, 1, 100).await;
    let gen = SynthModel::new(ds.manifest(None).await.unwrap().schema, (3, 12), 2);
    let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
    for id in 3..40 {
        w.append(&gen.sample(id)).await.unwrap();
    }
    let err = w.commit().await.unwrap_err();
    match &err {
        StoreError::DuplicateSamples {
            version: Some(1),
            count: 3,
            examples,
            ..
        } => assert_eq!(examples, &[3, 4, 5]),
        other => panic!("{other}"),
    }
    assert!(
        err.to_string()
            .contains("3 sample id(s) are already in version 1 (e.g. 3, 4, 5)"),
        "{err}"
    );
    assert_eq!(
        ds.versions().await.unwrap(),
        vec![0, 1],
        "nothing committed"
    );
    assert_eq!(counts(&ds).await.0, 6);
    w.abort().await.unwrap();
    // Ids within one commit must be distinct as well.
    let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
    w.append(&gen.sample(50)).await.unwrap();
    w.append(&gen.sample(50)).await.unwrap();
    let err = w.commit().await.unwrap_err();
    assert!(
        matches!(err, StoreError::DuplicateSamples { version: None, .. }),
        "{err}"
    );
    assert_eq!(ds.versions().await.unwrap(), vec![0, 1]);
}

async fn racing_writers_into_a_new_dataset_hold_each_sample_once(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 8, &[1]), Provenance::default())
        .await
        .unwrap();
    // Both found the dataset empty (as two captures or two `--resume`s do), both write 0..8.
    let gen = SynthModel::new(ds.manifest(None).await.unwrap().schema, (3, 12), 2);
    let mut writers = vec![];
    for _ in 0..2 {
        let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
        for id in 0..8 {
            w.append(&gen.sample(id)).await.unwrap();
        }
        writers.push(w);
    }
    let results = futures::future::join_all(writers.iter_mut().map(|w| w.commit())).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 1, "{results:?}");
    assert!(results
        .iter()
        .any(|r| matches!(r, Err(StoreError::DuplicateSamples { count: 8, .. }))));
    assert_eq!(counts(&ds).await.0, 8);
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

async fn synth_twice_with_the_same_first_id_adds_nothing_the_second_time(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let spec = SynthSpec {
        samples: 6,
        seq_len: (4, 8),
        hidden: 16,
        layers: vec![0, 1],
        final_norm: false,
        num_layers: None,
        vocab_size: 100,
        dtype: DType::Bf16,
        seed: 1,
        first_id: 0,
        writer: small_opts(),
        commit_every: 0,
    };
    let ds = write_dataset(&url, &spec, || {}).await.unwrap().dataset;
    let before = ds.versions().await.unwrap();
    let err = write_dataset(&url, &spec, || {}).await.unwrap_err();
    assert!(matches!(err, StoreError::DuplicateSamples { .. }), "{err}");
    assert_eq!(ds.versions().await.unwrap(), before);
    assert_eq!(counts(&ds).await.0, 6);
}

async fn commit_refuses_shards_deleted_before_it_lands(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let gen = SynthModel::new(ds.manifest(None).await.unwrap().schema, (3, 12), 2);
    let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
    for id in 0..40 {
        w.append(&gen.sample(id)).await.unwrap();
    }
    // A vacuum without grace sees the closed, not yet committed shards as debris.
    let swept = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert!(
        !swept.deleted.is_empty(),
        "shards were closed before the commit"
    );
    // Refused for a deleted shard or, where the store lists whole seconds and the shard the
    // commit closed shares the cutoff's second, for one that predates the vacuum (shards are
    // checked at once; either refusal may come first).
    let err = w.commit().await.unwrap_err();
    match &err {
        StoreError::ShardMissing { .. } => assert!(err.to_string().contains("not in storage")),
        StoreError::ShardPredatesVacuum { vacuum_version, .. } => assert_eq!(*vacuum_version, 1),
        _ => panic!("{err}"),
    }
    // Version 1 is the vacuum's own, committed before it deleted; the writer added nothing.
    assert_eq!(swept.version, Some(1));
    assert_eq!(
        ds.versions().await.unwrap(),
        vec![0, 1],
        "nothing committed"
    );
    assert_eq!(ds.manifest(None).await.unwrap().num_samples(), 0);
}

/// Samples `ids` written by a fresh writer whose shards are closed (in storage) but not
/// committed: the writer, and what it wrote.
async fn uncommitted(ds: &Dataset, ids: std::ops::Range<u64>) -> (DatasetWriter, Vec<Sample>) {
    let gen = SynthModel::new(ds.manifest(None).await.unwrap().schema, (3, 12), ids.start);
    let mut w = DatasetWriter::new(ds, small_opts()).await.unwrap();
    let samples: Vec<Sample> = ids.map(|id| gen.sample(id)).collect();
    for s in &samples {
        w.append(s).await.unwrap();
    }
    (w, samples)
}

/// Every version verifies, and the newest holds exactly `want` (each read back bit-exact).
async fn every_version_verifies_holding(ds: &Dataset, want: &[Sample]) {
    for v in ds.versions().await.unwrap() {
        let report = verify(ds, Some(v), |_| {}).await.unwrap();
        assert!(report.is_clean(), "version {v}: {:#?}", report.problems);
    }
    let r = DatasetReader::open(ds, None).await.unwrap();
    let mut ids = r.sample_ids().await.unwrap();
    ids.sort_unstable();
    let mut expected: Vec<u64> = want.iter().map(|s| s.sample_id).collect();
    expected.sort_unstable();
    assert_eq!(ids, expected);
    for s in want {
        assert_eq!(&r.get_sample(s.sample_id).await.unwrap(), s);
    }
}

async fn vacuum_commits_its_version_before_deleting_and_pinned_readers_keep_reading(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let (mut w, written) = uncommitted(&ds, 0..10).await;
    let props: BTreeMap<String, String> = [("capture.progress".into(), "10".into())].into();
    w.commit_with_properties(props.clone()).await.unwrap();
    let pinned = DatasetReader::open(&ds, None).await.unwrap();
    let (w, _) = uncommitted(&ds, 100..120).await;
    drop(w); // a crashed writer's shards
    let before = ds.manifest(None).await.unwrap();
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert!(!rep.deleted.is_empty());
    assert_eq!(rep.version, Some(before.version + 1));
    let m = ds.manifest(None).await.unwrap();
    assert!(m.is_vacuum() && !before.is_vacuum());
    assert_eq!((&m.shards, &m.properties), (&before.shards, &props));
    assert_eq!(m.vacuum.unwrap().cutoff, rep.cutoff.unwrap());
    for s in &written {
        assert_eq!(&pinned.get_sample(s.sample_id).await.unwrap(), s);
    }
    every_version_verifies_holding(&ds, &written).await;
    // The mark goes forward with every commit; a vacuum with nothing to delete commits nothing.
    // (S3 lists whole seconds, so the cutoff is the end of a second: a shard of that second
    // would be refused.)
    wait_past(rep.cutoff.unwrap()).await;
    let more = write_synth(&ds, 10..12, 1, 100).await;
    assert_eq!(ds.manifest(None).await.unwrap().vacuum, m.vacuum);
    let again = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert_eq!((again.version, again.deleted.len()), (None, 0));
    every_version_verifies_holding(&ds, &[written, more].concat()).await;
}

/// Wait until the store's clock (here, this machine's) is past `t`.
async fn wait_past(t: chrono::DateTime<chrono::Utc>) {
    while chrono::Utc::now() <= t {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Set a local file's modification time `secs` into the past, as a writer stalled that long
/// would have left it.
fn backdate(path: &std::path::Path, secs: i64) {
    let t = std::time::SystemTime::now() - Duration::from_secs(secs as u64);
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(t).unwrap();
}

async fn a_writer_stalled_past_the_grace_is_refused_by_name(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let kept = write_synth(&ds, 0..5, 1, 100).await;
    let (mut w, _) = uncommitted(&ds, 100..140).await;
    // On local disk the stall is real time (shards two hours old, the default grace); elsewhere
    // a grace of zero stands in for it.
    let opts = match b {
        Backend::Local => {
            let root = std::path::PathBuf::from(url.strip_prefix("file://").unwrap());
            let live: Vec<String> = ds
                .manifest(None)
                .await
                .unwrap()
                .shards
                .into_iter()
                .map(|s| s.path)
                .collect();
            for e in std::fs::read_dir(root.join("data")).unwrap() {
                let p = e.unwrap().path();
                let rel = format!("data/{}", p.file_name().unwrap().to_string_lossy());
                if !live.contains(&rel) {
                    backdate(&p, 7200);
                }
            }
            VacuumOptions::default()
        }
        _ => sweep(Duration::ZERO, false),
    };
    assert_eq!(opts.grace >= MIN_GRACE, matches!(b, Backend::Local));
    let plan = VacuumPlan::new(&ds, opts).await.unwrap();
    let doomed = plan.doomed().to_vec();
    assert!(!doomed.is_empty(), "the writer's closed shards are doomed");
    let Marked::Landed(marked) = plan.mark().await.unwrap() else {
        panic!("no commit raced the vacuum")
    };
    // The vacuum's version is in; its deletes have not run: the shards are still there.
    let err = w.commit().await.unwrap_err();
    let StoreError::ShardPredatesVacuum {
        path,
        vacuum_version,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    // On local disk the refused shard is one of the stalled ones; elsewhere, with all of it
    // within a second, it may also be the one the commit closed (same second as the cutoff).
    if let Backend::Local = b {
        assert!(doomed.contains(path), "{path} not in {doomed:?}");
    }
    assert!(!ds
        .manifest(None)
        .await
        .unwrap()
        .shards
        .iter()
        .any(|s| &s.path == path));
    assert_eq!(*vacuum_version, ds.latest_version().await.unwrap());
    let text = err.to_string();
    assert!(
        text.contains(path.as_str())
            && text.contains("may have deleted it")
            && text.contains("nothing was committed"),
        "{text}"
    );
    marked.delete().await.unwrap();
    every_version_verifies_holding(&ds, &kept).await;
}

async fn vacuum_starts_over_when_a_commit_lands_before_its_version(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let (mut w, written) = uncommitted(&ds, 0..40).await;
    let plan = VacuumPlan::new(&ds, sweep(Duration::ZERO, false))
        .await
        .unwrap();
    assert!(!plan.doomed().is_empty());
    // The commit lands between the vacuum's reading and its put: it wins the version.
    w.commit().await.unwrap();
    assert!(matches!(plan.mark().await.unwrap(), Marked::Conflict));
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert!(rep.deleted.is_empty(), "{:?}", rep.deleted);
    every_version_verifies_holding(&ds, &written).await;
}

/// Writers appending while a vacuum with no grace runs in a loop (issue 36): every commit
/// lands with all its samples or is refused by name; nothing committed is ever lost.
async fn writers_racing_a_vacuum_loop_lose_no_committed_sample(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweeper = {
        let (ds, done) = (ds.clone(), done.clone());
        tokio::spawn(async move {
            let mut versions = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
                versions += rep.version.is_some() as u32;
                // memory:// never waits: let the writers run on this thread.
                tokio::task::yield_now().await;
            }
            versions
        })
    };
    let writers: Vec<_> = (0..4u64)
        .map(|k| {
            let ds = ds.clone();
            tokio::spawn(async move {
                let (mut committed, mut refused) = (vec![], 0);
                let gen = SynthModel::new(ds.manifest(None).await.unwrap().schema, (3, 12), k);
                for run in 0..4u64 {
                    let first = 1000 * k + 100 * run;
                    let samples: Vec<Sample> =
                        (first..first + 12).map(|id| gen.sample(id)).collect();
                    let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
                    let mut written = Ok(None);
                    for s in &samples {
                        if let Err(e) = w.append(s).await {
                            written = Err(e);
                            break;
                        }
                    }
                    if written.is_ok() {
                        // Shards in storage, not yet committed, for a while: the window a
                        // vacuum without grace dooms them in.
                        tokio::time::sleep(Duration::from_millis(5 * run)).await;
                        written = w.commit().await;
                    }
                    match written {
                        Ok(_) => committed.extend(samples),
                        Err(
                            StoreError::ShardPredatesVacuum { .. }
                            | StoreError::ShardMissing { .. },
                        ) => refused += 1,
                        // A vacuum without grace may delete a local upload's staging file
                        // under the writer: the upload of that shard fails, by name.
                        Err(
                            StoreError::Parquet { path, .. } | StoreError::ObjectStore { path, .. },
                        ) if path.contains("/data/") => refused += 1,
                        Err(e) => panic!("writer {k} run {run}: {e}"),
                    }
                }
                (committed, refused)
            })
        })
        .collect();
    let (mut committed, mut refusals) = (vec![], 0);
    for w in writers {
        let (c, refused) = w.await.unwrap();
        committed.extend(c);
        refusals += refused;
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let vacuums = sweeper.await.unwrap();
    // How often the race was met varies with timing (on S3, whose listings give whole seconds,
    // a vacuum every few milliseconds may refuse every run), what must hold does not.
    eprintln!(
        "{b:?}: {vacuums} vacuum versions, {refusals} refused runs, {} samples committed",
        committed.len()
    );
    every_version_verifies_holding(&ds, &committed).await;
}

async fn verify_names_a_missing_shard_and_repair_drops_it(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let first = write_synth(&ds, 0..4, 1, 100).await;
    let later = [
        write_synth(&ds, 10..14, 1, 100).await,
        write_synth(&ds, 20..24, 1, 100).await,
    ]
    .concat();
    let lost = ds.manifest(Some(1)).await.unwrap().shards;
    assert_eq!(lost.len(), 1);
    let path = lost[0].path.clone();
    ds.object_store()
        .delete(&ds.object_path(&path))
        .await
        .unwrap();
    let report = verify(&ds, None, |_| {}).await.unwrap();
    assert_eq!(report.missing.len(), 1);
    assert_eq!(
        (
            report.missing[0].path.as_str(),
            report.missing[0].versions.as_slice()
        ),
        (path.as_str(), &[1, 2, 3][..])
    );
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(
        text.iter()
            .any(|p| p.contains(&path)
                && p.contains("missing: not in storage; versions 1..=3 name it")),
        "{text:#?}"
    );
    let missing = |dry_run| RepairOptions {
        drop_missing: true,
        dry_run,
    };
    let dry = repair(&ds, missing(true)).await.unwrap();
    assert_eq!((dry.dropped.len(), dry.version), (1, None));
    assert_eq!(ds.latest_version().await.unwrap(), 3);
    let rep = repair(&ds, missing(false)).await.unwrap();
    assert_eq!(rep.dropped[0].path, path);
    assert_eq!(
        hslake_store::lost_samples(&rep.dropped[0]),
        format!("{} samples, ids 0..=3", first.len())
    );
    assert_eq!(rep.version, Some(4));
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
    let r = DatasetReader::open(&ds, None).await.unwrap();
    assert_eq!(r.manifest().num_samples(), later.len() as u64);
    for s in &later {
        assert_eq!(&r.get_sample(s.sample_id).await.unwrap(), s);
    }
    // Nothing is missing any more.
    let again = repair(&ds, missing(false)).await.unwrap();
    assert_eq!((again.dropped.len(), again.version), (0, None));
}

/// Put `m` as its version's manifest, as a hand edit or a foreign tool would.
/// The problems `verify` reports on the newest version, as text.
async fn problems(ds: &Dataset) -> Vec<String> {
    let report = verify(ds, None, |_| {}).await.unwrap();
    report.problems.iter().map(|p| p.to_string()).collect()
}

async fn plant(ds: &Dataset, json: &serde_json::Value) {
    let v = json["version"].as_u64().unwrap();
    ds.object_store()
        .put(
            &ds.object_path(&hslake_store::manifest_path(v)),
            PutPayload::from(serde_json::to_vec(json).unwrap()),
        )
        .await
        .unwrap();
}

async fn non_canonical_shard_paths_read_verify_and_survive_vacuum(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let written = write_synth(&ds, 0..20, 1, 100).await;
    let m = ds.manifest(None).await.unwrap();
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["version"] = (m.version + 1).into();
    for (i, s) in json["shards"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        let p = s["path"].as_str().unwrap().to_string();
        let odd = if i % 2 == 0 {
            p.replacen("data/", "data//", 1)
        } else {
            format!("/{p}")
        };
        s["path"] = odd.into();
    }
    plant(&ds, &json).await;
    let report = verify(&ds, None, |_| {}).await.unwrap();
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(text.len(), m.shards.len(), "{text:#?}");
    assert!(
        text.iter().all(|p| p.contains("is not canonical")),
        "{text:#?}"
    );
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert!(rep.deleted.is_empty(), "{:?}", rep.deleted);
    let r = DatasetReader::open(&ds, None).await.unwrap();
    for s in &written {
        assert_eq!(&r.get_sample(s.sample_id).await.unwrap(), s);
    }
    // Committing on top writes the canonical form back.
    write_synth(&ds, 100..101, 1, 100).await;
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

async fn verify_reports_duplicates_and_counts_that_disagree(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..20, 1, 100).await;
    let m = ds.manifest(None).await.unwrap();
    // A copy of the first shard under another name holds its samples again.
    let copy = "data/copy-of-first.parquet";
    let store = ds.object_store();
    store
        .copy(&ds.object_path(&m.shards[0].path), &ds.object_path(copy))
        .await
        .unwrap();
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["version"] = (m.version + 1).into();
    let shards = json["shards"].as_array_mut().unwrap();
    let mut again = shards[0].clone();
    again["path"] = copy.into();
    shards.push(again);
    shards[1]["tokens"] = (shards[1]["tokens"].as_u64().unwrap() + 1).into();
    shards[1]["raw_bytes"] = 1.into();
    plant(&ds, &json).await;
    let report = verify(&ds, None, |_| {}).await.unwrap();
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    let has = |what: &str| text.iter().any(|p| p.contains(what));
    assert!(has("sample 0 is held again by"), "{text:#?}");
    assert!(
        has(&format!(
            "tokens, the manifest says {}",
            m.shards[1].tokens + 1
        )),
        "{text:#?}"
    );
    assert!(has("raw_bytes, the manifest says 1"), "{text:#?}");
}

async fn a_manifest_naming_a_shard_twice_is_refused_and_repair_drops_the_repeats(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let written = write_synth(&ds, 0..20, 1, 100).await;
    let m = ds.manifest(None).await.unwrap();
    assert!(m.shards.len() > 1, "the test needs several shards");
    let first = m.shards[0].path.clone();
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["version"] = (m.version + 1).into();
    let shards = json["shards"].as_array_mut().unwrap();
    // Named four times, once spelt otherwise: the same shard once canonical.
    for spelling in [
        first.clone(),
        first.clone(),
        first.replacen("data/", "data//", 1),
    ] {
        let mut e = shards[0].clone();
        e["path"] = spelling.into();
        shards.push(e);
    }
    // A writer that opened before the version landed, committing on top of it.
    let (mut w, _) = uncommitted(&ds, 100..101).await;
    plant(&ds, &json).await;
    let repeated = RepeatedShard {
        path: first.clone(),
        times: 4,
    };

    // Every reader and every commit refuses the version by name.
    let refused = |e: StoreError| match e {
        StoreError::RepeatedShard { path, times, .. } => (path, times),
        other => panic!("expected RepeatedShard, got {other}"),
    };
    let e = ds.manifest(None).await.unwrap_err();
    assert!(e.to_string().contains("--drop-repeats"), "{e}");
    assert_eq!(refused(e), (first.clone(), 4));
    let e = DatasetReader::open(&ds, None).await.err().unwrap();
    assert_eq!(refused(e), (first.clone(), 4));
    assert_eq!(refused(w.commit().await.unwrap_err()), (first.clone(), 4));
    assert_eq!(ds.latest_version().await.unwrap(), m.version + 1);

    // verify names it; repair keeps each shard once, losing nothing.
    let text = problems(&ds).await;
    assert!(
        text.iter()
            .any(|p| p.contains(&format!("shard {first} is named 4 times"))),
        "{text:#?}"
    );
    let repeats = |dry_run| RepairOptions {
        drop_missing: true,
        dry_run,
    };
    let dry = repair(&ds, repeats(true)).await.unwrap();
    assert_eq!(
        (dry.repeated.as_slice(), dry.dropped.len(), dry.version),
        (&[repeated.clone()][..], 0, None)
    );
    assert_eq!(ds.latest_version().await.unwrap(), m.version + 1);
    let rep = repair(&ds, repeats(false)).await.unwrap();
    assert_eq!(rep.repeated, [repeated]);
    assert_eq!(rep.version, Some(m.version + 2));
    let fixed = ds.manifest(None).await.unwrap();
    assert_eq!(fixed.shards, m.shards);
    assert_eq!(fixed.num_samples(), written.len() as u64);
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
    let r = DatasetReader::open(&ds, None).await.unwrap();
    let mut ids = r.sample_ids().await.unwrap();
    ids.sort_unstable();
    assert_eq!(ids, (0..20).collect::<Vec<u64>>());
    // The repeated version stays in the history: vacuum reads past it, deleting only the
    // refused writer's shard.
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert_eq!(rep.deleted.len(), 1, "{:?}", rep.deleted);
    assert!(
        m.shards.iter().all(|s| !rep.deleted[0].ends_with(&s.path)),
        "{:?}",
        rep.deleted
    );
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
    // Copy reads past it too, writing it with each shard once.
    let dst = fresh_url(b).unwrap();
    copy_dataset(&ds, &dst, |_| {}).await.unwrap();
    let copied = Dataset::open(&dst).await.unwrap();
    let planted = copied.manifest(Some(m.version + 1)).await.unwrap();
    assert_eq!(planted.shards, m.shards);
    let again = repair(&ds, repeats(false)).await.unwrap();
    assert_eq!((again.repeated.len(), again.version), (0, None));
}

async fn reads_hold_the_manifests_row_groups_to_the_file(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let opts = WriterOptions {
        row_group_target_bytes: 1,
        shard_target_bytes: 1 << 30,
        ..small_opts()
    };
    let gen = SynthModel::new(schema(DType::Bf16, 16, &[2]), (3, 12), 1);
    let mut w = DatasetWriter::new(&ds, opts).await.unwrap();
    for id in 0..6 {
        w.append(&gen.sample(id)).await.unwrap();
    }
    w.commit().await.unwrap();
    let m = ds.manifest(None).await.unwrap();
    assert_eq!(m.shards[0].row_groups, [1; 6], "one row per row group");
    let path = m.shards[0].path.clone();
    // (what the entry claims, what a read and verify say), each planted as the next version.
    type Claim = fn(&mut serde_json::Value);
    let claims: [(Claim, &str); 3] = [
        (
            |e| {
                e["row_groups"] = serde_json::json!([6]);
            },
            "the file has 6 row groups, the manifest says 1",
        ),
        (
            |e| {
                e["row_groups"][0] = 6.into();
                e["rows"] = 11.into();
            },
            "row group 0 holds 1 rows, the manifest says 6",
        ),
        (
            |e| {
                e["row_groups"] = serde_json::json!([1, 1, 1, 1, 1, 1, 1]);
                e["rows"] = 7.into();
            },
            "the file has 6 row groups, the manifest says 7",
        ),
    ];
    for (claim, named) in claims {
        let head = ds.latest_version().await.unwrap();
        let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        json["version"] = (head + 1).into();
        claim(&mut json["shards"][0]);
        plant(&ds, &json).await;
        let r = DatasetReader::open(&ds, None).await.unwrap();
        let e = r.read_row_group(0, 0, None).await.unwrap_err().to_string();
        assert!(e.contains(&path) && e.contains(named), "{e}");
        let problems = problems(&ds).await;
        assert!(
            problems
                .iter()
                .any(|p| p.contains(&path) && p.contains(named)),
            "{problems:#?}"
        );
    }
    // More row groups than the file's bytes can hold: refused with the manifest, before any
    // reader plans a read of them.
    let head = ds.latest_version().await.unwrap();
    let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    json["version"] = (head + 1).into();
    let bytes = json["shards"][0]["bytes"].as_u64().unwrap();
    let groups = bytes / 64 + 1;
    json["shards"][0]["row_groups"] = vec![1u64; groups as usize].into();
    json["shards"][0]["rows"] = groups.into();
    json["shards"][0]["bytes"] = bytes.into();
    plant(&ds, &json).await;
    let e = ds.manifest(None).await.unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "{groups} row groups cannot fit in a file of {bytes} bytes"
        )),
        "{e}"
    );
}

async fn vacuum_deletes_only_the_datasets_own_debris(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..10, 1, 100).await;
    let nested = Dataset::create(
        &format!("{url}/nested"),
        schema(DType::Bf16, 16, &[2]),
        Provenance::default(),
    )
    .await
    .unwrap();
    write_synth(&nested, 0..10, 1, 100).await;
    let store = ds.object_store();
    let kept = [
        "other-team/precious.bin",
        "data/sub/keep.bin",
        "_hslake/jobs/state.json",
    ];
    for rel in kept.iter().chain(&["data/orphan.parquet"]) {
        store
            .put(&ds.object_path(rel), PutPayload::from_static(b"x"))
            .await
            .unwrap();
    }
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert_eq!(rep.deleted, ["data/orphan.parquet"]);
    for rel in kept {
        assert!(store.head(&ds.object_path(rel)).await.is_ok(), "{rel} kept");
    }
    assert!(rep.left_alone.contains(&"data/sub/keep.bin".to_string()));
    assert!(verify(&nested, None, |_| {}).await.unwrap().is_clean());
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

async fn the_root_of_a_bucket_is_refused_as_a_dataset(b: Backend) {
    // Only S3 could put a dataset at the root of its store (a bucket); a new bucket for it.
    let Backend::S3 = b else { return };
    let Some(endpoint) = std::env::var("HSLAKE_TEST_S3_ENDPOINT").ok() else {
        return;
    };
    let bucket = create_bucket(&endpoint, "hslake-root").expect("test bucket");
    for url in [format!("s3://{bucket}"), format!("s3://{bucket}/")] {
        let err = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::InvalidUrl { .. }), "{err}");
        assert!(err.to_string().contains("is the root of a bucket"), "{err}");
    }
    let src_url = fresh_url(b).unwrap();
    let src = Dataset::create(
        &src_url,
        schema(DType::Bf16, 16, &[2]),
        Provenance::default(),
    )
    .await
    .unwrap();
    let err = copy_dataset(&src, &format!("s3://{bucket}"), |_| {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("is the root of a bucket"), "{err}");
}

async fn vacuum_never_follows_symbolic_links(b: Backend) {
    let Backend::Local = b else { return };
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..4, 1, 100).await;
    let root = std::path::PathBuf::from(url.strip_prefix("file://").unwrap());
    let victim = root.parent().unwrap().join(format!("victim-{}", unique()));
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("a"), b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, root.join("data/link")).unwrap();
    let rep = vacuum(&ds, sweep(Duration::ZERO, false)).await.unwrap();
    assert!(
        victim.join("a").exists(),
        "deleted through a link: {:?}",
        rep.deleted
    );
    assert!(rep.deleted.is_empty(), "{:?}", rep.deleted);
    // A data folder that is itself a link is refused outright.
    let url2 = fresh_url(b).unwrap();
    let ds2 = Dataset::create(&url2, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    let root2 = std::path::PathBuf::from(url2.strip_prefix("file://").unwrap());
    std::os::unix::fs::symlink(&victim, root2.join("data")).unwrap();
    let err = vacuum(&ds2, sweep(Duration::ZERO, false))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::VacuumRefused { .. }), "{err}");
    assert!(victim.join("a").exists());
}

async fn untrusted_sizes_get_named_errors_not_aborts(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..6, 1, 100).await;
    let head = ds.manifest(None).await.unwrap();
    let base: serde_json::Value = serde_json::from_slice(&head.to_json()).unwrap();
    // A hidden size of 2^40: verify and reading a sample report, neither allocates for it.
    let mut json = base.clone();
    json["version"] = (head.version + 1).into();
    json["schema"]["hidden_size"] = (1u64 << 40).into();
    plant(&ds, &json).await;
    let report = verify(&ds, None, |_| {}).await.unwrap();
    assert!(!report.is_clean());
    let r = DatasetReader::open(&ds, None).await.unwrap();
    let err = r.get_sample(0).await.unwrap_err();
    assert!(err.to_string().contains("1099511627776"), "{err}");
    // A row count far beyond what the file can hold is refused by name.
    let mut json = base.clone();
    json["version"] = (head.version + 2).into();
    json["shards"][0]["rows"] = 1_000_000_000_000u64.into();
    json["shards"][0]["row_groups"] = serde_json::json!([1_000_000_000_000u64]);
    plant(&ds, &json).await;
    let err = ds.manifest(None).await.unwrap_err();
    assert!(
        err.to_string().contains("rows cannot fit in a file of"),
        "{err}"
    );
    // A planted manifest with the largest version makes commits fail by name, not panic.
    let mut json = base.clone();
    json["version"] = u64::MAX.into();
    plant(&ds, &json).await;
    let gen = SynthModel::new(head.schema.clone(), (3, 12), 2);
    let mut w = DatasetWriter::new(&ds, small_opts()).await.unwrap();
    w.append(&gen.sample(100)).await.unwrap();
    let err = w.commit().await.unwrap_err();
    assert!(
        err.to_string().contains("no version can follow it"),
        "{err}"
    );
}

async fn a_row_claiming_u32_max_tokens_is_refused_by_every_reader(b: Backend) {
    use hslake_store::tools::corrupt::{claim_seq_len, rewrite_shard};
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 16, &[2]), Provenance::default())
        .await
        .unwrap();
    write_synth(&ds, 0..6, 1, 100).await;
    let victim = ds.manifest(None).await.unwrap().shards[0].min_sample_id;
    rewrite_shard(&ds, 0, claim_seq_len(victim, u32::MAX))
        .await
        .unwrap();
    let report = verify(&ds, None, |_| {}).await.unwrap();
    let text: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    assert!(
        text.iter()
            .any(|p| p.contains("row 0") && p.contains("seq_len 4294967295")),
        "{text:#?}"
    );
    // What `export --sample` reads through, and every read of its row group's tokens.
    let r = DatasetReader::open(&ds, None).await.unwrap();
    let want = format!("(sample {victim}) seq_len: seq_len 4294967295, but input_ids holds");
    let err = r.get_sample(victim).await.unwrap_err().to_string();
    assert!(err.contains(&want), "{err}");
    let cols = ["input_ids".to_string()];
    let err = r
        .read_row_group(0, 0, Some(&cols))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&want), "{err}");
    let err = r.read_rows(0, 0, &[0], None).await.unwrap_err().to_string();
    assert!(err.contains(&want), "{err}");
}

/// Datasets written by the format-2 writer (kept as fixture bytes: `hslake synth --samples 6
/// --seq-len 3:9 --hidden 8 --layers 1,3 --num-layers 4 --seed 3 --row-group-mb 0`, one with
/// zstd frame checksums, one written with `value_checksums=False`) read bit-exactly, verify
/// clean and take format-3 commits on top.
async fn format_2_datasets_read_verify_and_take_format_3_commits(b: Backend) {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/format2");
    for (name, declared) in [("zstd_xxh64", Some("zstd_xxh64")), ("no_checksums", None)] {
        let Some(url) = fresh_url(b) else { return };
        let src = Dataset::open(&format!("file://{}", fixtures.join(name).display()))
            .await
            .unwrap();
        copy_dataset(&src, &url, |_| {}).await.unwrap();
        let ds = Dataset::open(&url).await.unwrap();
        assert_eq!(ds.manifest(None).await.unwrap().format_version, 2);
        let spec = SynthSpec {
            samples: 6,
            seq_len: (3, 9),
            hidden: 8,
            layers: vec![1, 3],
            final_norm: false,
            num_layers: Some(4),
            vocab_size: 32000,
            dtype: DType::Bf16,
            seed: 3,
            first_id: 0,
            writer: WriterOptions::default(),
            commit_every: 0,
        };
        let gen = SynthModel::new(spec.schema().unwrap(), spec.seq_len, spec.seed);
        let r = DatasetReader::open(&ds, None).await.unwrap();
        let meta = r.read_row_group(0, 0, None).await.unwrap();
        assert_eq!(
            meta.schema()
                .metadata()
                .get("hslake.value_checksum")
                .map(String::as_str),
            declared,
            "{name}"
        );
        for id in 0..6 {
            assert_eq!(
                r.get_sample(id).await.unwrap(),
                gen.sample(id),
                "{name} {id}"
            );
        }
        assert!(
            verify(&ds, None, |_| {}).await.unwrap().is_clean(),
            "{name}"
        );

        // New shards are format 3 (CRC-32 value and token checksums) next to the old ones.
        let mut w = DatasetWriter::new(&ds, WriterOptions::default())
            .await
            .unwrap();
        for id in 6..9 {
            w.append(&gen.sample(id)).await.unwrap();
        }
        w.commit().await.unwrap();
        let m = ds.manifest(None).await.unwrap();
        assert_eq!(
            (m.format_version, m.shards.len()),
            (hslake_schemas::FORMAT_VERSION, 2)
        );
        let r = DatasetReader::open(&ds, None).await.unwrap();
        for id in 0..9 {
            assert_eq!(
                r.get_sample(id).await.unwrap(),
                gen.sample(id),
                "{name} {id}"
            );
        }
        assert!(
            verify(&ds, None, |_| {}).await.unwrap().is_clean(),
            "{name}"
        );
    }
}

/// A shard of many object-store parts (the writer hands the store 4 MiB chunks; S3 uploads
/// 10 MiB parts) reads back bit-exact and verifies clean.
async fn shards_larger_than_the_upload_chunks_round_trip(b: Backend) {
    let Some(url) = fresh_url(b) else { return };
    let ds = Dataset::create(&url, schema(DType::Bf16, 2048, &[2]), Provenance::default())
        .await
        .unwrap();
    // Random mantissas compress little: six samples of 2048 tokens make a ~24 MB shard.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let samples: Vec<Sample> = (0..6u64)
        .map(|id| {
            let n = 2048;
            let bits: Vec<u16> = (0..n * 2048)
                .map(|_| (0x3c00 | (next() & 0x03ff)) as u16)
                .collect();
            Sample {
                sample_id: id,
                input_ids: (0..n as i32).map(|t| t % 1000).collect(),
                loss_mask: vec![1; n],
                tensors: vec![TensorData::from_bf16_bits(&bits, vec![n, 2048])],
            }
        })
        .collect();
    let mut w = DatasetWriter::new(&ds, WriterOptions::default())
        .await
        .unwrap();
    for s in &samples {
        w.append(s).await.unwrap();
    }
    w.commit().await.unwrap();
    let m = ds.manifest(None).await.unwrap();
    assert_eq!(m.shards.len(), 1);
    assert!(m.bytes() > 20 << 20, "shard of {} bytes", m.bytes());
    let r = DatasetReader::open(&ds, None).await.unwrap();
    for s in &samples {
        assert_eq!(
            &r.get_sample(s.sample_id).await.unwrap(),
            s,
            "sample {}",
            s.sample_id
        );
    }
    assert!(verify(&ds, None, |_| {}).await.unwrap().is_clean());
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory { $( #[tokio::test] async fn $name() { super::$name(super::Backend::Memory).await } )* }
        mod local { $( #[tokio::test] async fn $name() { super::$name(super::Backend::Local).await } )* }
        mod s3 { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(super::Backend::S3).await } )* }
    };
}

suite!(
    round_trip_is_bit_exact_for_every_dtype,
    shards_larger_than_the_upload_chunks_round_trip,
    nan_bits_survive_under_record_policy,
    rejects_tp_shard_shape_and_commits_nothing,
    verify_names_flipped_byte_and_truncated_shard,
    concurrent_writers_never_lose_a_commit,
    crash_before_commit_leaves_previous_version_and_vacuum_removes_orphan,
    readers_pin_a_version,
    one_sample_takes_one_ranged_read_once_the_footer_is_cached,
    read_rows_returns_only_the_selected_rows_of_a_row_group,
    copy_round_trips_to_another_store,
    bad_input_gets_named_errors,
    commit_refuses_sample_ids_the_head_holds,
    racing_writers_into_a_new_dataset_hold_each_sample_once,
    synth_twice_with_the_same_first_id_adds_nothing_the_second_time,
    commit_refuses_shards_deleted_before_it_lands,
    vacuum_commits_its_version_before_deleting_and_pinned_readers_keep_reading,
    a_writer_stalled_past_the_grace_is_refused_by_name,
    vacuum_starts_over_when_a_commit_lands_before_its_version,
    writers_racing_a_vacuum_loop_lose_no_committed_sample,
    verify_names_a_missing_shard_and_repair_drops_it,
    non_canonical_shard_paths_read_verify_and_survive_vacuum,
    verify_reports_duplicates_and_counts_that_disagree,
    a_manifest_naming_a_shard_twice_is_refused_and_repair_drops_the_repeats,
    reads_hold_the_manifests_row_groups_to_the_file,
    vacuum_deletes_only_the_datasets_own_debris,
    the_root_of_a_bucket_is_refused_as_a_dataset,
    vacuum_never_follows_symbolic_links,
    untrusted_sizes_get_named_errors_not_aborts,
    a_row_claiming_u32_max_tokens_is_refused_by_every_reader,
    format_2_datasets_read_verify_and_take_format_3_commits,
);
