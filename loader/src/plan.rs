//! The order in which one epoch visits samples, and which part of it each rank and worker
//! reads. Everything here is index arithmetic over row-group sizes taken from the manifest,
//! so every machine computes the same order without reading a byte of data.
//!
//! The window order of an epoch (a "block shuffle", [`Mode::Window`]):
//! 1. the row groups ("units") are permuted with a stream keyed by (seed, epoch, segment);
//! 2. consecutive runs of `window` units form windows; the samples of each window are
//!    permuted with a stream keyed by (seed, epoch, segment, window index).
//!
//! A sample can thus land anywhere in the epoch (its row group's place is uniform), while a
//! reader only ever holds about one window of row groups; but a batch mixes only the row
//! groups of one window.
//!
//! The sample order ([`Mode::Sample`]) is a full per-sample permutation: the epoch's samples,
//! numbered in storage order (units in manifest order, rows in order), permuted by
//! Fisher-Yates with a stream keyed by (seed, epoch, segment). It costs 8 bytes per sample of
//! the segment to hold; the reader reads a row group once per lookahead it has samples in
//! (`schedule`), only the rows picked.
//!
//! Partition (both orders): the epoch's sequence (N samples) is extended by repeating it from
//! its start (`Remainder::Pad`, to `world × ceil(N / world)`) or cut (`Remainder::Drop`, to
//! `world × floor(N / world)`); rank r takes the r-th contiguous slice. A rank's slice is split
//! among its workers contiguously, the first `len mod workers` workers taking one more sample.
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
    /// Raw tensor bytes of one of its samples, on average over its shard (from the manifest):
    /// what the reader budgets a lookahead with.
    pub row_bytes: u64,
}

/// Which order a plan gives its epoch (when it is keyed; unkeyed plans keep storage order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Block shuffle with windows of this many units.
    Window(usize),
    /// A full per-sample permutation.
    Sample,
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
    /// Sample mode: `perm[g]` = storage-order number of the epoch's g-th sample.
    perm: Option<Vec<u64>>,
    /// This reader's slice of the extended sequence.
    begin: u64,
    len: u64,
}

impl EpochPlan {
    /// The plan of one epoch. `key` is `None` for no shuffling, else (seed, epoch, segment).
    pub(crate) fn new(
        units: Vec<Unit>,
        key: Option<[u64; 3]>,
        mode: Mode,
        part: Part,
        rem: Remainder,
    ) -> Self {
        let mut order: Vec<usize> = (0..units.len()).collect();
        let (window, key, perm_key) = match mode {
            Mode::Window(w) => (w, key, None),
            // The sample permutation replaces both steps of the window order.
            Mode::Sample => (1, None, key),
        };
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
        let perm = perm_key.map(|[seed, epoch, segment]| {
            let mut perm: Vec<u64> = (0..n).collect();
            SplitMix64::keyed(&[seed, epoch, segment, 0x7361_6d70]).shuffle(&mut perm);
            perm
        });
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
            perm,
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
        if let Some(perm) = &self.perm {
            // Units are in storage order here: the storage number locates the unit directly.
            let pos = perm[g as usize];
            let v = self.starts.partition_point(|&s| s <= pos) - 1;
            return Pick {
                unit: self.order[v],
                row: pos - self.starts[v],
            };
        }
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
                row_bytes: 100,
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

    /// The whole epoch's order for `key` in `mode`: one rank, one worker, from the start.
    fn whole_order(key: [u64; 3], mode: Mode) -> Vec<u64> {
        ids(
            &EpochPlan::new(units(&SIZES), Some(key), mode, one(0, 1), Remainder::Pad),
            0,
        )
    }

    const SIZES: [u64; 7] = [5, 3, 8, 1, 6, 4, 6]; // 33 samples

    #[test]
    fn unshuffled_single_reader_visits_in_storage_order() {
        let p = EpochPlan::new(
            units(&SIZES),
            None,
            Mode::Window(2),
            one(0, 1),
            Remainder::Pad,
        );
        assert_eq!(ids(&p, 0), (0..33).collect::<Vec<_>>());
    }

    #[test]
    fn shuffled_epoch_is_a_permutation_that_changes_with_epoch_and_seed() {
        let a = whole_order([1, 0, 0], Mode::Window(2));
        let b = whole_order([1, 1, 0], Mode::Window(2));
        let c = whole_order([2, 0, 0], Mode::Window(2));
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
        let a = whole_order([7, 0, 0], Mode::Window(2));
        let again = whole_order([7, 0, 0], Mode::Window(2));
        assert_eq!(a, again);
        assert_eq!(&a[..8], &PINNED[..]);
    }
    const PINNED: [u64; 8] = [7, 5, 3, 6, 4, 0, 2, 1];

    const MODES: [Mode; 2] = [Mode::Window(3), Mode::Sample];

    #[test]
    fn ranks_are_disjoint_and_cover_everything_when_dropping() {
        for mode in MODES {
            for world in 1..6 {
                let mut all = Vec::new();
                for r in 0..world {
                    let p = EpochPlan::new(
                        units(&SIZES),
                        Some([3, 2, 0]),
                        mode,
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
                    "{mode:?} world {world}: a sample went to two ranks"
                );
                assert_eq!(all.len() as u64, 33 - 33 % world as u64);
            }
        }
    }

    #[test]
    fn padding_gives_equal_shares_covering_everything_repeating_from_the_start() {
        for mode in MODES {
            for world in 1..8 {
                let mut all = Vec::new();
                for r in 0..world {
                    let p = EpochPlan::new(
                        units(&SIZES),
                        Some([3, 2, 0]),
                        mode,
                        one(r, world),
                        Remainder::Pad,
                    );
                    assert_eq!(p.len(), 33u64.div_ceil(world as u64));
                    all.extend(ids(&p, 0));
                }
                let set: BTreeSet<_> = all.iter().copied().collect();
                assert_eq!(
                    set.len(),
                    33,
                    "{mode:?} world {world}: every sample at least once"
                );
                let extra = all.len() - 33;
                assert_eq!(
                    &all[33..],
                    &all[..extra],
                    "{mode:?}: padding repeats the start of the order"
                );
            }
        }
    }

    #[test]
    fn workers_split_their_rank_exactly() {
        for mode in MODES {
            for rem in [Remainder::Pad, Remainder::Drop] {
                let whole = ids(
                    &EpochPlan::new(units(&SIZES), Some([5, 0, 0]), mode, one(1, 2), rem),
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
                        &EpochPlan::new(units(&SIZES), Some([5, 0, 0]), mode, part, rem),
                        0,
                    ));
                }
                assert_eq!(joined, whole, "{mode:?} {rem:?}");
            }
        }
    }

