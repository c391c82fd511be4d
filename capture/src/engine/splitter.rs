//! From batches to samples: each host batch is cut into its samples' real tokens (views, no
//! copy), and each sample goes to the least-loaded writer, which encodes it in place in
//! parallel with the others.
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
    /// Runs `encode` on this sample as a store sample (`hidden` wide, stored as `dtype`) whose
    /// tensors are read in place from the batch's host buffers, then releases this sample's
    /// hold on those buffers. No copy: at real sizes copying each sample out first cost the
    /// writers a third of their memory traffic.
    pub fn encode_in_place<R>(
        self,
        dtype: DType,
        hidden: usize,
        encode: impl FnOnce(&Sample<HostRows>) -> Result<R>,
    ) -> Result<R> {
        let SampleRows { input, rows, lease } = self;
        let len = input.input_ids.len();
        let tensors = rows
            .into_iter()
            .map(|rows| {
                Ok(TensorData {
                    dtype,
                    shape: vec![len, hidden],
                    data: HostRows::new(rows, dtype)?,
                    scales: None,
                })
            })
            .collect::<Result<Vec<_>>>();
        let InputSample {
            sample_id,
            input_ids,
            loss_mask,
        } = input;
        let result = tensors.and_then(|tensors| {
            encode(&Sample {
                sample_id,
                input_ids,
                loss_mask,
                tensors,
            })
        });
        // The views are gone with the sample: the buffers may be written again.
        if let Some(lease) = &lease {
            lease.release();
        }
        result
    }
}

/// One sample's rows of one captured state, a contiguous CPU tensor (a view into the batch's
/// host buffer), read as its bytes.
pub(super) struct HostRows(Tensor);

impl HostRows {
    /// `rows` as bytes of `dtype` (made contiguous if they are a strided view); refuses a
    /// tensor whose bytes are not that (on a GPU, of another element size).
    fn new(rows: Tensor, dtype: DType) -> Result<Self> {
        let elem = rows.kind().elt_size_in_bytes();
        if rows.device() != tch::Device::Cpu || elem != dtype.size() {
            return Err(CaptureError::Pipeline(format!(
                "a sample's captured rows must be a CPU tensor of {}-byte elements ({dtype}); \
                 got {:?} {:?} on {:?}",
                dtype.size(),
                rows.kind(),
                rows.size(),
                rows.device()
            )));
        }
        Ok(HostRows(if rows.is_contiguous() {
            rows
        } else {
            rows.f_contiguous()?
        }))
    }
}

impl AsRef<[u8]> for HostRows {
    fn as_ref(&self) -> &[u8] {
        let len = self.0.numel() * self.0.kind().elt_size_in_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: `new` made sure that the tensor is contiguous, on the CPU and of this element
        // size, so its `numel` elements are `len` initialised bytes at `data_ptr`. The memory
        // is the tensor's own storage or the batch's pinned buffer; both outlive `self`: the
        // tensor holds its storage, and the lease on a pinned buffer is released only after
        // the sample holding this is dropped (`encode_in_place`).
        unsafe { std::slice::from_raw_parts(self.0.data_ptr() as *const u8, len) }
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
