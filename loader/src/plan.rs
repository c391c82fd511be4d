//! The order in which one epoch visits samples, and which part of it each rank and worker
//! reads. Everything here is index arithmetic over row-group sizes taken from the manifest,
//! so every machine computes the same order without reading a byte of data.
//!
//! The order of an epoch (a "block shuffle"):
//! 1. the row groups ("units") are permuted with a stream keyed by (seed, epoch, segment);
//! 2. consecutive runs of `window` units form windows; the samples of each window are
//!    permuted with a stream keyed by (seed, epoch, segment, window index).
//!
//! A sample can thus land anywhere in the epoch (its row group's place is uniform), while a
//! reader only ever holds about one window of row groups: a sample-level global permutation
//! would read each row group once per sample it contains.
//!
//! Partition: the epoch's sequence (N samples) is extended by repeating it from its start
//! (`Remainder::Pad`, to `world × ceil(N / world)`) or cut (`Remainder::Drop`, to
//! `world × floor(N / world)`); rank r takes the r-th contiguous slice, so ranks read
//! mostly different row groups. A rank's slice is split among its workers contiguously,
//! the first `len mod workers` workers taking one more sample.
use crate::rng::SplitMix64;
use crate::Remainder;

/// One row group: the unit of reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unit {
    /// Index of the shard in the manifest.
    pub shard: usize,
    /// Row group within the shard.
    pub row_group: usize,
    /// Rows (samples) in it.
    pub rows: u64,
}

/// One sample picked by the plan: the index of its unit in the plan's unit list, and the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pick {
    pub unit: usize,
    pub row: u64,
}

/// Who reads: a rank and a worker within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    pub rank: usize,
    pub world_size: usize,
    pub worker: usize,
    pub num_workers: usize,
}

/// The order of one epoch over one set of units, and one reader's slice of it.
#[derive(Debug, Clone)]
pub(crate) struct EpochPlan {
    units: Vec<Unit>,
    /// Units in visiting order (indices into `units`).
    order: Vec<usize>,
    /// `starts[k]` = samples before the k-th visited unit; one extra entry at the end = N.
    starts: Vec<u64>,
    window: usize,
    key: Option<[u64; 3]>,
    /// This reader's slice of the extended sequence.
    begin: u64,
    len: u64,
}

impl EpochPlan {
    /// The plan of one epoch. `key` is `None` for no shuffling, else (seed, epoch, segment).
    pub(crate) fn new(
        units: Vec<Unit>,
        key: Option<[u64; 3]>,
        window: usize,
        part: Part,
        rem: Remainder,
    ) -> Self {
        let mut order: Vec<usize> = (0..units.len()).collect();
        if let Some([seed, epoch, segment]) = key {
            SplitMix64::keyed(&[seed, epoch, segment, 0x756e_6974]).shuffle(&mut order);
        }
        let mut starts = Vec::with_capacity(order.len() + 1);
        let mut acc = 0u64;
        for &u in &order {
            starts.push(acc);
            acc += units[u].rows;
        }
        starts.push(acc);
        let n = acc;
        let world = part.world_size as u64;
        let per_rank = match rem {
            Remainder::Pad => n.div_ceil(world),
            Remainder::Drop => n / world,
        };
        let workers = part.num_workers as u64;
        let w = part.worker as u64;
        let base = per_rank / workers;
        let extra = per_rank % workers;
        let begin = part.rank as u64 * per_rank + w * base + w.min(extra);
        let len = base + u64::from(w < extra);
        EpochPlan {
            units,
            order,
            starts,
            window: window.max(1),
            key,
            begin,
            len,
        }
    }

    /// The units, indexed by [`Pick::unit`].
    pub(crate) fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Samples in the whole epoch (before padding or dropping).
    pub(crate) fn total(&self) -> u64 {
        *self.starts.last().unwrap_or(&0)
    }

