//! Two layer slots on one device and the copies that fill them: while a layer computes from
//! one slot, the next layer's stored bytes are copied into the other. On a GPU the copies run
//! on a side stream, ordered against libtorch's stream by events (a slot is refilled only once
//! the compute that read it is done; a layer runs only once its copy is done), so the host never
//! waits; on the CPU the copy is a plain memcpy.
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::layout::LayerLayout;
use super::source::StagedSource;
use crate::checkpoint::Checkpoint;
use crate::error::{CaptureError, Result};
use crate::gpu::cuda::{CopyStream, Event};

/// What one slot holds.
struct Slot {
    /// The bytes, on the device.
    bytes: Tensor,
    /// The layer copied (or being copied) into it.
    layer: Option<usize>,
    /// Recorded on the copy stream after the layer's copy (CUDA).
    copied: Option<Event>,
    /// Recorded on libtorch's stream once the compute reading the slot is queued (CUDA).
    free: Option<Event>,
}

/// A layer copy begun: its slot and how many of its tensors are queued.
struct Pending {
    slot: usize,
    layer: usize,
    queued: usize,
    total: usize,
}

/// Time and bytes of the copies a pass made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CopyTotals {
    /// Bytes copied to the device.
    pub bytes: u64,
    /// Seconds the copies took (on the copy stream; on the CPU, of the memcpys).
    pub secs: f64,
}

/// Two slots and the copies into them, for one device.
pub(crate) struct Slots {
    checkpoint: Arc<Checkpoint>,
    layouts: Arc<Vec<LayerLayout>>,
    slots: [Slot; 2],
    /// The slot whose layer is loaded and computing (between `take` and `release`).
    in_use: Option<usize>,
    /// The slot the next copy goes into when neither holds the layer.
    next: usize,
    /// The layer whose copy has begun but is not all queued yet.
    pending: Option<Pending>,
    stream: Option<CopyStream>,
    /// Copies whose timing has not been read yet: timestamps before and after, and bytes.
    unread: Vec<(Event, Event, u64)>,
    totals: CopyTotals,
}

impl Slots {
    /// Two slots on `device`, each as large as the largest of `layouts`.
    pub fn new(
        checkpoint: Arc<Checkpoint>,
        layouts: Arc<Vec<LayerLayout>>,
        device: Device,
    ) -> Result<Self> {
        let bytes = layouts.iter().map(|l| l.bytes).max().unwrap_or(0).max(1) as i64;
        let cuda = device.is_cuda();
        let slot = || -> Result<Slot> {
            let event = || cuda.then(Event::new).transpose();
            Ok(Slot {
                bytes: Tensor::f_empty([bytes], (Kind::Uint8, device))?,
                layer: None,
                copied: event()?,
                free: event()?,
            })
        };
        let stream = match device {
            Device::Cuda(d) => Some(CopyStream::new(d)?),
            _ => None,
        };
        Ok(Slots {
            checkpoint,
            layouts,
            slots: [slot()?, slot()?],
            in_use: None,
            next: 0,
            pending: None,
            stream,
            unread: vec![],
            totals: CopyTotals::default(),
        })
    }

    /// Starts copying `layer` into the slot not in use, unless a slot already holds it, and
    /// queues all of it.
    pub fn prefetch(&mut self, layer: usize) -> Result<()> {
        self.begin(layer)?;
        self.finish()
    }

    /// Picks the slot for `layer` (unless a slot already holds it) and, on a GPU, orders its
    /// copy after the compute that last read that slot; its bytes are queued by
    /// [`Self::advance`] and [`Self::finish`]. Queuing a layer's bytes in parts, between the
    /// batches of the layer before, leaves the copy engine free in between for the small
    /// device-to-host reads a batch's forward waits on (a mixture of experts' counts), which
    /// a whole layer's copy queued at once would hold up for its full length.
    pub fn begin(&mut self, layer: usize) -> Result<()> {
        self.finish()?;
        if self.slots.iter().any(|s| s.layer == Some(layer)) {
            return Ok(());
        }
        let layout = self.layouts.get(layer).ok_or_else(|| {
            CaptureError::Pipeline(format!("no streaming layout for layer {layer}"))
        })?;
        let s = match self.in_use {
            Some(u) => 1 - u,
            None => self.next,
        };
        self.next = 1 - s;
        let slot = &mut self.slots[s];
        slot.layer = Some(layer);
        if let (Some(stream), Some(free)) = (&self.stream, &slot.free) {
            stream.wait_for(free)?;
        }
        self.pending = Some(Pending {
            slot: s,
            layer,
            queued: 0,
            total: layout.tensors.len(),
        });
        Ok(())
    }

