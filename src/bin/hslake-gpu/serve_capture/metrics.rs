//! The daemon's counters and gauges, served at `/metrics` in the OpenMetrics text format
//! (which Prometheus scrapes and its text parsers read). Counters are fed by the same events
//! and summaries the job API reports, so the two always agree.
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::state::JobState;

/// Every metric of the daemon.
pub struct Metrics {
    registry: Registry,
    /// Samples written to datasets.
    pub samples: Counter,
    /// Tokens of the samples written.
    pub tokens: Counter,
    /// Versions committed by the writers.
    pub commits: Counter,
    /// Seconds each commit took.
    pub commit_seconds: Histogram,
    /// Uncompressed tensor bytes written.
    pub raw_bytes: Counter,
    /// Shard bytes written.
    pub stored_bytes: Counter,
    /// Seconds rank 0 spent in the forward (added when a job run ends).
    pub forward_seconds: Counter<f64, AtomicU64>,
    /// Seconds rank 0 waited for the writers (added when a job run ends).
    pub storage_wait_seconds: Counter<f64, AtomicU64>,
    /// Jobs waiting for the engine.
    pub queue_depth: Gauge,
    /// Jobs by state.
    pub jobs: Family<Vec<(String, String)>, Gauge>,
    /// 1 once the model is loaded and the ranks are alive.
    pub ready: Gauge,
    /// Layer-streamed passes run, by stream.
    pub passes: Family<StreamLabel, Counter>,
    /// The last streamed pass of each stream, one gauge per figure its log line gives.
    pub last_pass: Family<PassFigure, Gauge<f64, AtomicU64>>,
}

/// The label of a stream's metrics: its index into `--devices`.
pub type StreamLabel = Vec<(String, String)>;
/// The labels of one figure of a stream's last pass: the stream and the figure's name.
pub type PassFigure = Vec<(String, String)>;

impl Metrics {
    /// Registers every metric under the `hslake_capture_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hslake_capture");
        let m = Metrics {
            registry: Registry::default(),
            samples: Counter::default(),
            tokens: Counter::default(),
            commits: Counter::default(),
            // 1 ms to about 65 s.
            commit_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            raw_bytes: Counter::default(),
            stored_bytes: Counter::default(),
            forward_seconds: Counter::default(),
            storage_wait_seconds: Counter::default(),
            queue_depth: Gauge::default(),
            jobs: Family::default(),
            ready: Gauge::default(),
            passes: Family::default(),
            last_pass: Family::default(),
        };
        registry.register("samples", "Samples written to datasets", m.samples.clone());
        registry.register("tokens", "Tokens of the samples written", m.tokens.clone());
        registry.register("commits", "Dataset versions committed", m.commits.clone());
        registry.register(
            "commit_seconds",
            "Seconds each commit took (manifest put-if-absent with its retries)",
            m.commit_seconds.clone(),
        );
        registry.register(
            "raw_bytes",
            "Uncompressed tensor bytes written",
            m.raw_bytes.clone(),
        );
        registry.register(
            "stored_bytes",
            "Shard bytes written (counted as shards are closed)",
            m.stored_bytes.clone(),
        );
        registry.register(
            "forward_seconds",
            "Seconds rank 0 spent in the forward and device-to-host copies",
            m.forward_seconds.clone(),
        );
        registry.register(
            "storage_wait_seconds",
            "Seconds rank 0 waited because the writers' queue was full",
            m.storage_wait_seconds.clone(),
        );
        registry.register(
            "queue_depth",
            "Jobs waiting for the engine",
            m.queue_depth.clone(),
        );
        registry.register("jobs", "Jobs by state", m.jobs.clone());
        registry.register(
            "ready",
            "1 once the model is loaded and its ranks are alive",
            m.ready.clone(),
        );
        registry.register(
            "stream_passes",
            "Layer-streamed passes run, by stream",
            m.passes.clone(),
        );
        registry.register(
            "stream_last_pass",
            "The last layer-streamed pass of each stream: tokens, layers, copy_gb_per_second, \
             compute_seconds, hidden_share (of the copy time, behind compute), \
             first_sample_seconds, seconds",
            m.last_pass.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts a streamed pass and sets its stream's last-pass gauges.
    pub fn pass_done(&self, p: &hslake_capture::PassReport) {
        let stream = p.stream.to_string();
        self.passes
            .get_or_create(&vec![("stream".to_string(), stream.clone())])
            .inc();
        let figures = [
            ("tokens", p.tokens as f64),
            ("layers", p.layers as f64),
            ("copy_gb_per_second", p.copy_gb_per_sec),
            ("compute_seconds", p.compute_secs),
            ("hidden_share", p.hidden_share),
            ("first_sample_seconds", p.first_sample_secs),
            ("seconds", p.secs),
        ];
        for (name, value) in figures {
            let labels = vec![
                ("stream".to_string(), stream.clone()),
                ("figure".to_string(), name.to_string()),
            ];
            self.last_pass.get_or_create(&labels).set(value);
        }
    }

    /// Sets the jobs-by-state gauges and the queue depth from `states`.
    pub fn set_jobs(&self, states: impl Iterator<Item = JobState>) {
        let mut counts = [0i64; JobState::ALL.len()];
        for s in states {
            if let Some(i) = JobState::ALL.iter().position(|a| *a == s) {
                counts[i] += 1;
            }
        }
        for (s, n) in JobState::ALL.iter().zip(counts) {
            self.jobs
                .get_or_create(&vec![("state".to_string(), s.name().to_string())])
                .set(n);
        }
        self.queue_depth.set(counts[0]);
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_jobs_by_state() {
        let m = Metrics::new();
        m.samples.inc_by(3);
        m.forward_seconds.inc_by(1.5);
        m.set_jobs([JobState::Queued, JobState::Queued, JobState::Done].into_iter());
        let text = m.render();
        for line in [
            "hslake_capture_samples_total 3",
            "hslake_capture_forward_seconds_total 1.5",
            "hslake_capture_queue_depth 2",
            "hslake_capture_jobs{state=\"queued\"} 2",
            "hslake_capture_jobs{state=\"done\"} 1",
            "hslake_capture_jobs{state=\"failed\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }
}