    /// Samples this reader visits in the epoch.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// This reader's picks from its `from`-th sample on.
    pub(crate) fn picks_from(&self, from: u64) -> Picks<'_> {
        Picks {
            plan: self,
            next: from.min(self.len),
            cached: None,
        }
    }

    /// The sample at position `g` of the unextended epoch sequence (`g < total`).
    fn global(&self, g: u64, cached: &mut Option<(usize, Vec<u64>)>) -> Pick {
        let k = self.order.len();
        // Window of visited units holding g: the visited unit at g, rounded down to a window.
        let visited = self.starts.partition_point(|&s| s <= g) - 1;
        let w = visited / self.window;
        let first = w * self.window;
        let last = ((w + 1) * self.window).min(k);
        let lo = self.starts[first];
        let offset = match self.key {
            None => g - lo,
            Some([seed, epoch, segment]) => {
                if cached.as_ref().map(|c| c.0) != Some(w) {
                    let mut perm: Vec<u64> = (0..self.starts[last] - lo).collect();
                    SplitMix64::keyed(&[seed, epoch, segment, 0x7769_6e64, w as u64])
                        .shuffle(&mut perm);
                    *cached = Some((w, perm));
                }
                match cached {
                    Some((_, perm)) => perm[(g - lo) as usize],
                    None => g - lo,
                }
            }
        };
        let pos = lo + offset;
        let v = self.starts.partition_point(|&s| s <= pos) - 1;
        Pick {
            unit: self.order[v],
            row: pos - self.starts[v],
        }
    }
}

/// Iterator over a reader's picks, in order.
pub(crate) struct Picks<'a> {
    plan: &'a EpochPlan,
    next: u64,
    cached: Option<(usize, Vec<u64>)>,
}

