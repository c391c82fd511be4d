//! A `torch.save` file of a flat `{name: tensor}` dict, written without torch: the zip archive
//! torch ≥ 1.6 writes (stored, not deflated; every record's bytes 64-byte aligned), holding a
//! protocol-2 pickle whose tensors point at storages `data/0`, `data/1`, … through persistent
//! ids. Only globals that `torch.load(weights_only=True)` allows are used:
//! `torch._utils._rebuild_tensor_v2`, `collections.OrderedDict` and the `torch.*Storage` types.
use std::io::Write;

use crate::ElemType;

/// A contiguous tensor to store: element type, shape and little-endian bytes.
pub struct TensorRef<'a> {
    /// Element type.
    pub dtype: ElemType,
    /// Shape (row-major, contiguous).
    pub shape: Vec<usize>,
    /// The elements' bytes.
    pub bytes: &'a [u8],
}

/// The bytes of a `torch.save({name: tensor, ...})` file, entries in the given order.
pub fn torch_save_bytes(entries: &[(&str, TensorRef<'_>)]) -> Vec<u8> {
    let mut zip = ZipWriter::default();
    zip.add("archive/data.pkl", &pickle(entries));
    zip.add("archive/.format_version", b"1");
    zip.add("archive/.storage_alignment", b"64");
    zip.add("archive/byteorder", b"little");
    for (i, (_, t)) in entries.iter().enumerate() {
        zip.add(&format!("archive/data/{i}"), t.bytes);
    }
    zip.add("archive/version", b"3\n");
    zip.finish()
}

fn storage_type(d: ElemType) -> &'static str {
    match d {
        ElemType::I64 => "LongStorage",
        ElemType::I32 => "IntStorage",
        ElemType::Bf16 => "BFloat16Storage",
        ElemType::F16 => "HalfStorage",
        ElemType::F32 => "FloatStorage",
    }
}

/// Pickle opcodes used (protocol 2).
mod op {
    pub const PROTO: u8 = 0x80;
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const MARK: u8 = b'(';
    pub const TUPLE: u8 = b't';
    pub const SETITEMS: u8 = b'u';
    pub const BINUNICODE: u8 = b'X';
    pub const GLOBAL: u8 = b'c';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const BININT: u8 = b'J';
    pub const LONG1: u8 = 0x8a;
    pub const NEWFALSE: u8 = 0x89;
    pub const STOP: u8 = b'.';
}

fn pickle(entries: &[(&str, TensorRef<'_>)]) -> Vec<u8> {
    let mut p = vec![op::PROTO, 2, op::EMPTY_DICT, op::MARK];
    for (key, (name, t)) in entries.iter().enumerate() {
        put_str(&mut p, name);
        put_global(&mut p, "torch._utils", "_rebuild_tensor_v2");
        p.push(op::MARK);
        // The storage, by persistent id: ('storage', type, key, location, numel).
        p.push(op::MARK);
        put_str(&mut p, "storage");
        put_global(&mut p, "torch", storage_type(t.dtype));
        put_str(&mut p, &key.to_string());
        put_str(&mut p, "cpu");
        put_int(&mut p, t.bytes.len() / t.dtype.size());
        p.push(op::TUPLE);
        p.push(op::BINPERSID);
        // storage_offset, size, stride (contiguous), requires_grad, backward_hooks.
        put_int(&mut p, 0);
        put_tuple(&mut p, &t.shape);
        put_tuple(&mut p, &contiguous_strides(&t.shape));
        p.push(op::NEWFALSE);
        put_global(&mut p, "collections", "OrderedDict");
        p.push(op::EMPTY_TUPLE);
        p.push(op::REDUCE);
        p.push(op::TUPLE);
        p.push(op::REDUCE);
    }
    p.push(op::SETITEMS);
    p.push(op::STOP);
    p
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

fn put_str(p: &mut Vec<u8>, s: &str) {
    p.push(op::BINUNICODE);
    p.extend_from_slice(&(s.len() as u32).to_le_bytes());
    p.extend_from_slice(s.as_bytes());
}

fn put_global(p: &mut Vec<u8>, module: &str, name: &str) {
    p.push(op::GLOBAL);
    p.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
}

fn put_int(p: &mut Vec<u8>, v: usize) {
    if let Ok(small) = i32::try_from(v) {
        p.push(op::BININT);
        p.extend_from_slice(&small.to_le_bytes());
    } else {
        // LONG1: a little-endian two's-complement integer of n bytes (9 cover any u64).
        p.push(op::LONG1);
        p.push(9);
        p.extend_from_slice(&(v as u64).to_le_bytes());
        p.push(0);
    }
}

fn put_tuple(p: &mut Vec<u8>, vals: &[usize]) {
    p.push(op::MARK);
    for &v in vals {
        put_int(p, v);
    }
    p.push(op::TUPLE);
}

/// A minimal zip writer: stored entries, data aligned to 64 bytes by padding the local
/// header's extra field (as torch does, so that `torch.load(mmap=True)` works too).
#[derive(Default)]
struct ZipWriter {
    out: Vec<u8>,
    central: Vec<u8>,
    count: u16,
}

const ALIGN: usize = 64;

impl ZipWriter {
    fn add(&mut self, name: &str, data: &[u8]) {
        let crc = crc32fast::hash(data);
        let offset = self.out.len();
        let header_len = 30 + name.len();
        let pad = (ALIGN - (offset + header_len + 4) % ALIGN) % ALIGN;
        // Extra field: one block of id 0x1234 (unassigned) holding the padding.
        let extra_len = 4 + pad;
        let size = data.len() as u32;
        let mut h = Vec::with_capacity(header_len + extra_len);
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&20u16.to_le_bytes()); // version needed
        h.extend_from_slice(&0u16.to_le_bytes()); // flags
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&0u32.to_le_bytes()); // time, date
        h.extend_from_slice(&crc.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra_len as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend_from_slice(&0x1234u16.to_le_bytes());
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad, 0);
        self.out.extend_from_slice(&h);
        self.out.extend_from_slice(data);

        let c = &mut self.central;
        c.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        c.extend_from_slice(&20u16.to_le_bytes()); // version made by
        c.extend_from_slice(&20u16.to_le_bytes()); // version needed
        c.extend_from_slice(&0u16.to_le_bytes());
        c.extend_from_slice(&0u16.to_le_bytes());
        c.extend_from_slice(&0u32.to_le_bytes());
        c.extend_from_slice(&crc.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&size.to_le_bytes());
        c.extend_from_slice(&(name.len() as u16).to_le_bytes());
        c.extend_from_slice(&0u16.to_le_bytes()); // extra
        c.extend_from_slice(&0u16.to_le_bytes()); // comment
        c.extend_from_slice(&0u16.to_le_bytes()); // disk
        c.extend_from_slice(&0u16.to_le_bytes()); // internal attrs
        c.extend_from_slice(&0u32.to_le_bytes()); // external attrs
        c.extend_from_slice(&(offset as u32).to_le_bytes());
        c.extend_from_slice(name.as_bytes());
        self.count += 1;
    }

    fn finish(mut self) -> Vec<u8> {
        let cd_offset = self.out.len() as u32;
        let cd_len = self.central.len() as u32;
        self.out.extend_from_slice(&self.central);
        let mut e = Vec::with_capacity(22);
        e.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        e.extend_from_slice(&0u16.to_le_bytes());
        e.extend_from_slice(&0u16.to_le_bytes());
        e.extend_from_slice(&self.count.to_le_bytes());
        e.extend_from_slice(&self.count.to_le_bytes());
        e.extend_from_slice(&cd_len.to_le_bytes());
        e.extend_from_slice(&cd_offset.to_le_bytes());
        e.extend_from_slice(&0u16.to_le_bytes());
        let _ = self.out.write_all(&e);
        self.out
    }
}

/// Whether a sample's tensors fit this writer's 32-bit zip fields (no zip64): every
/// record and the whole file below 4 GiB.
pub fn fits_without_zip64(total_bytes: usize) -> bool {
    // Headers, pickle and padding add well under 1 MiB for a handful of tensors.
    total_bytes < (u32::MAX as usize) - (1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_of_a_contiguous_tensor() {
        assert_eq!(contiguous_strides(&[1, 5, 12]), vec![60, 12, 1]);
        assert_eq!(contiguous_strides(&[7]), vec![1]);
    }

    #[test]
    fn every_record_starts_on_a_64_byte_boundary() {
        let bytes = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let t = TensorRef {
            dtype: ElemType::I64,
            shape: vec![1],
            bytes: &bytes,
        };
        let file = torch_save_bytes(&[("x", t)]);
        // The storage record holds the tensor's bytes right after its padded header.
        let at = file.windows(8).position(|w| w == bytes).unwrap();
        assert_eq!(at % 64, 0);
        assert_eq!(&file[file.len() - 22..file.len() - 18], b"PK\x05\x06");
    }

    #[test]
    fn large_counts_use_a_long_integer() {
        let mut p = Vec::new();
        put_int(&mut p, 3_000_000_000);
        assert_eq!(p[0], op::LONG1);
        assert_eq!(p.len(), 11);
    }
}
