//! Expert alignment for grouped GEMMs: where each of a layer's token-expert assignments goes
//! (sorted stably by this rank's expert, other ranks' assignments after every group), the
//! groups' ends, and the way back: each token's rows weighted and summed over its top-k. By
//! libtorch's operations (the reference; transformers' `grouped_mm_experts_forward` order), or
//! by our kernels under `--moe-route fused` (`gpu/fused/moe.rs`), which keep the same order and
//! so the same bits.
use tch::{Kind, Tensor};

use crate::error::Result;
use crate::gpu::fused::align as fused;
use crate::kernels::Fusion;
use crate::scalar;

/// A layer's assignments placed for its grouped GEMMs.
pub(crate) struct Aligned {
    /// `[n * k]` int64: the token at each sorted position (the rows of `x` the GEMMs read).
    pub rows: Tensor,
    /// `[local]` int32: each local expert's group end among the sorted positions.
    pub ends: Tensor,
    back: Back,
}

/// What the way back needs.
enum Back {
    /// libtorch's: the stable permutation, and which assignments are this rank's.
    Torch { perm: Tensor, mine: Tensor },
    /// Our kernels': each assignment's sorted position.
    Fused { inverse: Tensor },
}

impl Aligned {
    /// The alignment of `ids [n, k]` by local expert `id - first` in `0..local`.
    pub fn new(ids: &Tensor, first: i64, local: i64, fusion: Fusion) -> Result<Self> {
        let k = ids.size()[1];
        if fusion == Fusion::Fused {
            if let Some(a) = fused::align(ids, first, local)? {
                return Ok(Aligned {
                    rows: a.rows,
                    ends: a.ends,
                    back: Back::Fused { inverse: a.inverse },
                });
            }
        }
        // Each assignment's local expert, or `local` (past every group) for another rank's;
        // sorted stably, so assignments keep their order (token, then slot) within a group.
        let mine = mine(ids, first, local)?;
        let key = ids
            .f_reshape([-1])?
            .f_sub(&scalar::int(first)?)?
            .f_where_self(&mine, &scalar::int(local)?)?;
        let (_, perm) = key.f_sort_stable(true, 0, false)?;
        // Group ends: the running count of assignments per local expert, as int32.
        let ends = key
            .f_bincount::<Tensor>(None, local + 1)?
            .f_narrow(0, 0, local)?
            .f_cumsum(0, Kind::Int)?;
        Ok(Aligned {
            rows: perm.f_floor_divide(&scalar::int(k)?)?,
            ends,
            back: Back::Torch { perm, mine },
        })
    }

    /// `[n * k]` int64: each assignment's sorted position.
    pub fn positions(&self) -> Result<Tensor> {
        match &self.back {
            Back::Torch { perm, .. } => Ok(perm.f_argsort(0, false)?),
            Back::Fused { inverse } => Ok(inverse.shallow_clone()),
        }
    }

    /// The routed experts' output `[n, hidden]` in `kind` from `y [n * k, hidden]` (the GEMMs'
    /// rows in sorted order; rows past the last group unwritten): each assignment's row times
    /// its weight in the weights' dtype (f32 for DeepSeek), other ranks' assignments zero,
    /// summed over each token's top-k in that dtype.
    pub fn unpermute(
        &self,
        y: &Tensor,
        ids: &Tensor,
        weights: &Tensor,
        (first, local): (i64, i64),
        kind: Kind,
    ) -> Result<Tensor> {
        let (n, k, hidden) = (ids.size()[0], ids.size()[1], y.size()[1]);
        let summed = |rows: Tensor| -> Result<Tensor> {
            Ok(rows
                .f_view([n, k, hidden])?
                .f_sum_dim_intlist([1i64].as_slice(), false, None::<Kind>)?
                .f_to_kind(kind)?)
        };
        match &self.back {
            Back::Torch { perm, mine } => {
                let sorted_weights = weights.f_reshape([-1])?.f_index_select(0, perm)?;
                let other = mine.f_index_select(0, perm)?.f_logical_not()?;
                let y = y
                    .f_mul(&sorted_weights.f_unsqueeze(1)?)?
                    .f_masked_fill_tensor(&other.f_unsqueeze(1)?, &scalar::float(0.0)?)?;
                summed(y.f_index_select(0, &perm.f_argsort(0, false)?)?)
            }
            Back::Fused { inverse } => {
                if let Some(out) = fused::unpermute(y, inverse, ids, weights, first, local)? {
                    return Ok(out.f_to_kind(kind)?);
                }
                // The same products and sums in assignment order: a multiply and a mask per
                // row commute with the permutation.
                let other = mine(ids, first, local)?.f_logical_not()?;
                let y = y
                    .f_index_select(0, inverse)?
                    .f_mul(&weights.f_reshape([-1, 1])?)?
                    .f_masked_fill_tensor(&other.f_unsqueeze(1)?, &scalar::float(0.0)?)?;
                summed(y)
            }
        }
    }
}

