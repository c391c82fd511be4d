//! The pipeline: plan → ranged row-group reads (bounded, ahead of use) → batch assembly on a
//! bounded set of blocking threads → an ordered, bounded queue of ready batches.
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use hslake_schemas::{CapturePoint, DatasetSchema};
use hslake_store::{Dataset, DatasetReader, Manifest};
use tokio::sync::{mpsc, Semaphore};

use crate::batch::{assemble, Assembly, Batcher};
use crate::plan::{EpochPlan, Mode, Part, Unit};
use crate::points::resolve_points;
use crate::prefetch::Prefetch;
use crate::rowgroup::{from_batch, needed_columns, RowGroupData};
use crate::schedule::Schedule;
use crate::stream::{BatchStream, Msg};
use crate::{
    CorruptPolicy, LoaderConfig, LoaderError, LoaderState, LoaderStats, Resolved, ShuffleMode,
};

/// A loader over one pinned dataset version: opens the dataset, checks the configuration
/// against it, and starts [`BatchStream`]s from any [`LoaderState`].
pub struct Loader {
    inner: Arc<Inner>,
}

struct Inner {
    dataset: Dataset,
    reader: DatasetReader,
    config: LoaderConfig,
    /// What the checked configuration runs by.
    run: Resolved,
    version: u64,
    aux: Vec<CapturePoint>,
    target: CapturePoint,
    columns: Vec<String>,
    stats: Arc<LoaderStats>,
}

/// Run a storage call under the configured time limit.
async fn timed<T, F>(
    limit: Duration,
    what: impl Fn() -> String,
    url: &str,
    fut: F,
) -> Result<T, LoaderError>
where
    F: Future<Output = Result<T, hslake_store::StoreError>>,
{
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(LoaderError::from),
        Err(_) => Err(LoaderError::Timeout {
            what: what(),
            seconds: limit.as_secs_f64(),
            hint: endpoint_hint(url),
        }),
    }
}

fn endpoint_hint(url: &str) -> String {
    if url.starts_with("s3") {
        match std::env::var("AWS_ENDPOINT").or_else(|_| std::env::var("AWS_ENDPOINT_URL")) {
            Ok(e) => format!("{url} via AWS_ENDPOINT={e}"),
            Err(_) => format!("{url} via AWS S3 (AWS_ENDPOINT is not set)"),
        }
    } else {
        url.to_string()
    }
}

impl Loader {
    /// Open a dataset (`file://`, `s3://`, `memory://` or a path) for loading.
    pub async fn open(url: &str, config: LoaderConfig) -> Result<Self, LoaderError> {
        let run = config.check()?;
        let limit = run.io_timeout;
        let dataset = timed(limit, || format!("opening {url}"), url, Dataset::open(url)).await?;
        let reader = timed(
            limit,
            || format!("reading the manifest of {url}"),
            url,
            DatasetReader::open(&dataset, config.version),
        )
        .await?;
        let manifest = reader.manifest();
        let version = manifest.version;
        let schema = &manifest.schema;
        let (aux, target) = resolve_points(dataset.url(), schema, &config)?;
        if aux.is_empty() {
            tracing::warn!("loader: no auxiliary layers: aux_hidden_states will have width 0");
        }
        let columns = needed_columns(schema.dtype, &aux, target);
        tracing::info!(
            "loader: {} version {version}: {} samples, {} tokens in {} shards; rank {}/{}; aux [{}], target {}; shuffle: {}",
            dataset.url(),
            manifest.num_samples(),
            manifest.num_tokens(),
            manifest.shards.len(),
            config.rank,
            config.world_size,
            aux.iter().map(|p| p.column()).collect::<Vec<_>>().join(", "),
            target.column(),
            match (config.shuffle, config.shuffle_mode) {
                (false, _) => "off".to_string(),
                (true, ShuffleMode::Window) => {
                    format!("window of {} row groups", config.shuffle_window)
                }
                (true, ShuffleMode::Sample) => format!(
                    "per sample, lookaheads of {:.1} MiB",
                    config.lookahead_bytes as f64 / (1u64 << 20) as f64
                ),
            }
        );
        Ok(Loader {
            inner: Arc::new(Inner {
                dataset,
                reader,
                config,
                run,
                version,
                aux,
                target,
                columns,
                stats: Default::default(),
            }),
        })
    }

    /// The pinned version.
    pub fn version(&self) -> u64 {
        self.inner.version
    }

    /// The pinned manifest.
    pub fn manifest(&self) -> &Manifest {
        self.inner.reader.manifest()
    }

    /// The dataset schema.
    pub fn schema(&self) -> &DatasetSchema {
        self.inner.reader.schema()
    }

    /// The configuration.
    pub fn config(&self) -> &LoaderConfig {
        &self.inner.config
    }

    /// The auxiliary points, in the order they are concatenated.
    pub fn aux_points(&self) -> &[CapturePoint] {
        &self.inner.aux
    }

    /// The target point.
    pub fn target_point(&self) -> CapturePoint {
        self.inner.target
    }

    /// Counters.
    pub fn stats(&self) -> &LoaderStats {
        &self.inner.stats
    }

    /// The state at the start of epoch 0.
    pub fn initial_state(&self) -> LoaderState {
        LoaderState::start(&self.inner.config, self.inner.version, 0)
    }

    /// Samples this reader visits per epoch of the pinned version (after padding or dropping).
    pub fn samples_per_epoch(&self) -> u64 {
        // The length does not depend on the order, and an unkeyed plan holds no permutation
        // (a sample-shuffled one holds 8 bytes a sample).
        let c = &self.inner.config;
        EpochPlan::new(
            units_of(self.manifest(), None),
            None,
            Mode::Window(1),
            self.inner.part(),
            c.remainder(),
        )
        .len()
    }

