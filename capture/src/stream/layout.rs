//! Where each tensor of one decoder layer sits in a layer slot: the layer's stored bytes laid
//! end to end, so that one copy per tensor fills the slot and the layer is then read from it in
//! place. Tensors are grouped by their role (the last part of their name: `weight`,
//! `weight_packed`, `weight_scale`, `bias`, ...) in the order the layer reads them, so that the
//! parts a load fuses into one matrix (q|k|v, gate|up, an expert's gate|up codes and scales) lie
//! next to each other and their join is a view, not a copy.
use std::collections::HashMap;

use tch::Kind;

/// Every tensor starts at a multiple of this many bytes, as the caching allocator aligns its
/// blocks: kernels that pick a path by pointer alignment see the same alignment as when the
/// tensor was allocated on its own.
pub(crate) const ALIGN: usize = 512;

/// One tensor a layer reads, as stored in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stored {
    /// Checkpoint name.
    pub name: String,
    /// Stored bytes.
    pub len: usize,
    /// Stored dtype.
    pub kind: Kind,
    /// Full shape.
    pub shape: Vec<usize>,
}

/// A tensor's place in the slot.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Placed {
    /// The tensor.
    pub stored: Stored,
    /// Byte offset in the slot.
    pub offset: usize,
}

/// One layer's tensors in a slot.
#[derive(Debug, Clone, Default)]
pub(crate) struct LayerLayout {
    /// In slot order.
    pub tensors: Vec<Placed>,
    /// Bytes the layer needs in a slot.
    pub bytes: usize,
    by_name: HashMap<String, usize>,
}

impl LayerLayout {
    /// Lays out `read` (a layer's tensors in the order its load reads them): grouped by role in
    /// order of each role's first read, in read order within a role, each aligned to [`ALIGN`].
    pub fn new(read: Vec<Stored>) -> Self {
        let mut roles: Vec<&str> = vec![];
        for s in &read {
            let r = role(&s.name);
            if !roles.contains(&r) {
                roles.push(r);
            }
        }
        let mut order: Vec<usize> = (0..read.len()).collect();
        // Stable: read order within a role.
        order.sort_by_key(|&i| roles.iter().position(|r| *r == role(&read[i].name)));
        let mut layout = LayerLayout::default();
        let mut at = 0;
        for i in order {
            let s = read[i].clone();
            let len = s.len;
            layout.by_name.insert(s.name.clone(), layout.tensors.len());
            layout.tensors.push(Placed {
                stored: s,
                offset: at,
            });
            at = (at + len).next_multiple_of(ALIGN);
        }
        layout.bytes = at;
        layout
    }

    /// Where `name` sits, if the layer reads it.
    pub fn get(&self, name: &str) -> Option<&Placed> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }
}

/// The role of a tensor: the last part of its name.
fn role(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(name: &str, len: usize) -> Stored {
        Stored {
            name: name.into(),
            len,
            kind: Kind::BFloat16,
            shape: vec![len / 2],
        }
    }

    #[test]
    fn fused_parts_lie_next_to_each_other_and_every_tensor_is_aligned() {
        let read = vec![
            stored("l.q_proj.weight", 1024),
            stored("l.q_proj.bias", 6),
            stored("l.k_proj.weight", 512),
            stored("l.k_proj.bias", 6),
            stored("l.v_proj.weight", 512),
            stored("l.v_proj.bias", 6),
        ];
        let l = LayerLayout::new(read);
        let at = |n: &str| l.get(n).unwrap().offset;
        assert_eq!(at("l.q_proj.weight"), 0);
        assert_eq!(at("l.k_proj.weight"), 1024);
        assert_eq!(at("l.v_proj.weight"), 1536);
        assert_eq!(at("l.q_proj.bias"), 2048);
        assert_eq!(at("l.k_proj.bias"), 2048 + ALIGN);
        assert_eq!(l.bytes, 2048 + 3 * ALIGN);
        assert!(l.tensors.iter().all(|p| p.offset % ALIGN == 0));
        assert!(l.get("l.o_proj.weight").is_none());
    }

    #[test]
    fn an_empty_layer_needs_no_bytes() {
        let l = LayerLayout::new(vec![]);
        assert_eq!(l.bytes, 0);
        assert!(l.tensors.is_empty());
    }
}
