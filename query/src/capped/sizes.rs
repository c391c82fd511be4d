//! What values take in memory, row by row, as the scalar caps count them: content plus the
//! offset (or view) each variable-size value carries, so that many empty values are not free.
use datafusion::arrow::array::{Array, ArrayRef, AsArray, GenericListArray, OffsetSizeTrait};
use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;

/// Offset (or view) bytes counted for one variable-size value.
pub(super) const OFFSET: u64 = 8;
const VIEW: u64 = 16;

/// The offset (or view) bytes a value of type `t` carries besides its content.
pub(super) fn overhead(t: &DataType) -> u64 {
    match t {
        DataType::Utf8View | DataType::BinaryView => VIEW,
        DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Binary
        | DataType::LargeBinary
        | DataType::List(_)
        | DataType::LargeList(_)
        | DataType::Map(..) => OFFSET,
        _ => 0,
    }
}

/// The one-row array inside a nested constant (list, struct, map), without copying it.
pub(super) fn scalar_array(s: &ScalarValue) -> Option<ArrayRef> {
    let a: ArrayRef = match s {
        ScalarValue::List(a) => a.clone(),
        ScalarValue::LargeList(a) => a.clone(),
        ScalarValue::FixedSizeList(a) => a.clone(),
        ScalarValue::Struct(a) => a.clone(),
        ScalarValue::Map(a) => a.clone(),
        _ => return None,
    };
    Some(a)
}

/// Bytes of one constant value, read in place (a 1 GB text constant is not copied to size it).
pub fn scalar_bytes(s: &ScalarValue) -> u64 {
    match s {
        ScalarValue::Utf8(v) | ScalarValue::LargeUtf8(v) => {
            OFFSET + v.as_ref().map_or(0, |v| v.len() as u64)
        }
        ScalarValue::Utf8View(v) => VIEW + v.as_ref().map_or(0, |v| v.len() as u64),
        ScalarValue::Binary(v) | ScalarValue::LargeBinary(v) => {
            OFFSET + v.as_ref().map_or(0, |v| v.len() as u64)
        }
        ScalarValue::BinaryView(v) => VIEW + v.as_ref().map_or(0, |v| v.len() as u64),
        ScalarValue::FixedSizeBinary(n, _) => *n as u64,
        ScalarValue::Dictionary(_, v) => scalar_bytes(v),
        other => match scalar_array(other) {
            Some(a) => row_bytes(a.as_ref()).first().copied().unwrap_or(0),
            None => element_bytes(&other.data_type()),
        },
    }
}

/// Bytes of each row's value of `a`, offsets included.
pub fn row_bytes(a: &dyn Array) -> Vec<u64> {
    let n = a.len();
    let from_offsets = |o: &[i64]| -> Vec<u64> {
        o.windows(2)
            .map(|w| OFFSET + (w[1] - w[0]) as u64)
            .collect()
    };
    match a.data_type() {
        DataType::Utf8 => from_offsets(&widen(a.as_string::<i32>().value_offsets())),
        DataType::LargeUtf8 => from_offsets(a.as_string::<i64>().value_offsets()),
        DataType::Binary => from_offsets(&widen(a.as_binary::<i32>().value_offsets())),
        DataType::LargeBinary => from_offsets(a.as_binary::<i64>().value_offsets()),
        DataType::Utf8View => {
            let v = a.as_string_view();
            (0..n).map(|i| VIEW + v.views()[i] as u32 as u64).collect()
        }
        DataType::BinaryView => {
            let v = a.as_binary_view();
            (0..n).map(|i| VIEW + v.views()[i] as u32 as u64).collect()
        }
        DataType::List(_) => list_bytes(a.as_list::<i32>()),
        DataType::LargeList(_) => list_bytes(a.as_list::<i64>()),
        DataType::FixedSizeList(_, k) => {
            let l = a.as_fixed_size_list();
            let child = row_bytes(l.values().as_ref());
            let k = (*k).max(0) as usize;
            (0..n)
                .map(|i| {
                    let start = l.value_offset(i) as usize;
                    child.get(start..start + k).map_or(0, |c| c.iter().sum())
                })
                .collect()
        }
        DataType::Map(..) => {
            let m = a.as_map();
            let entries = row_bytes(m.entries());
            let o = m.value_offsets();
            (0..n)
                .map(|i| {
                    OFFSET
                        + entries[o[i] as usize..o[i + 1] as usize]
                            .iter()
                            .sum::<u64>()
                })
                .collect()
        }
        DataType::Struct(_) => {
            let mut total = vec![0u64; n];
            for c in a.as_struct().columns() {
                for (t, b) in total.iter_mut().zip(row_bytes(c.as_ref())) {
                    *t += b;
                }
            }
            total
        }
        DataType::Dictionary(..) => {
            let d = a.as_any_dictionary();
            let values = row_bytes(d.values().as_ref());
            d.normalized_keys()
                .into_iter()
                .map(|k| values.get(k).copied().unwrap_or(0))
                .collect()
        }
        t @ (DataType::Null | DataType::Boolean | DataType::FixedSizeBinary(_)) => {
            vec![element_bytes(t); n]
        }
        t if t.primitive_width().is_some() => vec![element_bytes(t); n],
        // Run-end encoded, unions, list views: their average row (their values are shared or
        // sparse).
        _ => {
            let avg = a.get_array_memory_size() as u64 / n.max(1) as u64;
            vec![avg; n]
        }
    }
}