    #[test]
    fn resuming_from_a_position_continues_the_same_sequence() {
        for mode in MODES {
            let p = EpochPlan::new(
                units(&SIZES),
                Some([9, 4, 1]),
                mode,
                one(0, 1),
                Remainder::Pad,
            );
            let all = ids(&p, 0);
            for k in [0, 1, 7, 32, 33, 40] {
                assert_eq!(ids(&p, k), all[(k as usize).min(33)..].to_vec(), "{mode:?}");
            }
        }
    }

    #[test]
    fn sample_order_is_a_permutation_that_changes_with_epoch_seed_and_segment() {
        let order = |key: [u64; 3]| whole_order(key, Mode::Sample);
        let a = order([1, 0, 0]);
        assert_eq!(a.iter().copied().collect::<BTreeSet<_>>().len(), 33);
        assert_eq!(a.len(), 33);
        assert_ne!(a, (0..33).collect::<Vec<_>>());
        for other in [[1, 1, 0], [2, 0, 0], [1, 0, 1]] {
            assert_ne!(a, order(other), "{other:?}");
        }
        assert_eq!(a, order([1, 0, 0]));
        let window = whole_order([1, 0, 0], Mode::Window(2));
        assert_ne!(a, window);
        let unkeyed = EpochPlan::new(units(&SIZES), None, Mode::Sample, one(0, 1), Remainder::Pad);
        assert_eq!(ids(&unkeyed, 0), (0..33).collect::<Vec<_>>());
    }

    #[test]
    fn sample_order_is_pinned_across_machines() {
        // As for the window order: a change here breaks resume across versions of hslake.
        let a = whole_order([7, 0, 0], Mode::Sample);
        assert_eq!(&a[..8], &PINNED_SAMPLE[..]);
    }
    const PINNED_SAMPLE: [u64; 8] = [7, 26, 17, 9, 15, 30, 13, 21];

    /// The mixing metric: distinct runs of 64 consecutive storage-order samples in a
    /// batch of 32, averaged over full batches (a per-sample permutation gives about 30.5 when
    /// the epoch has many runs).
    fn mixing(order: &[u64]) -> f64 {
        let full: Vec<&[u64]> = order.chunks(32).filter(|b| b.len() == 32).collect();
        let distinct: usize = full
            .iter()
            .map(|b| b.iter().map(|s| s / 64).collect::<BTreeSet<_>>().len())
            .sum();
        distinct as f64 / full.len() as f64
    }

    #[test]
    fn sample_order_mixes_batches_as_a_full_permutation_where_the_window_order_does_not() {
        // 2,500 row groups of 8 samples: a window of 16 row groups spans 128 samples.
        let sizes = vec![8u64; 2500];
        let plan = |mode| {
            EpochPlan::new(
                units(&sizes),
                Some([0, 0, 0]),
                mode,
                one(0, 1),
                Remainder::Pad,
            )
        };
        let sample = mixing(&ids(&plan(Mode::Sample), 0));
        let window = mixing(&ids(&plan(Mode::Window(16)), 0));
        assert!(sample >= 30.0, "sample order mixes {sample:.2} of 32");
        assert!(window < 29.0, "window order mixes {window:.2} of 32");
        // Each rank's slice is mixed alike.
        let rank = ids(
            &EpochPlan::new(
                units(&sizes),
                Some([0, 0, 0]),
                Mode::Sample,
                one(3, 8),
                Remainder::Pad,
            ),
            0,
        );
        assert!(mixing(&rank) >= 30.0, "{}", mixing(&rank));
    }

    #[test]
    fn samples_of_one_window_stay_within_that_window() {
        // Window of 2 units: the first window's picks all come from the first two visited units.
        let p = EpochPlan::new(
            units(&SIZES),
            Some([11, 0, 0]),
            Mode::Window(2),
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
        let p = EpochPlan::new(
            Vec::new(),
            Some([1, 0, 0]),
            Mode::Window(2),
            one(1, 2),
            Remainder::Pad,
        );
        assert_eq!(p.picks_from(0).count(), 0);
    }
}
