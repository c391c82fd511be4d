//! EAGLE-3 batches: where one ends ([`Batcher`]), and the assembly of its picked rows into
//! padded or packed host tensors.
use std::sync::Arc;

use hslake_schemas::{f32_to_bf16_bits, fp8_e4m3_to_f32, DType};

use crate::rowgroup::RowGroupData;
use crate::{Batching, Layout, LoaderState};

/// Element type of a host tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// 64-bit signed integers (token ids, masks, positions).
    I64,
    /// 32-bit signed integers (`cu_seqlens`, as flash-attention wants them).
    I32,
    /// bfloat16 bits.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::I64 => 8,
            ElemType::I32 | ElemType::F32 => 4,
            ElemType::Bf16 | ElemType::F16 => 2,
        }
    }

    /// The torch dtype name (`torch.<name>`).
    pub fn torch_name(self) -> &'static str {
        match self {
            ElemType::I64 => "int64",
            ElemType::I32 => "int32",
            ElemType::Bf16 => "bfloat16",
            ElemType::F16 => "float16",
            ElemType::F32 => "float32",
        }
    }

    /// The element type hidden states of a stored dtype are delivered in; fp8 is dequantised
    /// (value × token scale) to bf16, the dtype EAGLE-3 trains in.
    pub fn for_hidden(d: DType) -> Self {
        match d {
            DType::Bf16 | DType::Fp8E4m3 => ElemType::Bf16,
            DType::F16 => ElemType::F16,
            DType::F32 => ElemType::F32,
        }
    }
}

/// A dense, row-major, little-endian host tensor in a 64-byte aligned buffer.
#[derive(Debug)]
pub struct HostTensor {
    /// Element type.
    pub dtype: ElemType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Zeroed bytes with room to start the tensor at a 64-byte boundary.
    data: Vec<u8>,
    /// Where the tensor starts in `data`.
    start: usize,
}

/// Alignment of a tensor's first byte.
const ALIGN: usize = 64;

impl HostTensor {
    /// A tensor of zeros, in the store's cheaply faulting buffers (a batch's padded states
    /// are hundreds of MB of fresh memory each time; an over-aligned zeroed allocation would
    /// also memset them).
    pub fn zeros(dtype: ElemType, shape: Vec<usize>) -> Self {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        let data = hslake_store::buffer::zeroed(n + ALIGN);
        let start = data.as_ptr().align_offset(ALIGN);
        HostTensor {
            dtype,
            data,
            start,
            shape,
        }
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        let n = self.data.len() - ALIGN;
        &self.data[self.start..self.start + n]
    }

