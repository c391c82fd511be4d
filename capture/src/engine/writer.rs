//! One store writer thread: encodes (compresses) the samples it is given, appends them to its
//! shard and commits under the job's commit policy; a last commit when its queue closes.
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use hslake_schemas::DType;
use hslake_store::{Appended, Dataset, DatasetWriter, WriterOptions};

use super::commit::CommitPolicy;
use super::progress::ProgressSink;
use super::splitter::SampleRows;
use crate::error::Result;

/// What one writer did.
#[derive(Debug, Default)]
pub(super) struct WriterDone {
    /// Samples written.
    pub samples: u64,
    /// Tokens written.
    pub tokens: u64,
    /// Uncompressed tensor bytes.
    pub raw_bytes: u64,
    /// Shard bytes.
    pub written_bytes: u64,
    /// Samples skipped under the finite policy.
    pub skipped: u64,
    /// The last version it committed.
    pub last_version: Option<u64>,
}

/// How a writer stores its samples.
pub(super) struct WriterSetup<'a> {
    /// Runs the store's async calls.
    pub io: &'a tokio::runtime::Handle,
    /// The dataset.
    pub dataset: &'a Dataset,
    /// Shard layout and compression.
    pub options: WriterOptions,
    /// When to commit.
    pub policy: CommitPolicy,
    /// Stored dtype of every tensor.
    pub dtype: DType,
    /// Width of every tensor.
    pub hidden: usize,
}

/// Writes everything `rx` delivers until it closes, then commits a last time.
pub(super) fn run_writer(
    setup: WriterSetup,
    rx: Receiver<SampleRows>,
    progress: &dyn ProgressSink,
) -> Result<WriterDone> {
    let io = setup.io;
    let mut w = io.block_on(DatasetWriter::new(setup.dataset, setup.options))?;
    let mut last_version = None;
    let mut pending = 0u64;
    let mut last_commit = Instant::now();
    // Byte counts already reported to `progress`, so each report is the growth since.
    let mut reported = (0u64, 0u64);
    let mut report_bytes = |w: &DatasetWriter| {
        let s = w.stats();
        let (raw, stored) = (s.raw_bytes, s.written_bytes);
        if (raw, stored) != reported {
            progress.bytes_written(raw - reported.0, stored - reported.1);
            reported = (raw, stored);
        }
    };
    let commit = |w: &mut DatasetWriter, last_version: &mut Option<u64>| -> Result<()> {
        let t = Instant::now();
        let committed = io.block_on(w.commit())?;
        if let Some(v) = committed {
            progress.commit_took(t.elapsed().as_secs_f64());
            progress.committed(v);
            *last_version = Some(v);
        }
        Ok(())
    };
    loop {
        match rx.recv_timeout(setup.policy.wait(last_commit.elapsed())) {
            Ok(rows) => {
                let (tokens, encoded) =
                    rows.encode_in_place(setup.dtype, setup.hidden, |sample, split_stats| {
                        let encoded = match split_stats {
                            Some(stats) => w.encode_split(sample, stats)?,
                            None => w.encode(sample)?,
                        };
                        Ok((sample.input_ids.len() as u64, encoded))
                    })?;
                if io.block_on(w.append_encoded(encoded))? == Appended::Written {
                    pending += 1;
                }
                report_bytes(&w);
                progress.sample_done(tokens);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if setup.policy.due(pending, last_commit.elapsed()) {
            commit(&mut w, &mut last_version)?;
            report_bytes(&w);
            pending = 0;
            last_commit = Instant::now();
        } else if pending == 0 && last_commit.elapsed() >= setup.policy.interval {
            // Nothing to commit: restart the clock rather than wake every millisecond.
            last_commit = Instant::now();
        }
    }
    commit(&mut w, &mut last_version)?;
    report_bytes(&w);
    let s = w.stats();
    Ok(WriterDone {
        samples: s.samples,
        tokens: s.tokens,
        raw_bytes: s.raw_bytes,
        written_bytes: s.written_bytes,
        skipped: s.skipped,
        last_version,
    })
}