impl Iterator for Picks<'_> {
    type Item = Pick;
    fn next(&mut self) -> Option<Pick> {
        let n = self.plan.total();
        if self.next >= self.plan.len || n == 0 {
            return None;
        }
        let extended = self.plan.begin + self.next;
        // Padding repeats the epoch's sequence from its start.
        let g = if extended < n {
            extended
        } else {
            (extended - n) % n
        };
        self.next += 1;
        Some(self.plan.global(g, &mut self.cached))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn units(sizes: &[u64]) -> Vec<Unit> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &rows)| Unit {
                shard: i / 2,
                row_group: i % 2,
                rows,
            })
            .collect()
    }

    fn one(rank: usize, world: usize) -> Part {
        Part {
            rank,
            world_size: world,
            worker: 0,
            num_workers: 1,
        }
    }

    /// Picks as (unit, row) flattened to a global sample number for easy comparison.
    fn ids(plan: &EpochPlan, from: u64) -> Vec<u64> {
        let mut off = vec![0u64];
        for u in plan.units() {
            off.push(off.last().unwrap() + u.rows);
        }
        plan.picks_from(from).map(|p| off[p.unit] + p.row).collect()
    }

    const SIZES: [u64; 7] = [5, 3, 8, 1, 6, 4, 6]; // 33 samples

    #[test]
    fn unshuffled_single_reader_visits_in_storage_order() {
        let p = EpochPlan::new(units(&SIZES), None, 2, one(0, 1), Remainder::Pad);
        assert_eq!(ids(&p, 0), (0..33).collect::<Vec<_>>());
    }

    #[test]
    fn shuffled_epoch_is_a_permutation_that_changes_with_epoch_and_seed() {
        let a = ids(
            &EpochPlan::new(units(&SIZES), Some([1, 0, 0]), 2, one(0, 1), Remainder::Pad),
            0,
        );
        let b = ids(
            &EpochPlan::new(units(&SIZES), Some([1, 1, 0]), 2, one(0, 1), Remainder::Pad),
            0,
        );
        let c = ids(
            &EpochPlan::new(units(&SIZES), Some([2, 0, 0]), 2, one(0, 1), Remainder::Pad),
            0,
        );
        assert_eq!(a.iter().copied().collect::<BTreeSet<_>>().len(), 33);
        assert_eq!(a.len(), 33);
        assert_ne!(a, (0..33).collect::<Vec<_>>());
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn shuffled_order_is_pinned_across_machines() {
        // The exact order for one key, computed once; a change here breaks resume across
        // versions of hslake and must be deliberate.
        let a = ids(
            &EpochPlan::new(units(&SIZES), Some([7, 0, 0]), 2, one(0, 1), Remainder::Pad),
            0,
        );
        let again = ids(
            &EpochPlan::new(units(&SIZES), Some([7, 0, 0]), 2, one(0, 1), Remainder::Pad),
            0,
        );
        assert_eq!(a, again);
        assert_eq!(&a[..8], &PINNED[..]);
    }
    const PINNED: [u64; 8] = [7, 5, 3, 6, 4, 0, 2, 1];

    #[test]
    fn ranks_are_disjoint_and_cover_everything_when_dropping() {
        for world in 1..6 {
            let mut all = Vec::new();
            for r in 0..world {
                let p = EpochPlan::new(
                    units(&SIZES),
                    Some([3, 2, 0]),
                    3,
                    one(r, world),
                    Remainder::Drop,
                );
                assert_eq!(p.len(), 33 / world as u64);
                all.extend(ids(&p, 0));
            }
            let set: BTreeSet<_> = all.iter().copied().collect();
            assert_eq!(
                set.len(),
                all.len(),
                "world {world}: a sample went to two ranks"
            );
            assert_eq!(all.len() as u64, 33 - 33 % world as u64);
        }
    }

    #[test]
    fn padding_gives_equal_shares_covering_everything_repeating_from_the_start() {
        for world in 1..8 {
            let mut all = Vec::new();
            for r in 0..world {
                let p = EpochPlan::new(
                    units(&SIZES),
                    Some([3, 2, 0]),
                    3,
                    one(r, world),
                    Remainder::Pad,
                );
                assert_eq!(p.len(), 33u64.div_ceil(world as u64));
                all.extend(ids(&p, 0));
            }
            let set: BTreeSet<_> = all.iter().copied().collect();
            assert_eq!(set.len(), 33, "world {world}: every sample at least once");
            let extra = all.len() - 33;
            assert_eq!(
                &all[33..],
                &all[..extra],
                "padding repeats the start of the order"
            );
        }
    }

    #[test]
    fn workers_split_their_rank_exactly() {
        let whole = ids(
            &EpochPlan::new(units(&SIZES), Some([5, 0, 0]), 2, one(1, 2), Remainder::Pad),
            0,
        );
        let mut joined = Vec::new();
        for w in 0..3 {
            let part = Part {
                rank: 1,
                world_size: 2,
                worker: w,
                num_workers: 3,
            };
            joined.extend(ids(
                &EpochPlan::new(units(&SIZES), Some([5, 0, 0]), 2, part, Remainder::Pad),
                0,
            ));
        }
        assert_eq!(joined, whole);
    }

    #[test]
    fn resuming_from_a_position_continues_the_same_sequence() {
        let p = EpochPlan::new(units(&SIZES), Some([9, 4, 1]), 3, one(0, 1), Remainder::Pad);
        let all = ids(&p, 0);
        for k in [0, 1, 7, 32, 33, 40] {
            assert_eq!(ids(&p, k), all[(k as usize).min(33)..].to_vec());
        }
    }

    #[test]
    fn samples_of_one_window_stay_within_that_window() {
        // Window of 2 units: the first window's picks all come from the first two visited units.
        let p = EpochPlan::new(
            units(&SIZES),
            Some([11, 0, 0]),
            2,
            one(0, 1),
            Remainder::Pad,
        );
        let picks: Vec<Pick> = p.picks_from(0).collect();
        let first_two: BTreeSet<usize> = p.order[..2].iter().copied().collect();
        let n: u64 = p.order[..2].iter().map(|&u| SIZES[u]).sum();
        assert!(picks[..n as usize]
            .iter()
            .all(|q| first_two.contains(&q.unit)));
    }

    #[test]
    fn empty_dataset_yields_nothing() {
        let p = EpochPlan::new(Vec::new(), Some([1, 0, 0]), 2, one(1, 2), Remainder::Pad);
        assert_eq!(p.picks_from(0).count(), 0);
    }
}
