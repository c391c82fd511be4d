//! From batches to samples: each host batch is cut into its samples' real tokens (views, no
//! copy), and each sample goes to the least-loaded writer, which copies it out in parallel
//! with the others.
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use hslake_schemas::{DType, Sample, TensorData};
use tch::Tensor;

use super::host::{BatchLease, HostBatch};
use super::progress::{CancelToken, ProgressSink};
use super::rank::RankTimes;
use crate::cuda::PinnedBuffer;
use crate::error::{CaptureError, Result};
use crate::input::InputSample;

/// One sample on its way to a writer: views of its real tokens in the batch's host tensors.
pub(super) struct SampleRows {
    input: InputSample,
    rows: Vec<Tensor>,
    lease: Option<Arc<BatchLease>>,
}

impl SampleRows {
    /// Copies the rows out into a store sample (`hidden` wide, stored as `dtype`) and releases
    /// this sample's hold on the batch's buffers.
    pub fn into_sample(self, dtype: DType, hidden: usize) -> Result<Sample> {
        let len = self.input.input_ids.len();
        let tensors = self
            .rows
            .iter()
            .map(|rows| -> Result<TensorData> {
                let n = rows.numel();
                let mut data = vec![0u8; n * dtype.size()];
                rows.f_copy_data_u8(&mut data, n)?;
                Ok(TensorData {
                    dtype,
                    shape: vec![len, hidden],
                    data,
                    scales: None,
                })
            })
            .collect::<Result<Vec<_>>>();
        drop(self.rows);
        if let Some(lease) = &self.lease {
            lease.release();
        }
        let InputSample {
            sample_id,
            input_ids,
            loss_mask,
        } = self.input;
        Ok(Sample {
            sample_id,
            input_ids,
            loss_mask,
            tensors: tensors?,
        })
    }
}

/// Splits every batch from `rx` into samples for `writers`, until rank 0 closes the queue
/// (or is given up for lost: `ranks_lost`); returns the time the batches reported.
pub(super) fn split_batches(
    rx: Receiver<HostBatch>,
    ranks_lost: &CancelToken,
    writers: Vec<SyncSender<SampleRows>>,
    recycle: Sender<Vec<PinnedBuffer>>,
    progress: &dyn ProgressSink,
) -> Result<RankTimes> {
    let mut load = vec![0u64; writers.len()];
    let mut reported = RankTimes::default();
    loop {
        let hb = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(hb) => hb,
            Err(RecvTimeoutError::Timeout) if ranks_lost.is_cancelled() => break,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let HostBatch {
            input,
            states,
            buffers,
            times,
        } = hb;
        progress.forward_progress(
            times.compute.as_secs_f64(),
            times.storage_wait.as_secs_f64(),
        );
        reported.compute += times.compute;
        reported.storage_wait += times.storage_wait;
        let lease =
            buffers.map(|b| Arc::new(BatchLease::new(input.samples.len(), b, recycle.clone())));
        for (i, s) in input.samples.iter().enumerate() {
            let len = s.input_ids.len();
            // [b, t, hidden] -> this sample's real tokens [len, hidden] (contiguous rows).
            let rows = states
                .iter()
                .map(|st| Ok(st.f_select(0, i as i64)?.f_narrow(0, 0, len as i64)?))
                .collect::<Result<Vec<_>>>()?;
            // The least-loaded writer (by tokens) gets it, so compression spreads evenly.
            let w = (0..writers.len()).min_by_key(|&w| load[w]).unwrap_or(0);
            load[w] += len as u64;
            let item = SampleRows {
                input: s.clone(),
                rows,
                lease: lease.clone(),
            };
            writers[w]
                .send(item)
                .map_err(|_| CaptureError::Pipeline("a store writer stopped early".into()))?;
        }
    }
    Ok(reported)
}
