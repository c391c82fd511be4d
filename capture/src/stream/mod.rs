//! Layer-streamed capture: a model of any size captured through one device.
//!
//! Capture is prefill only, so nothing but the residual stream has to live from one layer to
//! the next. A *pass* of many batches therefore goes through the model one layer at a time:
//! the layer's weights are copied from host memory (the checkpoint's page cache, as stored:
//! FP8 and INT4 stay packed) into one of two device slots while the layer before computes
//! over every batch of the pass, so that the copy hides behind compute once a pass holds
//! enough tokens (a layer's bytes over the link's bandwidth, against its FLOPs per token over
//! the device's rate). Only the embeddings and the final norm stay resident. Each device runs
//! its own passes from the one host copy of the weights, with no collective.
//!
//! [`layout`] places a layer's stored tensors in a slot, [`slots`] fills the slots, [`source`]
//! loads a layer from its slot, and [`pass`] runs a pass. Every batch goes through the same
//! layer code as a resident model's, so a streamed capture stores the same bits.
use std::collections::HashSet;

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::tools::dry_run::ModelReads;

pub(crate) mod layout;
pub(crate) mod pass;
pub(crate) mod slots;
pub(crate) mod source;

use layout::{LayerLayout, Stored};

/// Each decoder layer's slot layout: the tensors the dry run saw its load read, as the
/// checkpoint stores them.
pub(crate) fn layouts(reads: &ModelReads, checkpoint: &Checkpoint) -> Result<Vec<LayerLayout>> {
    reads
        .layers
        .iter()
        .map(|layer| {
            let mut seen = HashSet::new();
            let stored = layer
                .iter()
                .filter(|spec| seen.insert(spec.name.as_str()))
                .map(|spec| {
                    let raw = checkpoint
                        .raw(&spec.name)
                        .map_err(|p| checkpoint.error(vec![p]))?;
                    Ok(Stored {
                        name: spec.name.clone(),
                        len: raw.bytes.len(),
                        kind: raw.kind,
                        shape: raw.shape,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(LayerLayout::new(stored))
        })
        .collect()
}
