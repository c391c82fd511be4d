//! One capture from start to end, as `hslake capture` runs it: check the model, prepare the
//! job (every input record, the dataset), load the model (pinning the job's host buffers
//! meanwhile), run the job. Everything that can be checked is checked before the (possibly
//! long) load.
use crate::engine::{
    CancelToken, CaptureJob, CaptureSummary, CheckedModel, Engine, EngineOptions, ProgressSink,
};
use crate::error::{CaptureError, Result};

/// A model and one job to run on it.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// The model and how it runs.
    pub engine: EngineOptions,
    /// What to capture and where.
    pub job: CaptureJob,
}

impl CaptureOptions {
    /// Defaults for everything but the four required inputs.
    pub fn new(
        model_dir: std::path::PathBuf,
        input: std::path::PathBuf,
        output: String,
        points: Vec<hslake_schemas::CapturePoint>,
    ) -> Self {
        CaptureOptions {
            engine: EngineOptions::new(model_dir),
            job: CaptureJob::new(input, output, points),
        }
    }
}

/// Runs one capture with no progress reporting and no way to cancel it.
pub async fn capture(opts: CaptureOptions) -> Result<CaptureSummary> {
    capture_with(opts, crate::engine::NoProgress, CancelToken::new()).await
}

/// Runs one capture, reporting to `progress`, until done or `cancel`.
pub async fn capture_with(
    opts: CaptureOptions,
    progress: impl ProgressSink + Send + 'static,
    cancel: CancelToken,
) -> Result<CaptureSummary> {
    tokio::task::spawn_blocking(move || {
        let mut checked = CheckedModel::check(opts.engine)?;
        let points = opts.job.points.len();
        checked.plan(opts.job.max_tokens_per_batch, points)?;
        let prepared = opts.job.prepare(checked.model(), checked.options())?;
        // A sample longer than the batch budget is a batch of its own: plan again for it, so
        // that a streamed placement sizes its memory for the largest batch there is.
        let largest = prepared.largest_batch_tokens();
        if largest > opts.job.max_tokens_per_batch {
            checked.plan(largest, points)?;
        }
        let mut engine = Engine::load_for(checked, &prepared)?;
        engine.run_prepared(prepared, &progress, &cancel)
    })
    .await
    .map_err(|e| CaptureError::Pipeline(format!("capture thread: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{assert_close, values, write_inputs, write_model, TINY_LLAMA};
    use hslake_schemas::{CapturePoint, DType};

    fn options(dir: &std::path::Path, input: &str, out: &str) -> CaptureOptions {
        let url = format!("file://{}", dir.join(out).display());
        let points = vec![CapturePoint::LayerOutput(0), CapturePoint::FinalNorm];
        let mut o = CaptureOptions::new(dir.join("m"), dir.join(input), url, points);
        o.engine.dtype = DType::F32;
        o.job.max_tokens_per_batch = 40;
        o
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tp_two_equals_tp_one_and_resume_writes_only_what_is_missing() {
        let d = tempfile::tempdir().unwrap();
        write_model(&d.path().join("m"), TINY_LLAMA, None);
        write_inputs(&d.path().join("all.jsonl"), 10);
        write_inputs(&d.path().join("first6.jsonl"), 6);

        let one = capture(options(d.path(), "all.jsonl", "tp1"))
            .await
            .unwrap();
        assert_eq!((one.samples, one.skipped_committed), (10, 0));
        let mut o = options(d.path(), "all.jsonl", "tp2");
        o.engine.tp = 2;
        capture(o).await.unwrap();
        let a = values(&options(d.path(), "", "tp1").job.output).await;
        assert_close(&a, &values(&options(d.path(), "", "tp2").job.output).await);

        capture(options(d.path(), "first6.jsonl", "resumed"))
            .await
            .unwrap();
        let refused = capture(options(d.path(), "all.jsonl", "resumed"))
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("pass --resume"), "{refused}");
        let mut o = options(d.path(), "all.jsonl", "resumed");
        o.job.resume = true;
        let rest = capture(o).await.unwrap();
        assert_eq!((rest.samples, rest.skipped_committed), (4, 6));
        assert_close(
            &a,
            &values(&options(d.path(), "", "resumed").job.output).await,
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_fails_the_capture_before_the_dataset_exists() {
        let d = tempfile::tempdir().unwrap();
        write_model(&d.path().join("m"), TINY_LLAMA, None);
        std::fs::write(d.path().join("bad.jsonl"), "{\"input_ids\": [1, 50]}\n").unwrap();
        let e = capture(options(d.path(), "bad.jsonl", "ds"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1: token id 50 at position 1"), "{e}");
        assert!(!d.path().join("ds").exists());
    }
}