    /// Queues the pending layer's tensors up to `done` of `parts` of it (by count of tensors).
    pub fn advance(&mut self, done: usize, parts: usize) -> Result<()> {
        let Some(p) = &self.pending else {
            return Ok(());
        };
        let upto = (p.total * done.min(parts)).div_ceil(parts.max(1));
        self.queue_upto(upto)
    }

    /// Queues the rest of the pending layer and marks it copied.
    pub fn finish(&mut self) -> Result<()> {
        let Some(total) = self.pending.as_ref().map(|p| p.total) else {
            return Ok(());
        };
        self.queue_upto(total)?;
        if let Some(p) = self.pending.take() {
            if let (Some(stream), Some(e)) = (&self.stream, &self.slots[p.slot].copied) {
                stream.record(e)?;
            }
        }
        Ok(())
    }

    /// Copies the pending layer's tensors `queued..upto` into its slot: on a GPU queued on the
    /// copy stream, timed by a pair of events; on the CPU a plain memcpy.
    fn queue_upto(&mut self, upto: usize) -> Result<()> {
        let Some(p) = &mut self.pending else {
            return Ok(());
        };
        if upto <= p.queued {
            return Ok(());
        }
        let layout = &self.layouts[p.layer];
        let base = self.slots[p.slot].bytes.data_ptr() as *mut u8;
        let t = Instant::now();
        let timed = match &self.stream {
            Some(stream) => {
                let start = Event::timed()?;
                stream.record(&start)?;
                Some(start)
            }
            None => None,
        };
        let mut bytes = 0u64;
        for placed in &layout.tensors[p.queued..upto] {
            let src = self
                .checkpoint
                .raw(&placed.stored.name)
                .map_err(|e| self.checkpoint.error(vec![e]))?;
            let dst = base.wrapping_add(placed.offset);
            match &self.stream {
                // SAFETY: the slot holds `layout.bytes` bytes from `base` and nothing reads it
                // until `copied` (recorded once the last part is queued) has completed, nor
                // writes it: the copy waited for `free`, recorded after the last compute that
                // read it. The checkpoint is mapped for as long as `self` holds it.
                Some(stream) => unsafe { stream.upload(dst.cast(), src.bytes)? },
                // SAFETY: a CPU slot of `layout.bytes` bytes from `base`; no tensor of an
                // earlier layer reads it any more (its layer was released before this copy).
                None => unsafe {
                    std::ptr::copy_nonoverlapping(src.bytes.as_ptr(), dst, src.bytes.len())
                },
            }
            bytes += src.bytes.len() as u64;
        }
        p.queued = upto;
        match (&self.stream, timed) {
            (Some(stream), Some(start)) => {
                let end = Event::timed()?;
                stream.record(&end)?;
                self.unread.push((start, end, bytes));
            }
            _ => {
                self.totals.bytes += bytes;
                self.totals.secs += t.elapsed().as_secs_f64();
            }
        }
        Ok(())
    }

    /// `layer`'s slot as a tensor source, copying it first if no slot holds it; on a GPU,
    /// libtorch's stream waits for the copy before any work queued on it from now on.
    pub fn take(&mut self, layer: usize) -> Result<StagedSource<'_>> {
        match &self.pending {
            // Another layer's copy may stay pending: it goes on in parts while this one runs.
            Some(p) if p.layer != layer && self.slots.iter().any(|s| s.layer == Some(layer)) => {}
            Some(p) if p.layer == layer => self.finish()?,
            _ => self.prefetch(layer)?,
        }
        let s = (0..2)
            .find(|&s| self.slots[s].layer == Some(layer))
            .ok_or_else(|| CaptureError::Pipeline(format!("layer {layer} is in no slot")))?;
        if let Some(e) = &self.slots[s].copied {
            e.wait_on_default()?;
        }
        self.in_use = Some(s);
        Ok(StagedSource {
            slot: &self.slots[s].bytes,
            layout: &self.layouts[layer],
            checkpoint: &self.checkpoint,
        })
    }

    /// The layer taken last is done with its slot once the work queued so far has run.
    pub fn release(&mut self) -> Result<()> {
        if let Some(s) = self.in_use.take() {
            if let Some(e) = &self.slots[s].free {
                e.record_on_default()?;
            }
        }
        Ok(())
    }

    /// The copies made since the last call: bytes and time. On a GPU this reads the copies'
    /// timestamps, so it waits for them to complete.
    pub fn copy_totals(&mut self) -> Result<CopyTotals> {
        for (start, end, bytes) in std::mem::take(&mut self.unread) {
            end.synchronize()?;
            self.totals.secs += f64::from(end.elapsed_ms(&start)?) / 1e3;
            self.totals.bytes += bytes;
        }
        Ok(std::mem::take(&mut self.totals))
    }
}
