//! What a capture job did, and its printed form.

/// What a capture run did.
#[derive(Debug, Clone, Default)]
pub struct CaptureSummary {
    /// The dataset.
    pub dataset: String,
    /// Samples written by this run.
    pub samples: u64,
    /// Tokens written by this run.
    pub tokens: u64,
    /// Samples skipped because an earlier run had committed them (`--resume`).
    pub skipped_committed: u64,
    /// Samples cut to `--max-seq-len`.
    pub truncated: u64,
    /// Samples left out for exceeding `--max-seq-len`.
    pub skipped_overlong: u64,
    /// Samples left out for NaN/Inf (writer finite policy skip).
    pub skipped_nonfinite: u64,
    /// Forward batches run.
    pub batches: u64,
    /// Padding tokens computed and discarded.
    pub padding_tokens: u64,
    /// Uncompressed tensor bytes written.
    pub raw_bytes: u64,
    /// Shard bytes written.
    pub written_bytes: u64,
    /// Newest committed version after the run.
    pub version: u64,
    /// Seconds the engine spent loading the model (before this job, for a reused engine).
    pub load_secs: f64,
    /// Seconds rank 0 spent computing (forward and device-to-host copies).
    pub compute_secs: f64,
    /// Seconds rank 0 was blocked because the writers' queue was full.
    pub storage_wait_secs: f64,
    /// Seconds from the first batch to the last commit.
    pub run_secs: f64,
    /// Whether the job was cancelled: what it wrote is committed, the rest is not captured.
    pub cancelled: bool,
}

impl CaptureSummary {
    /// Raw tensor bytes per stored byte.
    pub fn compression_ratio(&self) -> f64 {
        if self.written_bytes == 0 {
            return 0.0;
        }
        self.raw_bytes as f64 / self.written_bytes as f64
    }
}

impl std::fmt::Display for CaptureSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tps = if self.run_secs > 0.0 {
            self.tokens as f64 / self.run_secs
        } else {
            0.0
        };
        let busy = self.compute_secs + self.storage_wait_secs;
        let wait_pct = if busy > 0.0 {
            100.0 * self.storage_wait_secs / busy
        } else {
            0.0
        };
        writeln!(
            f,
            "capture summary for {} (now at version {})",
            self.dataset, self.version
        )?;
        if self.cancelled {
            writeln!(
                f,
                "  cancelled         what was captured is committed; --resume captures the rest"
            )?;
        }
        writeln!(
            f,
            "  samples written   {} ({} tokens, {:.0} tokens/s over {:.1}s)",
            self.samples, self.tokens, tps, self.run_secs
        )?;
        writeln!(
            f,
            "  skipped           {} already committed, {} longer than --max-seq-len, {} non-finite; {} truncated",
            self.skipped_committed, self.skipped_overlong, self.skipped_nonfinite, self.truncated
        )?;
        writeln!(
            f,
            "  bytes             {} raw -> {} stored (compression {:.2}x)",
            self.raw_bytes,
            self.written_bytes,
            self.compression_ratio()
        )?;
        writeln!(
            f,
            "  batches           {} ({} padding tokens)",
            self.batches, self.padding_tokens
        )?;
        write!(
            f,
            "  time              load {:.1}s, compute {:.1}s, waiting on storage {:.1}s ({:.1}% of the forward loop)",
            self.load_secs, self.compute_secs, self.storage_wait_secs, wait_pct
        )
    }
}