    /// Start streaming batches from `state` (which must come from this configuration); must be
    /// called inside a tokio runtime, whose threads run the reads.
    pub fn stream(&self, state: &LoaderState) -> Result<BatchStream, LoaderError> {
        state.check_matches(&self.inner.config, self.inner.version)?;
        let (tx, rx) = mpsc::channel(self.inner.config.prefetch_batches);
        let inner = self.inner.clone();
        let start = state.clone();
        let driver = tokio::spawn(async move {
            let tx2 = tx.clone();
            if let Err(e) = inner.drive(start, tx).await {
                let _ = tx2.send(Msg::Error(e)).await;
            }
        });
        Ok(BatchStream::new(rx, driver, state.clone()))
    }
}

/// Units of a manifest's shards, leaving out shards whose paths are in `exclude`.
fn units_of(m: &Manifest, exclude: Option<&Manifest>) -> Vec<Unit> {
    let old: std::collections::HashSet<&str> = exclude
        .map(|e| e.shards.iter().map(|s| s.path.as_str()).collect())
        .unwrap_or_default();
    let mut units = Vec::new();
    for (shard, s) in m.shards.iter().enumerate() {
        if old.contains(s.path.as_str()) {
            continue;
        }
        let row_bytes = s.raw_bytes / s.rows.max(1);
        for (row_group, &rows) in s.row_groups.iter().enumerate() {
            units.push(Unit {
                shard,
                row_group,
                rows,
                row_bytes,
            });
        }
    }
    units
}

impl Inner {
    /// Who reads: this configuration's rank and worker.
    fn part(&self) -> Part {
        let c = &self.config;
        Part {
            rank: c.rank,
            world_size: c.world_size,
            worker: c.worker,
            num_workers: c.num_workers,
        }
    }

    fn plan(&self, units: Vec<Unit>, epoch: u64, segment: u64) -> EpochPlan {
        let c = &self.config;
        let part = self.part();
        let mode = match c.shuffle_mode {
            ShuffleMode::Window => Mode::Window(c.shuffle_window),
            ShuffleMode::Sample => Mode::Sample,
        };
        EpochPlan::new(
            units,
            c.shuffle.then_some([c.seed, epoch, segment]),
            mode,
            part,
            c.remainder(),
        )
    }

    fn url(&self) -> &str {
        self.dataset.url()
    }

    /// The reader and units of one segment: the pinned version whole, or a later version's
    /// newly added shards.
    async fn segment(&self, seg: u64) -> Result<(DatasetReader, Vec<Unit>), LoaderError> {
        if seg == self.version {
            return Ok((self.reader.clone(), units_of(self.reader.manifest(), None)));
        }
        let limit = self.run.io_timeout;
        let url = self.url();
        let reader = timed(
            limit,
            || format!("reading version {seg} of {url}"),
            url,
            DatasetReader::open(&self.dataset, Some(seg)),
        )
        .await?;
        let prev = timed(
            limit,
            || format!("reading version {} of {url}", seg - 1),
            url,
            self.dataset.manifest(Some(seg - 1)),
        )
        .await?;
        let units = units_of(reader.manifest(), Some(&prev));
        Ok((reader, units))
    }

    /// Wait for version `next` to be committed; `false` after the idle timeout.
    async fn wait_for_version(&self, next: u64) -> Result<bool, LoaderError> {
        let Some(f) = self.run.follow else {
            return Ok(false);
        };
        let since = Instant::now();
        let url = self.url();
        loop {
            let latest = timed(
                self.run.io_timeout,
                || format!("listing versions of {url}"),
                url,
                self.dataset.latest_version(),
            )
            .await?;
            if latest >= next {
                return Ok(true);
            }
            if f.idle_timeout.is_some_and(|t| since.elapsed() >= t) {
                tracing::info!(
                    "loader: no new version of {url} for {:.1} s; ending the pass",
                    since.elapsed().as_secs_f64()
                );
                return Ok(false);
            }
            tokio::time::sleep(f.poll_interval).await;
        }
    }

    async fn drive(
        self: Arc<Self>,
        mut state: LoaderState,
        tx: mpsc::Sender<Msg>,
    ) -> Result<(), LoaderError> {
        loop {
            let (reader, units) = self.segment(state.segment_version).await?;
            let plan = self.plan(units, state.epoch, state.segment_version);
            if !self
                .run_segment(&plan, Arc::new(reader), &state, &tx)
                .await?
            {
                return Ok(());
            }
            state.position = plan.len();
            if self.run.follow.is_none() {
                let next = LoaderState::start(&self.config, self.version, state.epoch + 1);
                let _ = tx.send(Msg::End(next)).await;
                return Ok(());
            }
            if !self.wait_for_version(state.segment_version + 1).await? {
                let _ = tx.send(Msg::End(state)).await;
                return Ok(());
            }
            state.segment_version += 1;
            state.position = 0;
            tracing::info!(
                "loader: following {}: reading the shards new in version {}",
                self.url(),
                state.segment_version
            );
        }
    }

