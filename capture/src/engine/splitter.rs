//! From batches to samples: each host batch is cut into its samples' real tokens (views, no
//! copy), and each sample goes to the least-loaded writer, which encodes it in place in
//! parallel with the others.
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use hslake_schemas::{DType, Sample, TensorData, TensorStats};
use tch::Tensor;

use super::host::{BatchLease, HostBatch};
use super::progress::RankTimes;
use super::progress::{CancelToken, ProgressSink};
use crate::error::{CaptureError, Result};
use crate::gpu::cuda::PinnedBuffer;
use crate::gpu::plane_split::{sample_stats, SplitLayout};
use crate::input::InputSample;

/// One sample on its way to a writer: views of its real tokens in the batch's host tensors.
pub(super) struct SampleRows {
    input: InputSample,
    rows: Vec<Tensor>,
    /// Where rank 0 split the states: their planes' statistics, one per tensor.
    split_stats: Option<Vec<TensorStats>>,
    lease: Option<Arc<BatchLease>>,
}

impl SampleRows {
    /// Runs `encode` on this sample as a store sample (`hidden` wide, stored as `dtype`) whose
    /// tensors are read in place from the batch's host buffers, with the statistics of its
    /// tensors where rank 0 split them into planes (the tensors' bytes are then those planes),
    /// then releases this sample's hold on those buffers. No copy: at real sizes copying each
    /// sample out first cost the writers a third of their memory traffic.
    pub fn encode_in_place<R>(
        self,
        dtype: DType,
        hidden: usize,
        encode: impl FnOnce(&Sample<HostRows>, Option<Vec<TensorStats>>) -> Result<R>,
    ) -> Result<R> {
        let SampleRows {
            input,
            rows,
            split_stats,
            lease,
        } = self;
        let len = input.input_ids.len();
        let split = split_stats.is_some();
        let tensors = rows
            .into_iter()
            .map(|rows| {
                Ok(TensorData {
                    dtype,
                    shape: vec![len, hidden],
                    data: HostRows::new(rows, dtype, split)?,
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
            let sample = Sample {
                sample_id,
                input_ids,
                loss_mask,
                tensors,
            };
            encode(&sample, split_stats)
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
    /// `rows` as bytes of `dtype`, or of its planes where `split` (made contiguous if they are
    /// a strided view); refuses a tensor whose bytes are not that (on a GPU, of another element
    /// size).
    fn new(rows: Tensor, dtype: DType, split: bool) -> Result<Self> {
        let elem = rows.kind().elt_size_in_bytes();
        let want = if split { 1 } else { dtype.size() };
        if rows.device() != tch::Device::Cpu || elem != want {
            return Err(CaptureError::Pipeline(format!(
                "a sample's captured rows must be a CPU tensor of {want}-byte elements ({dtype}{}); \
                 got {:?} {:?} on {:?}",
                if split { " split into planes" } else { "" },
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

/// Slot `i`'s sample of `len` tokens in split states: a view of its planes in each, and its
/// tensors' statistics from their token rows'.
fn sample_planes(
    states: &[Tensor],
    layout: SplitLayout,
    i: usize,
    len: usize,
) -> Result<(Vec<Tensor>, Option<Vec<TensorStats>>)> {
    let mut rows = Vec::with_capacity(states.len());
    let mut stats = Vec::with_capacity(states.len());
    for st in states {
        let planes = layout.planes(i, len);
        rows.push(st.f_narrow(0, planes.start as i64, planes.len() as i64)?);
        let at = layout.stats(i, len);
        let mut bytes = vec![0u8; at.len()];
        st.f_narrow(0, at.start as i64, at.len() as i64)?
            .f_copy_data_u8(&mut bytes, at.len())?;
        stats.push(sample_stats(&bytes));
    }
    Ok((rows, Some(stats)))
}

/// Splits every batch from `rx` into samples for `writers`, until rank 0 closes the queue
/// (or is given up for lost: `ranks_lost`); returns the time the batches reported.
/// `hidden`: the width of every state.
pub(super) fn split_batches(
    rx: Receiver<HostBatch>,
    hidden: usize,
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
            split,
            buffers,
            times,
        } = hb;
        let layout = SplitLayout {
            rows: input.rows as usize,
            cols: input.cols as usize,
            hidden,
        };
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
            let (rows, split_stats) = if split {
                sample_planes(&states, layout, i, len)?
            } else {
                // [b, t, hidden] -> this sample's real tokens [len, hidden] (contiguous rows).
                let rows = states
                    .iter()
                    .map(|st| Ok(st.f_select(0, i as i64)?.f_narrow(0, 0, len as i64)?))
                    .collect::<Result<Vec<_>>>()?;
                (rows, None)
            };
            // The least-loaded writer (by tokens) gets it, so compression spreads evenly.
            let w = (0..writers.len()).min_by_key(|&w| load[w]).unwrap_or(0);
            load[w] += len as u64;
            let item = SampleRows {
                input: s.clone(),
                rows,
                split_stats,
                lease: lease.clone(),
            };
            writers[w]
                .send(item)
                .map_err(|_| CaptureError::Pipeline("a store writer stopped early".into()))?;
        }
    }
    Ok(reported)
}
