//! Which row-group reads serve a plan's picks: the order in which the loader reads, beside
//! `plan`, which fixes the order in which it yields.
use std::collections::HashMap;

use crate::plan::{EpochPlan, Pick};
use crate::{LoaderConfig, LoaderError, ShuffleMode};

/// One read of a row group: every row (window order), or the rows one lookahead picks from it
/// (sample order).
pub(crate) struct Read {
    /// The unit (index into the plan's units) read.
    pub unit: usize,
    /// The rows read, ascending (`None`: all of them).
    pub rows: Option<Vec<usize>>,
}

/// Which read serves each pick, and at which row of what it returns.
pub(crate) enum Assign {
    /// Window order: one read per unit (`unit → read`), at the pick's own row.
    ByUnit(Vec<usize>),
    /// Sample order: per pick, from the reader's `from`-th on.
    PerPick(Vec<(u32, u32)>),
}

impl Assign {
    /// The read serving the `i`-th pick from the schedule's start, and the pick's row in what
    /// that read returns.
    pub(crate) fn of(&self, i: usize, pick: Pick) -> (usize, usize) {
        match self {
            Assign::ByUnit(read_of) => (read_of[pick.unit], pick.row as usize),
            Assign::PerPick(v) => (v[i].0 as usize, v[i].1 as usize),
        }
    }
}

/// The reads of one segment from a position on, in the order they are first needed, and how
/// often each is needed, so that each is dropped after its last use.
///
/// Window order: each unit is read once, whole. Sample order: the picks are cut into
/// lookaheads of about `lookahead_bytes` (by the manifest's raw bytes per sample, at least
/// one pick each); within a lookahead each unit it touches is read once, only the rows picked,
/// so memory holds about one lookahead while every sample is still decoded once. Where the
/// lookaheads fall does not change the order, so a resumed stream may cut them elsewhere.
pub(crate) struct Schedule {
    /// The reads, in the order they are first needed.
    pub reads: Vec<Read>,
    /// How many picks each read serves.
    pub uses: Vec<u32>,
    /// Which read serves each pick.
    pub assign: Assign,
}

impl Schedule {
    /// Reads in flight for about `row_groups` row groups' worth of rows: a read of some rows is
    /// as much smaller, so more of them run at once to keep the decode threads busy.
    pub(crate) fn depth(&self, plan: &EpochPlan, row_groups: usize) -> usize {
        let (mut unit_rows, mut read_rows) = (0u64, 0u64);
        for r in &self.reads {
            unit_rows += plan.units()[r.unit].rows;
            read_rows += r
                .rows
                .as_ref()
                .map_or(plan.units()[r.unit].rows, |v| v.len() as u64);
        }
        let ratio = unit_rows.div_ceil(read_rows.max(1)).clamp(1, 64) as usize;
        row_groups.saturating_mul(ratio)
    }

