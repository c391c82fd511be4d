//! The engine's streamed half: threads that each stream layers through one device
//! (`stream_worker.rs`), the passes they take from a shared queue, and the checkpoint
//! page-locked in place for their copies. [`Engine`]'s resident half is in `mod.rs`.
use super::*;

impl Engine {
    /// Starts one thread per stream of the checked model's stream plan, each loading the
    /// resident parts and its slots on its device (page-locking the checkpoint's files in place
    /// first, on CUDA); returns once every stream has loaded.
    pub(super) fn spawn_streams(
        checked: CheckedModel,
        first: Option<&PreparedJob>,
    ) -> Result<Engine> {
        let Some(Plan::Stream(plan)) = checked.plan.clone() else {
            return Err(CaptureError::Pipeline("no stream plan to start".into()));
        };
        let t = Instant::now();
        let (report_tx, reports) = mpsc::channel();
        let rank_failed = Arc::new(AtomicBool::new(false));
        let o = &checked.options;
        let cuda = o.device == DeviceKind::Cuda;
        let host = HostBuffers::new(
            cuda,
            checked.split,
            checked.info.hidden_size,
            o.dtype,
            o.queue_depth,
        );
        let mut engine = Engine {
            options: checked.options.clone(),
            info: checked.info.clone(),
            load_secs: 0.0,
            jobs: vec![],
            streams: vec![],
            stream_plan: Some(plan.clone()),
            threads: vec![],
            reports,
            rank_failed: rank_failed.clone(),
            broken: None,
            host,
            _registered: if cuda {
                register(&checked.checkpoint)
            } else {
                vec![]
            },
        };
        for (index, &d) in plan.devices.iter().enumerate() {
            let setup = StreamSetup {
                index,
                config: checked.config.clone(),
                checkpoint: checked.checkpoint.clone(),
                layouts: plan.layouts.clone(),
                device: checked.options.device.device(d),
                kind: checked.kind,
                kernels: checked.options.kernels,
                split: checked.split,
            };
            let (jobs_tx, jobs_rx) = mpsc::channel();
            match stream_worker::spawn(setup, jobs_rx, report_tx.clone(), rank_failed.clone()) {
                Ok(thread) => {
                    engine.streams.push(jobs_tx);
                    engine.threads.push(thread);
                }
                Err(e) => return Err(engine.fail(e)),
            }
        }
        drop((report_tx, checked));
        engine.await_loaded(first, t, "stream")?;
        tracing::info!(
            "loaded {} to stream through {:?} device(s) {:?} in {:.1}s",
            engine.info.architecture,
            engine.options.device,
            plan.devices,
            engine.load_secs
        );
        Ok(engine)
    }

    /// Feeds `job`'s passes to whichever stream is free and waits for the streams; their
    /// reports of each pass go to `progress` as they come. The times are the slowest stream's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_streams<'s>(
        &self,
        scope: &'s std::thread::Scope<'s, '_>,
        job: &PreparedJob,
        host: SyncSender<HostBatch>,
        pool: Option<BufferPool>,
        summary: &mut CaptureSummary,
        stop: Stop<'_>,
        progress: &'s dyn ProgressSink,
    ) -> Ran {
        let pass_tokens = self.stream_plan.as_ref().map_or(1, |p| p.pass_tokens);
        let (pass_tx, pass_rx) = mpsc::sync_channel(self.streams.len());
        let pool = pool.map(|p| Arc::new(Mutex::new(p)));
        let (report_tx, report_rx) = mpsc::channel::<PassReport>();
        scope.spawn(move || {
            for r in report_rx {
                progress.pass_done(&r);
            }
        });
        let dispatched = self.dispatch_streams(job, host, pool.clone(), pass_rx, report_tx);
        let outcome = match dispatched == self.streams.len() {
            true => feed_passes(
                job,
                pass_tokens,
                &pass_tx,
                summary,
                stop.cancel,
                stop.writers_failed,
                &self.rank_failed,
            ),
            false => Feed::Stopped,
        };
        drop(pass_tx);
        let (by_stream, errors) = self.await_ranks(dispatched, |event| match event {
            RankEvent::JobDone(t, _) => Ok(t),
            _ => Err(CaptureError::Pipeline(
                "a stream answered out of turn".into(),
            )),
        });
        Ran {
            dispatched,
            outcome,
            errors,
            times: by_stream
                .iter()
                .flatten()
                .fold(RankTimes::default(), |a, t| a.max(t)),
            // Every stream is done with the pool: it is the engine's again.
            pool: pool
                .and_then(|p| Arc::try_unwrap(p).ok())
                .and_then(|m| m.into_inner().ok()),
        }
    }

    /// Host buffer sets the streams hold beyond the queue: each stream's pass and the one
    /// before it, whose batches the writers may still be encoding (none for ranks).
    pub(super) fn held_sets(&self, job: &PreparedJob) -> usize {
        let Some(plan) = &self.stream_plan else {
            return 0;
        };
        let most = group_passes(&job.padded_tokens(), plan.pass_tokens)
            .iter()
            .map(|p| p.len())
            .max()
            .unwrap_or(0);
        2 * most * self.streams.len()
    }

    /// Gives every stream the job, sharing one pass queue; returns how many took it.
    pub(super) fn dispatch_streams(
        &self,
        job: &PreparedJob,
        host: SyncSender<HostBatch>,
        pool: Option<Arc<Mutex<BufferPool>>>,
        passes: Receiver<Vec<Arc<PaddedBatch>>>,
        reports: Sender<PassReport>,
    ) -> usize {
        let passes = Arc::new(Mutex::new(passes));
        self.streams
            .iter()
            .take_while(|queue| {
                let work = StreamJob {
                    points: job.job.points.clone(),
                    passes: passes.clone(),
                    host: host.clone(),
                    pool: pool.clone(),
                    reports: reports.clone(),
                };
                queue.send(work).is_ok()
            })
            .count()
    }
}

/// Page-locks every file of `checkpoint` in place, read-only, so that streams copy layers from
/// it at the link's full speed; where the platform refuses (a file larger than the memory that
/// may be locked, say), copies come from pageable memory instead, slower, and a warning says so.
pub(crate) fn register(checkpoint: &crate::checkpoint::Checkpoint) -> Vec<HostRegistration> {
    let t = Instant::now();
    let mut done = vec![];
    let mut bytes = 0usize;
    for (path, map) in checkpoint.mapped_files() {
        // SAFETY: the mapping is the checkpoint's, which every stream holds (an `Arc`) until
        // it ends; the engine drops these registrations only after joining the streams.
        match unsafe { HostRegistration::read_only(map.as_ptr(), map.len()) } {
            Ok(r) => {
                done.push(r);
                bytes += map.len();
            }
            Err(e) => {
                tracing::warn!(
                    "cannot page-lock {} in place ({e}); its layers are copied from pageable memory, \
                     several times slower",
                    path.display()
                );
            }
        }
    }
    tracing::info!(
        "page-locked {:.2} GB of checkpoint files in place in {:.2}s",
        bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    done
}