fn widen(o: &[i32]) -> Vec<i64> {
    o.iter().map(|&v| v as i64).collect()
}

fn list_bytes<O: OffsetSizeTrait>(l: &GenericListArray<O>) -> Vec<u64> {
    let child = row_bytes(l.values().as_ref());
    l.value_offsets()
        .windows(2)
        .map(|w| OFFSET + child[w[0].as_usize()..w[1].as_usize()].iter().sum::<u64>())
        .collect()
}

/// Elements of each list of `a` (1 for a value that is not a list); with `leaves`, of the
/// innermost lists.
pub(super) fn list_elements(a: &dyn Array, leaves: bool) -> Vec<u64> {
    fn count<O: OffsetSizeTrait>(l: &GenericListArray<O>, leaves: bool) -> Vec<u64> {
        let inner = leaves.then(|| list_elements(l.values().as_ref(), true));
        l.value_offsets()
            .windows(2)
            .map(|w| {
                let (s, e) = (w[0].as_usize(), w[1].as_usize());
                inner
                    .as_ref()
                    .map_or((e - s) as u64, |c| c[s..e].iter().sum())
            })
            .collect()
    }
    match a.data_type() {
        DataType::List(_) => count(a.as_list::<i32>(), leaves),
        DataType::LargeList(_) => count(a.as_list::<i64>(), leaves),
        DataType::FixedSizeList(_, k) => {
            let k = (*k).max(0) as u64;
            let l = a.as_fixed_size_list();
            match leaves.then(|| list_elements(l.values().as_ref(), true)) {
                Some(inner) => (0..a.len())
                    .map(|i| {
                        let s = l.value_offset(i) as usize;
                        inner.get(s..s + k as usize).map_or(0, |c| c.iter().sum())
                    })
                    .collect(),
                None => vec![k; a.len()],
            }
        }
        _ => vec![1; a.len()],
    }
}

/// Bytes an element of type `t` takes when it is empty or NULL (fixed-size types keep their
/// width; variable-size ones an offset), or the size of a fixed-width value.
pub fn element_bytes(t: &DataType) -> u64 {
    match t {
        DataType::Null | DataType::Boolean => 1,
        DataType::FixedSizeBinary(n) => (*n).max(0) as u64,
        DataType::FixedSizeList(f, n) => {
            ((*n).max(0) as u64).saturating_mul(element_bytes(f.data_type()))
        }
        DataType::Struct(fields) => fields.iter().map(|f| element_bytes(f.data_type())).sum(),
        DataType::Utf8View | DataType::BinaryView => VIEW,
        other => other.primitive_width().map_or(OFFSET, |w| w as u64),
    }
}