    /// The schedule of `plan`'s picks from `from` on, in the order `c` shuffles by.
    pub(crate) fn new(
        plan: &EpochPlan,
        from: u64,
        c: &LoaderConfig,
    ) -> Result<Schedule, LoaderError> {
        let mut reads = Vec::new();
        let mut uses = Vec::new();
        if !(c.shuffle && c.shuffle_mode == ShuffleMode::Sample) {
            let mut read_of = vec![usize::MAX; plan.units().len()];
            for p in plan.picks_from(from) {
                if read_of[p.unit] == usize::MAX {
                    read_of[p.unit] = reads.len();
                    reads.push(Read {
                        unit: p.unit,
                        rows: None,
                    });
                    uses.push(0);
                }
                uses[read_of[p.unit]] += 1;
            }
            return Ok(Schedule {
                reads,
                uses,
                assign: Assign::ByUnit(read_of),
            });
        }
        let units = plan.units();
        let left = plan.len().saturating_sub(from);
        if left > u64::from(u32::MAX) {
            return Err(LoaderError::Config(format!(
                "this reader's part of the epoch holds {left} samples; the sample shuffle takes \
                 at most {} per reader: divide it among more ranks or workers",
                u32::MAX
            )));
        }
        let mut assign = Vec::with_capacity(left as usize);
        let mut picks = plan.picks_from(from).peekable();
        let mut chunk: Vec<Pick> = Vec::new();
        let mut read_of: HashMap<usize, usize> = HashMap::new();
        while picks.peek().is_some() {
            chunk.clear();
            read_of.clear();
            let mut bytes = 0u64;
            while let Some(&p) = picks.peek() {
                let cost = units[p.unit].row_bytes.max(1);
                if !chunk.is_empty() && bytes.saturating_add(cost) > c.lookahead_bytes {
                    break;
                }
                bytes = bytes.saturating_add(cost);
                chunk.push(p);
                picks.next();
            }
            let first = reads.len();
            for p in &chunk {
                let r = *read_of.entry(p.unit).or_insert_with(|| {
                    reads.push(Read {
                        unit: p.unit,
                        rows: Some(Vec::new()),
                    });
                    uses.push(0);
                    reads.len() - 1
                });
                if let Some(rows) = &mut reads[r].rows {
                    rows.push(p.row as usize);
                }
                uses[r] += 1;
            }
            for read in &mut reads[first..] {
                if let Some(rows) = &mut read.rows {
                    rows.sort_unstable();
                    rows.dedup();
                }
            }
            for p in &chunk {
                let r = read_of[&p.unit];
                let rows = reads[r].rows.as_deref().unwrap_or_default();
                let local = rows.binary_search(&(p.row as usize)).unwrap_or(0);
                assign.push((r as u32, local as u32));
            }
        }
        Ok(Schedule {
            reads,
            uses,
            assign: Assign::PerPick(assign),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Mode, Part, Unit};
    use crate::Remainder;

    /// Units of these row counts, each sample estimated at 100 raw bytes.
    fn plan(sizes: &[u64], mode: Mode) -> EpochPlan {
        let units = sizes
            .iter()
            .enumerate()
            .map(|(i, &rows)| Unit {
                shard: 0,
                row_group: i,
                rows,
                row_bytes: 100,
            })
            .collect();
        let part = Part {
            rank: 0,
            world_size: 1,
            worker: 0,
            num_workers: 1,
        };
        EpochPlan::new(units, Some([7, 0, 0]), mode, part, Remainder::Pad)
    }

    fn config(mode: ShuffleMode, lookahead_bytes: u64) -> LoaderConfig {
        LoaderConfig {
            batch_size: Some(1),
            shuffle_mode: mode,
            lookahead_bytes,
            ..Default::default()
        }
    }

    /// Every pick from `from` on is served by a read of its unit that returns its row, and each
    /// read is used exactly as often as picks name it.
    fn assert_serves_every_pick(p: &EpochPlan, from: u64, s: &Schedule) {
        let mut uses = vec![0u32; s.reads.len()];
        for (i, pick) in p.picks_from(from).enumerate() {
            let (read, row) = s.assign.of(i, pick);
            let r = &s.reads[read];
            assert_eq!(r.unit, pick.unit, "pick {i}");
            let stored_row = r.rows.as_ref().map_or(row, |rows| rows[row]);
            assert_eq!(stored_row as u64, pick.row, "pick {i}");
            uses[read] += 1;
        }
        assert_eq!(uses, s.uses);
    }

    #[test]
    fn window_order_reads_each_unit_left_once_and_whole() {
        let p = plan(&[5, 3, 8, 1], Mode::Window(2));
        let s = Schedule::new(&p, 0, &config(ShuffleMode::Window, 1)).unwrap();
        assert_eq!(s.reads.len(), 4);
        assert!(s.reads.iter().all(|r| r.rows.is_none()));
        assert_eq!(s.uses.iter().sum::<u32>(), 17);
        assert_serves_every_pick(&p, 0, &s);
        // From a later position only the units with picks left are read.
        let s = Schedule::new(&p, 16, &config(ShuffleMode::Window, 1)).unwrap();
        assert_eq!((s.reads.len(), s.uses.as_slice()), (1, [1].as_slice()));
        assert_serves_every_pick(&p, 16, &s);
        // As many reads in flight as row groups asked for: every read is whole.
        assert_eq!(s.depth(&p, 4), 4);
    }

    #[test]
    fn sample_order_reads_only_the_rows_each_lookahead_picks() {
        let p = plan(&[5, 3, 8, 1], Mode::Sample);
        // Lookaheads of 4 samples (400 bytes): a unit is read once per lookahead it has picks
        // in, only those rows, ascending.
        let s = Schedule::new(&p, 0, &config(ShuffleMode::Sample, 400)).unwrap();
        assert_serves_every_pick(&p, 0, &s);
        let picked: u64 = s
            .reads
            .iter()
            .map(|r| r.rows.as_ref().unwrap().len() as u64)
            .sum();
        assert_eq!(picked, 17, "each sample read once");
        for r in &s.reads {
            let rows = r.rows.as_ref().unwrap();
            assert!(rows.windows(2).all(|w| w[0] < w[1]), "{rows:?}");
        }
        assert!(s.reads.len() >= 17usize.div_ceil(4));
        // A lookahead of the whole epoch reads each unit once; of one sample, once per sample.
        let whole = Schedule::new(&p, 0, &config(ShuffleMode::Sample, 1 << 20)).unwrap();
        assert_eq!(whole.reads.len(), 4);
        let single = Schedule::new(&p, 0, &config(ShuffleMode::Sample, 1)).unwrap();
        assert_eq!(single.reads.len(), 17);
        assert_serves_every_pick(&p, 0, &single);
        // Each one-row read stands for its unit's rows (99 in all over the 17 reads), so about
        // six times as many run at once as whole row groups would.
        assert_eq!(single.depth(&p, 2), 2 * 6);
        // Resumed mid-lookahead, the rest is still served.
        let s = Schedule::new(&p, 6, &config(ShuffleMode::Sample, 400)).unwrap();
        assert_serves_every_pick(&p, 6, &s);
    }
}