    /// Stream one segment's batches from `state.position`; `false` if the consumer went away.
    async fn run_segment(
        self: &Arc<Self>,
        plan: &EpochPlan,
        reader: Arc<DatasetReader>,
        state: &LoaderState,
        tx: &mpsc::Sender<Msg>,
    ) -> Result<bool, LoaderError> {
        let c = &self.config;
        let from = state.position;
        let sched = Schedule::new(plan, from, c)?;
        let schema = reader.schema().clone();
        let units = plan.units().to_vec();
        let me = self.clone();
        let rd = reader.clone();
        let depth = sched.depth(plan, c.prefetch_row_groups);
        let Schedule {
            reads,
            uses,
            assign,
        } = sched;
        let loads = futures::stream::iter(reads.into_iter().enumerate())
            .map(move |(i, read)| {
                let me = me.clone();
                let rd = rd.clone();
                let unit = units[read.unit];
                tokio::spawn(async move { (i, read.unit, me.load(&rd, unit, read.rows).await) })
            })
            .buffered(depth);
        let mut prefetch =
            Prefetch::new(loads, uses, plan.units(), c.on_corrupt, self.stats.clone());

        let spec = Assembly {
            layout: c.layout(),
            truncate: c.truncate_to(),
            pad_multiple: c.pad_to_multiple_of,
            pad_token_id: c.pad_token_id,
            hidden: schema.hidden_size,
            dtype: schema.dtype,
        };
        let mut batcher = Batcher::new(self.run.batching, &spec);
        let spec = Arc::new(spec);
        let pool = Arc::new(Semaphore::new(c.decode_threads));
        let mut position = from;

        let emit = |rows: Vec<(Arc<RowGroupData>, usize)>, position: u64| {
            let spec = spec.clone();
            let pool = pool.clone();
            let stats = self.stats.clone();
            let st = LoaderState {
                position,
                ..state.clone()
            };
            let tx = tx.clone();
            async move {
                let Ok(permit) = pool.acquire_owned().await else {
                    return false;
                };
                let h = tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    stats.batches.fetch_add(1, Ordering::Relaxed);
                    assemble(&spec, &rows, st)
                });
                tx.send(Msg::Batch(h)).await.is_ok()
            }
        };

        for (i, pick) in plan.picks_from(from).enumerate() {
            let (read, row) = assign.of(i, pick);
            let usable = prefetch.get(read).await?.filter(|g| match g.refusal(row) {
                Some(e) => {
                    tracing::warn!("loader: skipping 1 sample: {e}");
                    false
                }
                None => true,
            });
            match usable {
                Some(g) => {
                    let len = g.seq_len(row);
                    if let Some(done) = batcher.push((g, row), len) {
                        if !emit(done, position).await {
                            return Ok(false);
                        }
                    }
                }
                None => {
                    self.stats.samples_skipped.fetch_add(1, Ordering::Relaxed);
                }
            }
            position += 1;
            prefetch.used(read);
            if let Some(done) = batcher.full() {
                if !emit(done, position).await {
                    return Ok(false);
                }
            }
        }
        if let Some(last) = batcher.rest(c.drop_last_batch) {
            if !emit(last, plan.len()).await {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Read and decode one row group: every row, or only `rows` (ascending).
    async fn load(
        &self,
        reader: &DatasetReader,
        unit: Unit,
        rows: Option<Vec<usize>>,
    ) -> Result<RowGroupData, LoaderError> {
        let path = reader
            .manifest()
            .shards
            .get(unit.shard)
            .map(|s| s.path.clone())
            .unwrap_or_default();
        let schema = reader.schema();
        let cols = Some(self.columns.as_slice());
        let fut = async {
            match &rows {
                None => {
                    reader
                        .read_row_group(unit.shard, unit.row_group, cols)
                        .await
                }
                Some(r) => reader.read_rows(unit.shard, unit.row_group, r, cols).await,
            }
        };
        let batch = match tokio::time::timeout(self.run.io_timeout, fut).await {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                return Err(LoaderError::Shard {
                    path,
                    row_group: unit.row_group,
                    message: e.to_string(),
                });
            }
            Err(_) => {
                return Err(LoaderError::Timeout {
                    what: format!("reading {path} row group {}", unit.row_group),
                    seconds: self.run.io_timeout.as_secs_f64(),
                    hint: endpoint_hint(self.url()),
                })
            }
        };
        self.stats.row_groups_read.fetch_add(1, Ordering::Relaxed);
        let data = from_batch(
            &batch,
            &path,
            unit.row_group,
            schema.dtype,
            schema.hidden_size,
            &self.aux,
            self.target,
            self.config.on_corrupt == CorruptPolicy::Skip,
            rows.as_deref(),
        )?;
        // The store held the file's row groups to the manifest's and the rows decoded to the
        // footer's (`check_row_groups`), so the row group has the rows its unit was planned with.
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use hslake_schemas::{bf16_bits_to_f32, f32_to_bf16_bits, DType, Sample, TensorData};
    use hslake_store::{DatasetWriter, Provenance, WriterOptions};

    use super::*;
    use crate::{Batch, HostTensor, Layout, Remainder};

    const H: usize = 8;

    fn points() -> Vec<CapturePoint> {
        vec![
            CapturePoint::LayerOutput(0),
            CapturePoint::LayerOutput(1),
            CapturePoint::LayerOutput(2),
        ]
    }

    /// The value every test expects at (sample, point, token, hidden index).
    fn value(id: u64, p: usize, t: usize, h: usize) -> u16 {
        f32_to_bf16_bits(id as f32 + p as f32 * 0.25 + t as f32 * 0.01 + h as f32 * 0.001)
    }

    fn seq_len(id: u64) -> usize {
        3 + (id as usize * 7) % 9
    }

    fn sample(id: u64) -> Sample {
        let n = seq_len(id);
        let tensors = (0..3)
            .map(|p| {
                let bits: Vec<u16> = (0..n * H).map(|i| value(id, p, i / H, i % H)).collect();
                TensorData::from_bf16_bits(&bits, vec![n, H])
            })
            .collect();
        Sample {
            sample_id: id,
            input_ids: (0..n).map(|t| (id as i32 * 10 + t as i32) % 1000).collect(),
            loss_mask: (0..n).map(|t| (t % 2) as u8).collect(),
            tensors,
        }
    }

    fn small_shards() -> WriterOptions {
        WriterOptions {
            shard_target_bytes: 3000,
            row_group_target_bytes: 700,
            ..Default::default()
        }
    }

    /// A dataset with samples `0..n` in one committed version.
    async fn make(url: &str, n: u64) -> Dataset {
        let schema =
            DatasetSchema::new("m", "LlamaForCausalLM", H, 3, 1000, DType::Bf16, points()).unwrap();
        let ds = Dataset::create(url, schema, Provenance::default())
            .await
            .unwrap();
        append(&ds, &[0..n, n..n]).await;
        ds
    }

    /// Append and commit each range of ids (an empty range commits nothing).
    async fn append(ds: &Dataset, commits: &[std::ops::Range<u64>]) {
        let mut w = DatasetWriter::new(ds, small_shards()).await.unwrap();
        for r in commits {
            for id in r.clone() {
                w.append(&sample(id)).await.unwrap();
            }
            w.commit().await.unwrap();
        }
    }

    fn cfg(batch: usize) -> LoaderConfig {
        LoaderConfig {
            batch_size: Some(batch),
            seed: 3,
            shuffle_window: 2,
            ..Default::default()
        }
    }

    async fn collect(
        l: &Loader,
        state: &LoaderState,
        max_batches: Option<usize>,
    ) -> (Vec<Batch>, LoaderState) {
        let mut s = l.stream(state).unwrap();
        let mut out = vec![];
        while max_batches.is_none_or(|m| out.len() < m) {
            match s.next().await {
                Some(b) => out.push(b.unwrap()),
                None => break,
            }
        }
        (out, s.state().clone())
    }

    fn ids(batches: &[Batch]) -> Vec<u64> {
        batches.iter().flat_map(|b| b.sample_ids.clone()).collect()
    }

    /// Each shuffle mode, the sample one with lookaheads of a few samples (these samples hold
    /// about 340 raw bytes), so that an epoch spans many lookaheads.
    fn modes(c: LoaderConfig) -> [LoaderConfig; 2] {
        [
            c.clone(),
            LoaderConfig {
                shuffle_mode: ShuffleMode::Sample,
                lookahead_bytes: 2000,
                ..c
            },
        ]
    }

    #[tokio::test]
    async fn one_epoch_yields_every_sample_once_in_shuffled_order() {
        make("memory://l-epoch", 40).await;
        for c in modes(cfg(6)) {
            one_epoch_in_shuffled_order(c).await;
        }
    }

    async fn one_epoch_in_shuffled_order(c: LoaderConfig) {
        let l = Loader::open("memory://l-epoch", c).await.unwrap();
        assert!(
            l.manifest().shards.len() > 1 && l.manifest().shards[0].row_groups.len() > 1,
            "test needs several units"
        );
        let (b, next) = collect(&l, &l.initial_state(), None).await;
        let got = ids(&b);
        assert_eq!(
            got.iter().copied().collect::<BTreeSet<_>>(),
            (0..40).collect()
        );
        assert_eq!(got.len(), 40);
        assert_ne!(got, (0..40).collect::<Vec<_>>(), "shuffled");
        assert_eq!((next.epoch, next.position), (1, 0));
        let (b1, _) = collect(&l, &next, None).await;
        assert_ne!(ids(&b1), got, "epoch 1 has another order");
        let (again, _) = collect(&l, &l.initial_state(), None).await;
        assert_eq!(
            ids(&again),
            got,
            "the same (seed, epoch) gives the same order"
        );
    }

    #[tokio::test]
    async fn ranks_are_disjoint_and_cover_the_dataset() {
        make("memory://l-ranks", 41).await;
        for base in modes(cfg(4)) {
            for (rem, expect_len) in [(Remainder::Drop, 40usize), (Remainder::Pad, 42)] {
                let mut all = vec![];
                for rank in 0..2 {
                    let c = LoaderConfig {
                        rank,
                        world_size: 2,
                        drop_last: rem == Remainder::Drop,
                        ..base.clone()
                    };
                    let l = Loader::open("memory://l-ranks", c).await.unwrap();
                    let (b, _) = collect(&l, &l.initial_state(), None).await;
                    assert_eq!(ids(&b).len() as u64, l.samples_per_epoch());
                    all.push(ids(&b));
                }
                let a: BTreeSet<u64> = all[0].iter().copied().collect();
                let b: BTreeSet<u64> = all[1].iter().copied().collect();
                let mode = base.shuffle_mode;
                assert_eq!(all[0].len() + all[1].len(), expect_len, "{mode:?} {rem:?}");
                match rem {
                    Remainder::Drop => {
                        assert!(a.is_disjoint(&b), "{mode:?}");
                        assert_eq!(a.union(&b).count(), 40, "{mode:?}");
                    }
                    _ => assert_eq!(
                        a.union(&b).copied().collect::<BTreeSet<_>>(),
                        (0..41).collect(),
                        "{mode:?}"
                    ),
                }
            }
        }
    }

    #[tokio::test]
    async fn sample_mode_ranks_and_workers_together_read_every_sample_once() {
        make("memory://l-workers", 43).await;
        for (rem, world) in [
            (Remainder::Drop, 3usize),
            (Remainder::Pad, 3),
            (Remainder::Pad, 2),
        ] {
            let mut all = vec![];
            for rank in 0..world {
                let mut rank_ids = vec![];
                for worker in 0..3 {
                    let c = LoaderConfig {
                        rank,
                        world_size: world,
                        worker,
                        num_workers: 3,
                        drop_last: rem == Remainder::Drop,
                        ..modes(cfg(2))[1].clone()
                    };
                    let l = Loader::open("memory://l-workers", c).await.unwrap();
                    let (b, _) = collect(&l, &l.initial_state(), None).await;
                    assert_eq!(ids(&b).len() as u64, l.samples_per_epoch());
                    rank_ids.extend(ids(&b));
                }
                let whole = LoaderConfig {
                    rank,
                    world_size: world,
                    drop_last: rem == Remainder::Drop,
                    ..modes(cfg(2))[1].clone()
                };
                let l = Loader::open("memory://l-workers", whole).await.unwrap();
                let (b, _) = collect(&l, &l.initial_state(), None).await;
                assert_eq!(
                    rank_ids,
                    ids(&b),
                    "workers split their rank's order exactly"
                );
                all.extend(rank_ids);
            }
            let set: BTreeSet<u64> = all.iter().copied().collect();
            match rem {
                Remainder::Drop => {
                    assert_eq!(set.len(), all.len(), "{rem:?} {world}: nothing twice");
                    assert_eq!(all.len(), 43 - 43 % world);
                }
                Remainder::Pad => {
                    assert_eq!(set, (0..43).collect(), "{rem:?} {world}: everything");
                    assert_eq!(all.len(), 43usize.div_ceil(world) * world);
                }
            }
        }
    }

    #[tokio::test]
    async fn resuming_mid_epoch_continues_exactly() {
        make("memory://l-resume", 37).await;
        // (batch_size, max_tokens): by samples, then by a token budget.
        for (batching, base) in [(Some(5), None), (None, Some(40))]
            .into_iter()
            .flat_map(|b| modes(cfg(1)).map(|c| (b, c)))
        {
            let c = LoaderConfig {
                batch_size: batching.0,
                max_tokens: batching.1,
                decode_threads: 3,
                prefetch_batches: 2,
                ..base
            };
            let l = Loader::open("memory://l-resume", c.clone()).await.unwrap();
            let (whole, _) = collect(&l, &l.initial_state(), None).await;
            let (first, state) = collect(&l, &l.initial_state(), Some(3)).await;
            // A fresh loader, as another process would build, from the JSON state.
            let l2 = Loader::open("memory://l-resume", c.clone()).await.unwrap();
            let restored = LoaderState::from_json(&state.to_json()).unwrap();
            let (rest, _) = collect(&l2, &restored, None).await;
            let joined: Vec<Vec<u64>> = first
                .iter()
                .chain(&rest)
                .map(|b| b.sample_ids.clone())
                .collect();
            let expect: Vec<Vec<u64>> = whole.iter().map(|b| b.sample_ids.clone()).collect();
            assert_eq!(joined, expect, "{batching:?} {:?}", c.shuffle_mode);
        }
    }

    #[tokio::test]
    async fn sample_mode_resumes_exactly_from_every_position_inside_a_lookahead() {
        make("memory://l-resume-any", 23).await;
        let c = LoaderConfig {
            lookahead_bytes: 3000,
            ..modes(cfg(1))[1].clone()
        };
        let l = Loader::open("memory://l-resume-any", c.clone())
            .await
            .unwrap();
        let (whole, _) = collect(&l, &l.initial_state(), None).await;
        let whole = ids(&whole);
        for k in [1usize, 4, 9, 10, 17, 22] {
            let (first, state) = collect(&l, &l.initial_state(), Some(k)).await;
            assert_eq!(state.position, k as u64);
            let l2 = Loader::open("memory://l-resume-any", c.clone())
                .await
                .unwrap();
            let restored = LoaderState::from_json(&state.to_json()).unwrap();
            let (rest, _) = collect(&l2, &restored, None).await;
            let mut joined = ids(&first);
            joined.extend(ids(&rest));
            assert_eq!(joined, whole, "resumed after {k}");
        }
    }

    #[tokio::test]
    async fn sample_mode_reads_only_the_picked_rows_once_per_lookahead() {
        make("memory://l-reads", 40).await;
        let units = |l: &Loader| -> u64 {
            l.manifest()
                .shards
                .iter()
                .map(|s| s.row_groups.len() as u64)
                .sum()
        };
        // One lookahead holding the whole epoch: each row group read once.
        let c = LoaderConfig {
            lookahead_bytes: 1 << 30,
            ..modes(cfg(4))[1].clone()
        };
        let l = Loader::open("memory://l-reads", c.clone()).await.unwrap();
        let (b, _) = collect(&l, &l.initial_state(), None).await;
        assert_eq!(ids(&b).len(), 40);
        assert_eq!(l.stats().row_groups_read.load(Ordering::Relaxed), units(&l));
        // A lookahead of one sample: one read per sample.
        let c = LoaderConfig {
            lookahead_bytes: 1,
            ..c
        };
        let l = Loader::open("memory://l-reads", c).await.unwrap();
        let (b2, _) = collect(&l, &l.initial_state(), None).await;
        assert_eq!(ids(&b2), ids(&b), "the lookahead does not change the order");
        assert_eq!(l.stats().row_groups_read.load(Ordering::Relaxed), 40);
    }

    #[tokio::test]
    async fn sample_mode_values_equal_the_window_modes_for_every_sample() {
        make("memory://l-same-values", 30).await;
        let by_id = |bs: &[Batch]| -> HashMap<u64, Vec<u8>> {
            let mut out = HashMap::new();
            for b in bs {
                let t = b.field("aux_hidden_states").unwrap();
                let row = t.bytes().len() / b.sample_ids.len();
                let per_token = row / t.shape[1];
                for (i, &id) in b.sample_ids.iter().enumerate() {
                    out.insert(
                        id,
                        t.bytes()[i * row..i * row + b.seq_lens[i] * per_token].to_vec(),
                    );
                }
            }
            out
        };
        let [w, s] = modes(cfg(4));
        let lw = Loader::open("memory://l-same-values", w).await.unwrap();
        let ls = Loader::open("memory://l-same-values", s).await.unwrap();
        let (bw, _) = collect(&lw, &lw.initial_state(), None).await;
        let (bs, _) = collect(&ls, &ls.initial_state(), None).await;
        assert_ne!(ids(&bw), ids(&bs));
        assert_eq!(by_id(&bw), by_id(&bs));
        assert_eq!(by_id(&bs).len(), 30);
    }

    #[tokio::test]
    async fn token_budget_is_never_exceeded() {
        make("memory://l-tokens", 30).await;
        for layout in [Layout::Padded, Layout::Packed] {
            let c = LoaderConfig {
                batch_size: None,
                max_tokens: Some(24),
                packed: layout == Layout::Packed,
                ..cfg(1)
            };
            let l = Loader::open("memory://l-tokens", c).await.unwrap();
            let (b, _) = collect(&l, &l.initial_state(), None).await;
            assert_eq!(ids(&b).len(), 30);
            for x in &b {
                let shape = &x.field("input_ids").unwrap().shape;
                assert!(shape[0] * shape[1] <= 24, "{layout:?} {shape:?}");
                assert!(x.seq_lens.iter().all(|&n| n <= 24));
            }
        }
    }

    fn bf16_at(t: &HostTensor, i: usize) -> u16 {
        u16::from_le_bytes([t.bytes()[2 * i], t.bytes()[2 * i + 1]])
    }

    #[tokio::test]
    async fn padded_batch_holds_the_stored_values_with_aux_in_configured_order() {
        make("memory://l-values", 12).await;
        let aux = vec![CapturePoint::LayerOutput(1), CapturePoint::LayerOutput(0)];
        let c = LoaderConfig {
            aux_layers: Some(aux),
            max_seq_len: Some(6),
            pad_token_id: -1,
            ..cfg(4)
        };
        let l = Loader::open("memory://l-values", c).await.unwrap();
        assert_eq!(l.target_point(), CapturePoint::LayerOutput(2));
        let (batches, _) = collect(&l, &l.initial_state(), None).await;
        for b in &batches {
            let ids_t = b.field("input_ids").unwrap();
            let (bsz, t) = (ids_t.shape[0], ids_t.shape[1]);
            let aux = b.field("aux_hidden_states").unwrap();
            let tgt = b.field("target_hidden_states").unwrap();
            assert_eq!(aux.shape, vec![bsz, t, 2 * H]);
            assert_eq!(aux.dtype, crate::ElemType::Bf16);
            let ids_v = ids_t.to_i64_vec();
            let mask = b.field("attention_mask").unwrap().to_i64_vec();
            let pos = b.field("position_ids").unwrap().to_i64_vec();
            for (i, &id) in b.sample_ids.iter().enumerate() {
                let n = seq_len(id).min(6);
                assert_eq!(b.seq_lens[i], n);
                for tok in 0..t {
                    let real = tok < n;
                    assert_eq!(mask[i * t + tok], real as i64);
                    let want_id = if real {
                        (id as i64 * 10 + tok as i64) % 1000
                    } else {
                        -1
                    };
                    assert_eq!(ids_v[i * t + tok], want_id);
                    assert_eq!(pos[i * t + tok], if real { tok as i64 } else { 0 });
                    for h in 0..H {
                        let a0 = bf16_at(aux, (i * t + tok) * 2 * H + h);
                        let a1 = bf16_at(aux, (i * t + tok) * 2 * H + H + h);
                        let g = bf16_at(tgt, (i * t + tok) * H + h);
                        if real {
                            assert_eq!(
                                (a0, a1, g),
                                (
                                    value(id, 1, tok, h),
                                    value(id, 0, tok, h),
                                    value(id, 2, tok, h)
                                )
                            );
                        } else {
                            assert_eq!((a0, a1, g), (0, 0, 0), "padding is zero");
                        }
                    }
                }
            }
        }
        assert!(bf16_bits_to_f32(value(3, 1, 2, 1)) > 3.0);
    }

    #[tokio::test]
    async fn packed_batch_has_cu_seqlens_document_ids_and_restarting_positions() {
        make("memory://l-packed", 9).await;
        let c = LoaderConfig {
            packed: true,
            shuffle: false,
            ..cfg(3)
        };
        let l = Loader::open("memory://l-packed", c).await.unwrap();
        let (batches, _) = collect(&l, &l.initial_state(), None).await;
        let b = &batches[0];
        assert_eq!(b.sample_ids, vec![0, 1, 2]);
        let lens: Vec<usize> = (0..3).map(seq_len).collect();
        let total: usize = lens.iter().sum();
        assert_eq!(b.field("input_ids").unwrap().shape, vec![1, total]);
        assert!(b.field("attention_mask").is_none());
        let cu = b.field("cu_seqlens").unwrap().to_i32_vec();
        assert_eq!(
            cu,
            vec![0, lens[0] as i32, (lens[0] + lens[1]) as i32, total as i32]
        );
        let docs = b.field("document_ids").unwrap().to_i64_vec();
        let pos = b.field("position_ids").unwrap().to_i64_vec();
        assert_eq!(docs[lens[0]], 1);
        assert_eq!(pos[lens[0]], 0);
        assert_eq!(pos[lens[0] - 1], lens[0] as i64 - 1);
        let tgt = b.field("target_hidden_states").unwrap();
        assert_eq!(bf16_at(tgt, (lens[0] + 1) * H + 3), value(1, 2, 1, 3));
    }

    #[tokio::test]
    async fn follow_mode_reads_new_versions_without_repeating() {
        let ds = make("memory://l-follow", 10).await;
        let c = LoaderConfig {
            follow: true,
            poll_interval: 0.02,
            follow_idle_timeout: Some(1.5),
            ..cfg(4)
        };
        let l = Loader::open("memory://l-follow", c).await.unwrap();
        let mut s = l.stream(&l.initial_state()).unwrap();
        let mut got = vec![];
        // Take the first batch, then commit two more versions while the stream is running.
        got.extend(s.next().await.unwrap().unwrap().sample_ids);
        append(&ds, &[10..17, 17..20]).await;
        while let Some(b) = s.next().await {
            got.extend(b.unwrap().sample_ids);
        }
        let set: BTreeSet<u64> = got.iter().copied().collect();
        assert_eq!(set.len(), got.len(), "nothing repeated");
        assert_eq!(set, (0..20).collect());
        assert_eq!(s.state().segment_version, l.version() + 2);
        // Resuming at the end waits for another version, sees none, and yields nothing.
        let (more, _) = collect(&l, &s.state().clone(), None).await;
        assert!(more.is_empty());
    }

    #[tokio::test]
    async fn rejects_missing_layer_bad_rank_and_unknown_version() {
        make("memory://l-bad", 3).await;
        let c = LoaderConfig {
            aux_layers: Some(vec![CapturePoint::LayerOutput(7)]),
            ..cfg(2)
        };
        let err = Loader::open("memory://l-bad", c)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("has no layer_7") && err.contains("layer_0, layer_1, layer_2"),
            "{err}"
        );
        let c = LoaderConfig {
            target: Some(CapturePoint::FinalNorm),
            ..cfg(2)
        };
        assert!(Loader::open("memory://l-bad", c)
            .await
            .err()
            .unwrap()
            .to_string()
            .contains("final_norm"));
        let c = LoaderConfig {
            rank: 3,
            world_size: 2,
            ..cfg(2)
        };
        assert!(Loader::open("memory://l-bad", c)
            .await
            .err()
            .unwrap()
            .to_string()
            .contains("rank 3"));
        let c = LoaderConfig {
            version: Some(99),
            ..cfg(2)
        };
        let err = Loader::open("memory://l-bad", c)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("99"), "{err}");
    }

    #[tokio::test]
    async fn resume_state_of_another_rank_is_refused() {
        make("memory://l-mismatch", 3).await;
        let a = Loader::open(
            "memory://l-mismatch",
            LoaderConfig {
                world_size: 2,
                ..cfg(2)
            },
        )
        .await
        .unwrap();
        let b = Loader::open(
            "memory://l-mismatch",
            LoaderConfig {
                world_size: 2,
                rank: 1,
                ..cfg(2)
            },
        )
        .await
        .unwrap();
        let err = b.stream(&a.initial_state()).err().unwrap().to_string();
        assert!(err.contains("rank = 0"), "{err}");
    }

    /// Overwrite the first 200 bytes after the magic of the first shard file (its first row
    /// group's first column chunks, `sample_id` among them) with garbage. In files this small
    /// the footer and page index are most of the file, so a spot in the middle may miss the data.
    fn corrupt_first_shard(dir: &std::path::Path, l: &Loader) -> String {
        let rel = l.manifest().shards[0].path.clone();
        let file = dir.join(&rel);
        let mut bytes = std::fs::read(&file).unwrap();
        for b in &mut bytes[4..204] {
            *b ^= 0x5a;
        }
        std::fs::write(&file, bytes).unwrap();
        rel
    }

    #[tokio::test]
    async fn a_hidden_size_far_beyond_the_data_is_a_named_error_not_an_abort() {
        let dir = std::env::temp_dir().join(format!("hslake-loader-huge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("file://{}", dir.display());
        let ds = make(&url, 6).await;
        let m = ds.manifest(None).await.unwrap();
        let mut json: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        json["version"] = (m.version + 1).into();
        json["schema"]["hidden_size"] = (1u64 << 40).into();
        std::fs::write(
            dir.join(hslake_store::manifest_path(m.version + 1)),
            serde_json::to_vec(&json).unwrap(),
        )
        .unwrap();
        // Either refused at open or when the first row group is decoded; never sized from it.
        let err = match Loader::open(&url, cfg(2)).await {
            Err(e) => e.to_string(),
            Ok(l) => {
                let mut s = l.stream(&l.initial_state()).unwrap();
                s.next().await.expect("a result").unwrap_err().to_string()
            }
        };
        assert!(err.contains("1099511627776"), "{err}");
    }

    #[tokio::test]
    async fn corrupt_shard_errors_naming_the_file_or_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        make(&url, 30).await;
        let c = LoaderConfig {
            shuffle: false,
            shuffle_window: 1,
            ..cfg(4)
        };
        let l = Loader::open(&url, c.clone()).await.unwrap();
        let rel = corrupt_first_shard(dir.path(), &l);
        let mut s = l.stream(&l.initial_state()).unwrap();
        let mut err = None;
        while let Some(b) = s.next().await {
            if let Err(e) = b {
                err = Some(e.to_string());
            }
        }
        let err = err.expect("a corrupt shard is an error by default");
        assert!(err.contains(&rel), "{err}");

        let l = Loader::open(
            &url,
            LoaderConfig {
                on_corrupt: CorruptPolicy::Skip,
                ..c
            },
        )
        .await
        .unwrap();
        let (b, _) = collect(&l, &l.initial_state(), None).await;
        let skipped = l.stats().samples_skipped.load(Ordering::Relaxed);
        assert!(skipped > 0 && l.stats().row_groups_skipped.load(Ordering::Relaxed) > 0);
        assert_eq!(ids(&b).len() as u64 + skipped, 30);
    }

    /// Unshuffled window order, and the sample order (shuffled: unshuffled it is the window's).
    fn corrupt_cases() -> [LoaderConfig; 2] {
        let c = LoaderConfig {
            shuffle: false,
            shuffle_window: 1,
            ..cfg(4)
        };
        [
            c.clone(),
            LoaderConfig {
                shuffle: true,
                shuffle_mode: ShuffleMode::Sample,
                lookahead_bytes: 2000,
                ..c
            },
        ]
    }

    /// Every batch of one epoch in each of [`corrupt_cases`], read before anything is corrupted.
    async fn clean_runs(url: &str) -> Vec<Vec<Batch>> {
        let mut clean = vec![];
        for c in corrupt_cases() {
            let l = Loader::open(url, c).await.unwrap();
            clean.push(collect(&l, &l.initial_state(), None).await.0);
        }
        clean
    }

    /// The first error an epoch streams, if any.
    async fn first_error(l: &Loader) -> Option<String> {
        let mut s = l.stream(&l.initial_state()).unwrap();
        while let Some(b) = s.next().await {
            if let Err(e) = b {
                return Some(e.to_string());
            }
        }
        None
    }

    #[tokio::test]
    async fn a_flipped_byte_in_a_tensor_value_fails_naming_file_row_group_and_sample_or_is_skipped()
    {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        make(&url, 30).await;
        let clean = clean_runs(&url).await;
        let l = Loader::open(&url, corrupt_cases()[0].clone())
            .await
            .unwrap();
        let shard = &l.manifest().shards[0];
        let (rel, victim) = (shard.path.clone(), shard.min_sample_id + 1);
        let flip = hslake_store::tools::corrupt::flip_value_byte(
            &dir.path().join(&rel),
            "layer_1",
            2,
            victim,
        )
        .unwrap();
        for (c, clean) in corrupt_cases().into_iter().zip(clean) {
            let mode = c.shuffle_mode;
            let l = Loader::open(&url, c.clone()).await.unwrap();
            // The file still parses; the value's checksum (or its frames) give it away.
            let err = first_error(&l)
                .await
                .expect("a flipped value is an error by default");
            // The row of its row group, also where only some rows of it were read.
            let site = format!(
                "{rel}: row group {}: row {} (sample {victim}) layer_1: ",
                flip.row_group, flip.row
            );
            assert!(err.contains(&site), "{mode:?}: {site} not in: {err}");

            // Skipped: that sample alone is left out and counted, every other sample (also
            // those of its row group) is as before.
            let l = Loader::open(
                &url,
                LoaderConfig {
                    on_corrupt: CorruptPolicy::Skip,
                    ..c
                },
            )
            .await
            .unwrap();
            let (b, _) = collect(&l, &l.initial_state(), None).await;
            assert!(l.manifest().shards[0].row_groups[flip.row_group] > 1);
            assert_eq!(l.stats().samples_skipped.load(Ordering::Relaxed), 1);
            assert_eq!(l.stats().row_groups_skipped.load(Ordering::Relaxed), 0);
            let kept = ids(&b);
            let clean_ids: Vec<u64> = ids(&clean).into_iter().filter(|&i| i != victim).collect();
            assert_eq!(
                kept, clean_ids,
                "{mode:?}: the other samples come in the same order"
            );
            // Each sample's own tokens of the padded [B, T, H] target, by sample id.
            let tensors = |bs: &[Batch]| -> HashMap<u64, Vec<u8>> {
                let mut out = HashMap::new();
                for b in bs {
                    let t = b.field("target_hidden_states").unwrap();
                    let row = t.bytes().len() / b.sample_ids.len();
                    let per_token = row / t.shape[1];
                    for (i, &id) in b.sample_ids.iter().enumerate() {
                        let own = &t.bytes()[i * row..i * row + b.seq_lens[i] * per_token];
                        out.insert(id, own.to_vec());
                    }
                }
                out
            };
            let (before, after) = (tensors(&clean), tensors(&b));
            for id in &kept {
                assert_eq!(before[id], after[id], "{mode:?} sample {id}");
            }
        }
    }

    #[tokio::test]
    async fn a_row_whose_seq_len_disagrees_with_its_tokens_is_refused_by_name() {
        use hslake_store::tools::corrupt::{claim_seq_len, rewrite_shard};
        let url = "memory://loader-seq-len-max";
        let ds = make(url, 30).await;
        let victim = ds.manifest(None).await.unwrap().shards[0].min_sample_id;
        rewrite_shard(&ds, 0, claim_seq_len(victim, u32::MAX))
            .await
            .unwrap();
        for c in corrupt_cases() {
            let l = Loader::open(url, c).await.unwrap();
            let err = first_error(&l).await.expect("the row is refused");
            let want =
                format!("(sample {victim}) seq_len: seq_len 4294967295, but input_ids holds");
            assert!(err.contains(&want), "{err}");
        }
    }

    #[tokio::test]
    async fn a_flipped_byte_in_input_ids_fails_naming_file_row_group_and_sample_or_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}", dir.path().display());
        make(&url, 30).await;
        let clean = clean_runs(&url).await;
        let l = Loader::open(&url, corrupt_cases()[0].clone())
            .await
            .unwrap();
        let rel = l.manifest().shards[0].path.clone();
        // A bit in the zstd-compressed input_ids pages that still decompresses, to other ids.
        let flip = hslake_store::tools::corrupt::flip_token_byte(&dir.path().join(&rel)).unwrap();
        for (c, clean) in corrupt_cases().into_iter().zip(clean) {
            let mode = c.shuffle_mode;
            let l = Loader::open(&url, c.clone()).await.unwrap();
            let err = first_error(&l)
                .await
                .expect("a flipped token is an error by default");
            let site = format!(
                "{rel}: row group {}: row {} (sample {}) input_ids/loss_mask: corrupt tokens: ",
                flip.row_group, flip.row, flip.sample_id
            );
            assert!(err.contains(&site), "{mode:?}: {site} not in: {err}");

            // Skipped by policy: the row group is left out and counted once, the rest is as
            // before.
            let l = Loader::open(
                &url,
                LoaderConfig {
                    on_corrupt: CorruptPolicy::Skip,
                    ..c
                },
            )
            .await
            .unwrap();
            let (b, _) = collect(&l, &l.initial_state(), None).await;
            let kept = ids(&b);
            assert!(!kept.contains(&flip.sample_id), "{mode:?}");
            assert_eq!(
                l.stats().row_groups_skipped.load(Ordering::Relaxed),
                1,
                "{mode:?}"
            );
            let clean_ids: Vec<u64> = ids(&clean)
                .into_iter()
                .filter(|i| kept.contains(i))
                .collect();
            assert_eq!(kept, clean_ids, "{mode:?}");
            match mode {
                // The whole row group is left out.
                ShuffleMode::Window => {
                    let rows = l.manifest().shards[0].row_groups[flip.row_group];
                    assert_eq!(l.stats().samples_skipped.load(Ordering::Relaxed), rows);
                    assert_eq!(kept.len() as u64 + rows, 30);
                }
                // Only reads that selected the corrupt row fail: the lookaheads that picked other
                // rows of that row group read them without it.
                ShuffleMode::Sample => {
                    let skipped = l.stats().samples_skipped.load(Ordering::Relaxed);
                    assert!(skipped >= 1, "{skipped}");
                    assert_eq!(kept.len() as u64 + skipped, 30);
                }
            }
        }
    }
}