/// `[n * k]` booleans: whether each assignment's expert is one of `first..first + local`.
fn mine(ids: &Tensor, first: i64, local: i64) -> Result<Tensor> {
    let rel = ids.f_reshape([-1])?.f_sub(&scalar::int(first)?)?;
    Ok(rel
        .f_ge_tensor(&scalar::int(0)?)?
        .f_logical_and(&rel.f_lt_tensor(&scalar::int(local)?)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The kernels' algorithm on the CPU: counts per chunk, a scan into each chunk's first
    /// position per group, then each chunk placed 32 assignments at a time (an assignment after
    /// its group's earlier ones, lower lanes first), as `align_count`, `align_scan` and
    /// `align_place` do; `chunk` small, so that several chunks and steps are crossed.
    fn emulate(ids: &[i64], first: i64, local: i64, chunk: usize) -> (Vec<i64>, Vec<i32>) {
        let group = |id: i64| match id - first {
            r if (0..local).contains(&r) => r as usize,
            _ => local as usize,
        };
        let groups = local as usize + 1;
        let chunks: Vec<&[i64]> = ids.chunks(chunk).collect();
        let counts: Vec<Vec<usize>> = chunks
            .iter()
            .map(|c| {
                let mut n = vec![0; groups];
                c.iter().for_each(|&id| n[group(id)] += 1);
                n
            })
            .collect();
        let totals: Vec<usize> = (0..groups)
            .map(|g| counts.iter().map(|c| c[g]).sum())
            .collect();
        let starts: Vec<usize> = (0..groups).map(|g| totals[..g].iter().sum()).collect();
        let mut inverse = vec![0i64; ids.len()];
        for (c, part) in chunks.iter().enumerate() {
            let mut next: Vec<usize> = (0..groups)
                .map(|g| starts[g] + counts[..c].iter().map(|n| n[g]).sum::<usize>())
                .collect();
            for (s, step) in part.chunks(32).enumerate() {
                let placed: Vec<usize> = step
                    .iter()
                    .enumerate()
                    .map(|(lane, &id)| {
                        let g = group(id);
                        next[g] + step[..lane].iter().filter(|&&o| group(o) == g).count()
                    })
                    .collect();
                for (lane, &pos) in placed.iter().enumerate() {
                    inverse[c * chunk + s * 32 + lane] = pos as i64;
                }
                for &id in step {
                    next[group(id)] += 1;
                }
            }
        }
        let ends = (0..local as usize)
            .map(|g| (starts[g] + totals[g]) as i32)
            .collect();
        (inverse, ends)
    }

    #[test]
    fn the_kernels_chunked_placement_is_the_stable_sort_of_the_reference() {
        let (n, k) = (700i64, 3i64);
        let ids: Vec<i64> = (0..n * k).map(|a| (a * 7919 + a / 5) % 11).collect();
        let t = Tensor::from_slice(&ids).view([n, k]);
        for (first, local) in [(0, 11), (3, 4), (9, 2)] {
            let reference = Aligned::new(&t, first, local, Fusion::Torch).unwrap();
            let Back::Torch { perm, .. } = &reference.back else {
                unreachable!()
            };
            let want_inverse = Vec::<i64>::try_from(perm.argsort(0, false)).unwrap();
            let want_ends = Vec::<i32>::try_from(&reference.ends).unwrap();
            let (inverse, ends) = emulate(&ids, first, local, 64);
            assert_eq!(inverse, want_inverse, "experts {first}..+{local}");
            assert_eq!(ends, want_ends, "experts {first}..+{local}");
            let rows = Vec::<i64>::try_from(&reference.rows).unwrap();
            for (a, &pos) in inverse.iter().enumerate() {
                assert_eq!(rows[pos as usize], a as i64 / k);
            }
        }
    }

    #[test]
    fn the_way_back_through_positions_equals_the_way_back_through_the_permutation() {
        tch::manual_seed(5);
        let (n, k, hidden) = (9i64, 2i64, 4i64);
        let ids = Tensor::from_slice(&[0i64, 3, 1, 2, 4, 0, 3, 1, 2, 2, 0, 4, 1, 3, 4, 1, 2, 0])
            .view([n, k]);
        for (first, local, wkind) in [(0, 5, Kind::BFloat16), (1, 2, Kind::Float)] {
            let aligned = Aligned::new(&ids, first, local, Fusion::Torch).unwrap();
            let y =
                Tensor::randn([n * k, hidden], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
            let w = Tensor::rand([n, k], (Kind::Float, Device::Cpu)).to_kind(wkind);
            let want = aligned
                .unpermute(&y, &ids, &w, (first, local), Kind::BFloat16)
                .unwrap();
            let Back::Torch { perm, .. } = &aligned.back else {
                unreachable!()
            };
            let by_position = Aligned {
                rows: aligned.rows.shallow_clone(),
                ends: aligned.ends.shallow_clone(),
                back: Back::Fused {
                    inverse: perm.argsort(0, false),
                },
            };
            let got = by_position
                .unpermute(&y, &ids, &w, (first, local), Kind::BFloat16)
                .unwrap();
            assert!(
                got.equal(&want),
                "experts {first}..+{local}, {wkind:?} weights"
            );
        }
    }
}
