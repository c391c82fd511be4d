//! The tensor source a streamed layer loads from: its slot, already filled with the layer's
//! stored bytes. Each tensor is a view of the slot in its stored dtype, converted only where
//! the compute dtype differs (as a resident load converts it on the device); parts that a load
//! joins and that lie next to each other in the slot are joined as one view.
use tch::{Device, Kind, Tensor};

use super::layout::{LayerLayout, Placed};
use crate::checkpoint::{Checkpoint, FLOATS};
use crate::error::{CaptureError, Result};
use crate::load::{Shard, TensorSource};
use crate::quant::config::Quantization;

/// A filled slot as a [`TensorSource`].
pub(crate) struct StagedSource<'a> {
    /// The slot: bytes on the stream's device.
    pub slot: &'a Tensor,
    /// Where the layer's tensors sit in it.
    pub layout: &'a LayerLayout,
    /// The checkpoint, for what is read on the host (an INT4 `weight_shape`) and its headers.
    pub checkpoint: &'a Checkpoint,
}

impl StagedSource<'_> {
    /// `name` as stored, viewed in the slot, after the same checks a checkpoint read makes.
    fn view(&self, name: &str, shape: &[usize], shard: Shard, accept: &[Kind]) -> Result<Tensor> {
        let problem = |p| self.checkpoint.error(vec![p]);
        let kind = self
            .checkpoint
            .check_stored(name, shape, accept)
            .map_err(problem)?;
        if !matches!(shard, Shard::Full | Shard::Split { world: 1, .. }) {
            return Err(CaptureError::Pipeline(format!(
                "a streamed layer runs whole on one device, but {name} was asked for as {shard:?}"
            )));
        }
        let placed = self.layout.get(name).ok_or_else(|| {
            CaptureError::Pipeline(format!(
                "{name} is read by the layer but was not planned into its slot"
            ))
        })?;
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        Ok(slice(self.slot, placed)?
            .f_view_dtype(kind)?
            .f_view(&*dims)?)
    }

    fn on_slot_device(&self, device: Device) -> bool {
        device == self.slot.device()
    }
}

/// The bytes of `placed` in `slot`.
fn slice(slot: &Tensor, placed: &Placed) -> Result<Tensor> {
    Ok(slot.f_narrow(0, placed.offset as i64, placed.stored.len as i64)?)
}

impl TensorSource for StagedSource<'_> {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        kind: Kind,
    ) -> Result<Tensor> {
        if !self.on_slot_device(device) {
            return self.checkpoint.tensor(name, shape, shard, device, kind);
        }
        Ok(self.view(name, shape, shard, FLOATS)?.f_to_kind(kind)?)
    }

    fn stored(
        &self,
        name: &str,
        shape: &[usize],
        shard: Shard,
        device: Device,
        accept: &[Kind],
    ) -> Result<Tensor> {
        if !self.on_slot_device(device) {
            return self.checkpoint.stored(name, shape, shard, device, accept);
        }
        self.view(name, shape, shard, accept)
    }

    fn has(&self, name: &str) -> bool {
        self.checkpoint.has(name)
    }

    fn quantization(&self) -> &Quantization {
        self.checkpoint.quantization()
    }

    fn reads_data(&self) -> bool {
        true
    }

    fn concat(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        match adjacent_view(self.slot, &parts)? {
            Some(joined) => Ok(joined),
            None => self.checkpoint.concat(parts),
        }
    }
}

/// `parts` joined along dimension 0 as one view of `slot`, where they are contiguous views of
/// it that follow each other byte for byte with one dtype and the same trailing dimensions.
fn adjacent_view(slot: &Tensor, parts: &[Tensor]) -> Result<Option<Tensor>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let (kind, tail) = (first.kind(), first.size()[1..].to_vec());
    let base = slot.data_ptr() as usize;
    let end = base + slot.numel();
    let mut next = first.data_ptr() as usize;
    let start = next;
    let mut rows = 0;
    for p in parts {
        let bytes = p.numel() * kind.elt_size_in_bytes();
        let inside = (base..end).contains(&next) && next + bytes <= end;
        if p.kind() != kind
            || p.size()[1..] != tail[..]
            || !p.is_contiguous()
            || p.data_ptr() as usize != next
            || !inside
        {
            return Ok(None);
        }
        next += bytes;
        rows += p.size()[0];
    }
    let mut dims = vec![rows];
    dims.extend(tail);
    let joined = slot
        .f_narrow(0, (start - base) as i64, (next - start) as i64)?
        .f_view_dtype(kind)?
        .f_view(&*dims)?;
    Ok(Some(joined))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_join_as_a_view_and_anything_else_is_left_to_a_copy() {
        let slot = Tensor::arange(64, (Kind::Uint8, Device::Cpu));
        let part = |off: i64, rows: i64| {
            slot.narrow(0, off, rows * 4)
                .view_dtype(Kind::Half)
                .view([rows, 2])
        };
        let joined = adjacent_view(&slot, &[part(0, 2), part(8, 3)])
            .unwrap()
            .unwrap();
        assert_eq!(joined.size(), [5, 2]);
        assert_eq!(joined.data_ptr(), slot.data_ptr());
        let want = Tensor::cat(&[part(0, 2), part(8, 3)], 0);
        assert!(joined
            .view_dtype(Kind::Int16)
            .equal(&want.view_dtype(Kind::Int16)));
        // A gap, another dtype, or a tensor outside the slot: no view.
        assert!(adjacent_view(&slot, &[part(0, 2), part(12, 1)])
            .unwrap()
            .is_none());
        let other = slot.narrow(0, 8, 8).view_dtype(Kind::Float).view([1, 2]);
        assert!(adjacent_view(&slot, &[part(0, 2), other])
            .unwrap()
            .is_none());
        let elsewhere = Tensor::zeros([3, 2], (Kind::Half, Device::Cpu));
        assert!(adjacent_view(&slot, &[part(0, 2), elsewhere])
            .unwrap()
            .is_none());
    }
}