    /// The raw bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.data.len() - ALIGN;
        &mut self.data[self.start..self.start + n]
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values of an `I64` tensor (empty for other types).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        if self.dtype != ElemType::I64 {
            return Vec::new();
        }
        self.bytes()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect()
    }

    /// Values of an `I32` tensor (empty for other types).
    pub fn to_i32_vec(&self) -> Vec<i32> {
        if self.dtype != ElemType::I32 {
            return Vec::new();
        }
        self.bytes()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn fill_i64(&mut self, v: i64) {
        for c in self.bytes_mut().chunks_exact_mut(8) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    }

    fn set_i64(&mut self, i: usize, v: i64) {
        self.bytes_mut()[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
    }
}

/// One batch ready for EAGLE-3 training.
///
/// Padded: `input_ids`, `loss_mask`, `attention_mask`, `position_ids` are `[B, T]`,
/// `aux_hidden_states` `[B, T, k·H]`, `target_hidden_states` `[B, T, H]`.
/// Packed: the same with `B = 1` and `T = ΣT_i`, no `attention_mask`, plus `cu_seqlens`
/// `[n + 1]` (int32) and `document_ids` `[1, T]`; `position_ids` restart at each document.
#[derive(Debug)]
pub struct Batch {
    /// The samples, in order.
    pub sample_ids: Vec<u64>,
    /// Their lengths after truncation.
    pub seq_lens: Vec<usize>,
    /// Named tensors, in a fixed order.
    pub fields: Vec<(&'static str, HostTensor)>,
    /// The loader state just after this batch: resuming from it continues with the next batch.
    pub state: LoaderState,
}

impl Batch {
    /// A field by name.
    pub fn field(&self, name: &str) -> Option<&HostTensor> {
        self.fields.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }

    /// Tokens in the batch (padding excluded).
    pub fn num_tokens(&self) -> usize {
        self.seq_lens.iter().sum()
    }
}

#[cfg(feature = "tch")]
impl ElemType {
    fn kind(self) -> tch::Kind {
        match self {
            ElemType::I64 => tch::Kind::Int64,
            ElemType::I32 => tch::Kind::Int,
            ElemType::Bf16 => tch::Kind::BFloat16,
            ElemType::F16 => tch::Kind::Half,
            ElemType::F32 => tch::Kind::Float,
        }
    }
}

#[cfg(feature = "tch")]
#[warn(clippy::unwrap_used, clippy::expect_used)] // libtorch fails by error, never a panic
impl HostTensor {
    /// As a libtorch CPU tensor of the same dtype (bf16 stays bf16), optionally copied into
    /// page-locked memory for asynchronous host-to-GPU copies (needs CUDA).
    pub fn to_tch(&self, pin_memory: bool) -> Result<tch::Tensor, tch::TchError> {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        let t = tch::Tensor::f_from_data_size(self.bytes(), &shape, self.dtype.kind())?;
        if pin_memory {
            t.f_pin_memory(tch::Device::Cuda(0))
        } else {
            Ok(t)
        }
    }
}

#[cfg(feature = "tch")]
#[warn(clippy::unwrap_used, clippy::expect_used)] // libtorch fails by error, never a panic
impl Batch {
    /// Every field as a tch tensor, by name.
    pub fn to_tch(
        &self,
        pin_memory: bool,
    ) -> Result<Vec<(&'static str, tch::Tensor)>, tch::TchError> {
        self.fields
            .iter()
            .map(|(n, t)| Ok((*n, t.to_tch(pin_memory)?)))
            .collect()
    }
}

/// Settings of batch assembly.
#[derive(Debug, Clone)]
pub(crate) struct Assembly {
    pub layout: Layout,
    pub truncate: Option<usize>,
    pub pad_multiple: Option<usize>,
    pub pad_token_id: i64,
    pub hidden: usize,
    pub dtype: DType,
}

/// Where batches end: rows are gathered until the batch holds `batch_size` samples, or until
/// the next row would take it over the token budget (`B × T` padded, where the longest row
/// sets `T`; `ΣT` packed), counting each row at its length after truncation.
#[derive(Debug)]
pub(crate) struct Batcher<R> {
    batching: Batching,
    layout: Layout,
    truncate: Option<usize>,
    rows: Vec<R>,
    tokens: usize,
    longest: usize,
}

impl<R> Batcher<R> {
    /// An empty batch of `spec`'s layout and truncation.
    pub(crate) fn new(batching: Batching, spec: &Assembly) -> Self {
        Batcher {
            batching,
            layout: spec.layout,
            truncate: spec.truncate,
            rows: Vec::new(),
            tokens: 0,
            longest: 0,
        }
    }

    /// Add a row of `seq_len` tokens; where it would take the rows gathered so far over the
    /// token budget, those rows are returned, a finished batch, and it starts the next.
    pub(crate) fn push(&mut self, row: R, seq_len: usize) -> Option<Vec<R>> {
        let len = self.truncate.map_or(seq_len, |t| seq_len.min(t));
        let overflow = match self.batching {
            Batching::Tokens(budget) if !self.rows.is_empty() => match self.layout {
                Layout::Padded => (self.rows.len() + 1) * self.longest.max(len) > budget,
                Layout::Packed => self.tokens + len > budget,
            },
            _ => false,
        };
        let done = overflow.then(|| self.take());
        self.rows.push(row);
        self.tokens += len;
        self.longest = self.longest.max(len);
        done
    }

    /// The rows gathered, once they are `batch_size` samples.
    pub(crate) fn full(&mut self) -> Option<Vec<R>> {
        matches!(self.batching, Batching::Samples(b) if self.rows.len() >= b).then(|| self.take())
    }

    /// The rows left at the end of a pass: a last batch, unless there are none or
    /// `drop_last_batch` leaves a short one out.
    pub(crate) fn rest(mut self, drop_last_batch: bool) -> Option<Vec<R>> {
        (!self.rows.is_empty() && !drop_last_batch).then(|| self.take())
    }

    fn take(&mut self) -> Vec<R> {
        (self.tokens, self.longest) = (0, 0);
        std::mem::take(&mut self.rows)
    }
}

/// Assemble rows (a row group and a row in it) into a batch; `state` is set by the caller.
pub(crate) fn assemble(
    spec: &Assembly,
    rows: &[(Arc<RowGroupData>, usize)],
    state: LoaderState,
) -> Batch {
    let lens: Vec<usize> = rows
        .iter()
        .map(|(g, r)| {
            let l = g.seq_len(*r);
            spec.truncate.map_or(l, |t| l.min(t))
        })
        .collect();
    let n = rows.len();
    let packed = spec.layout == Layout::Packed;
    // Token offset of each sample in the flattened [B * T] grid.
    let (b, t, starts): (usize, usize, Vec<usize>) = if packed {
        let mut starts = Vec::with_capacity(n + 1);
        let mut acc = 0;
        for &l in &lens {
            starts.push(acc);
            acc += l;
        }
        (1, acc, starts)
    } else {
        let longest = lens.iter().copied().max().unwrap_or(0);
        let t = match spec.pad_multiple {
            Some(m) => longest.div_ceil(m) * m,
            None => longest,
        };
        (n, t, (0..n).map(|i| i * t).collect())
    };
    let k = rows.first().map_or(0, |(g, _)| g.aux.len());
    let h = spec.hidden;
    let out = ElemType::for_hidden(spec.dtype);

    let mut input_ids = HostTensor::zeros(ElemType::I64, vec![b, t]);
    input_ids.fill_i64(spec.pad_token_id);
    let mut loss_mask = HostTensor::zeros(ElemType::I64, vec![b, t]);
    let mut attention = HostTensor::zeros(ElemType::I64, vec![b, t]);
    let mut positions = HostTensor::zeros(ElemType::I64, vec![b, t]);
    let mut documents = HostTensor::zeros(ElemType::I64, vec![b, t]);
    let mut aux = HostTensor::zeros(out, vec![b, t, k * h]);
    let mut target = HostTensor::zeros(out, vec![b, t, h]);
    let es = out.size();

    for (i, ((g, r), &len)) in rows.iter().zip(&lens).enumerate() {
        let r = *r;
        let s = starts[i];
        let o = g.offsets[r];
        let ids = &g.input_ids.values()[o..o + len];
        let mask = &g.loss_mask.values()[o..o + len];
        for j in 0..len {
            input_ids.set_i64(s + j, ids[j] as i64);
            loss_mask.set_i64(s + j, mask[j] as i64);
            attention.set_i64(s + j, 1);
            positions.set_i64(s + j, j as i64);
            documents.set_i64(s + j, i as i64);
        }
        let row_bytes = k * h * es;
        for (j, col) in g.aux.iter().enumerate() {
            let dst = &mut aux.bytes_mut()[s * row_bytes + j * h * es..];
            write_tokens(
                col.values.value(r),
                col.scales.as_ref().map(|c| c.value(r)),
                spec.dtype,
                len,
                h,
                dst,
                row_bytes,
            );
        }
        let dst = &mut target.bytes_mut()[s * h * es..];
        let col = &g.target;
        write_tokens(
            col.values.value(r),
            col.scales.as_ref().map(|c| c.value(r)),
            spec.dtype,
            len,
            h,
            dst,
            h * es,
        );
    }

    let sample_ids: Vec<u64> = rows.iter().map(|(g, r)| g.sample_ids.value(*r)).collect();
    let mut ids_t = HostTensor::zeros(ElemType::I64, vec![n]);
    for (i, &id) in sample_ids.iter().enumerate() {
        ids_t.set_i64(i, id as i64);
    }
    let mut fields = vec![("input_ids", input_ids), ("loss_mask", loss_mask)];
    if packed {
        let mut cu = HostTensor::zeros(ElemType::I32, vec![n + 1]);
        for (i, c) in starts.iter().copied().chain([t]).enumerate() {
            cu.bytes_mut()[4 * i..4 * i + 4].copy_from_slice(&(c as i32).to_le_bytes());
        }
        fields.push(("cu_seqlens", cu));
        fields.push(("document_ids", documents));
    } else {
        fields.push(("attention_mask", attention));
    }
    fields.push(("position_ids", positions));
    fields.push(("aux_hidden_states", aux));
    fields.push(("target_hidden_states", target));
    fields.push(("sample_ids", ids_t));
    Batch {
        sample_ids,
        seq_lens: lens,
        fields,
        state,
    }
}

/// Write the first `tokens` token rows of a decoded `[full, hidden]` value into `dst`, token
/// rows `stride` bytes apart (the aux concatenation); fp8 rows are dequantised to bf16 on the
/// way.
#[allow(clippy::too_many_arguments)]
fn write_tokens(
    values: &[u8],
    scales: Option<&[u8]>,
    dtype: DType,
    tokens: usize,
    hidden: usize,
    dst: &mut [u8],
    stride: usize,
) {
    match dtype {
        DType::Bf16 | DType::F16 | DType::F32 => {
            let row = hidden * dtype.size();
            for (t, src) in values.chunks_exact(row).take(tokens).enumerate() {
                dst[t * stride..t * stride + row].copy_from_slice(src);
            }
        }
        DType::Fp8E4m3 => {
            for t in 0..tokens {
                let scale = scales.map_or(1.0, |s| {
                    f32::from_le_bytes([s[4 * t], s[4 * t + 1], s[4 * t + 2], s[4 * t + 3]])
                });
                let d = &mut dst[t * stride..t * stride + 2 * hidden];
                for (x, o) in d.chunks_exact_mut(2).enumerate() {
                    let v = fp8_e4m3_to_f32(values[t * hidden + x]) * scale;
                    o.copy_from_slice(&f32_to_bf16_bits(v).to_le_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(batching: Batching, layout: Layout, truncate: Option<usize>) -> Batcher<usize> {
        let spec = Assembly {
            layout,
            truncate,
            pad_multiple: None,
            pad_token_id: 0,
            hidden: 4,
            dtype: DType::Bf16,
        };
        Batcher::new(batching, &spec)
    }

    /// The batches `lens` (row i of `lens[i]` tokens) fall into, as row indices.
    fn cut(mut b: Batcher<usize>, lens: &[usize]) -> Vec<Vec<usize>> {
        let mut out = vec![];
        for (i, &len) in lens.iter().enumerate() {
            out.extend(b.push(i, len));
            out.extend(b.full());
        }
        out.extend(b.rest(false));
        out
    }

    #[test]
    fn a_sample_count_ends_a_batch_when_reached_and_the_rest_is_a_short_last_one() {
        let b = batcher(Batching::Samples(2), Layout::Padded, None);
        assert_eq!(cut(b, &[5, 9, 1, 7, 3]), [vec![0, 1], vec![2, 3], vec![4]]);
        let mut b = batcher(Batching::Samples(2), Layout::Padded, None);
        assert_eq!(b.push(0, 5), None);
        assert_eq!(
            b.rest(true),
            None,
            "drop_last_batch leaves the short one out"
        );
    }

    #[test]
    fn a_padded_budget_counts_rows_times_the_longest_and_a_packed_one_the_sum() {
        // Padded, budget 12: [4, 3] makes 2 × 4 = 8; adding 5 would make 3 × 5 = 15.
        let lens = [4, 3, 5, 2, 6, 6];
        let padded = batcher(Batching::Tokens(12), Layout::Padded, None);
        assert_eq!(cut(padded, &lens), [vec![0, 1], vec![2, 3], vec![4, 5]]);
        // Packed, budget 12: 4 + 3 + 5 = 12 fits; 2 + 6 = 8, then 8 + 6 = 14 does not.
        let packed = batcher(Batching::Tokens(12), Layout::Packed, None);
        assert_eq!(cut(packed, &lens), [vec![0, 1, 2], vec![3, 4], vec![5]]);
    }

    #[test]
    fn rows_count_at_their_truncated_length() {
        // Cut to 3 tokens, four rows of 10 fit a packed budget of 12.
        let b = batcher(Batching::Tokens(12), Layout::Packed, Some(3));
        assert_eq!(cut(b, &[10, 10, 10, 10, 10]), [vec![0, 1, 2, 3], vec![4]]);
    }
}

#[cfg(all(test, feature = "tch"))]
#[allow(clippy::disallowed_methods)] // tests read values back with tch's panicking forms
mod tch_tests {
    use super::*;

    #[test]
    fn bf16_host_tensor_becomes_a_bf16_tch_tensor_with_the_same_bits() {
        let mut t = HostTensor::zeros(ElemType::Bf16, vec![2, 3]);
        let bits: [u16; 6] = [0x3f80, 0xc000, 0x0000, 0x4049, 0x7f80, 0x3c00];
        for (i, b) in bits.iter().enumerate() {
            t.bytes_mut()[2 * i..2 * i + 2].copy_from_slice(&b.to_le_bytes());
        }
        let x = t.to_tch(false).unwrap();
        assert_eq!(x.kind(), tch::Kind::BFloat16);
        assert_eq!(x.size(), vec![2, 3]);
        assert_eq!(x.double_value(&[0, 0]), 1.0);
        assert_eq!(x.double_value(&[0, 1]), -2.0);
        assert!(x.double_value(&[1, 1]).is_infinite());
    }
}
