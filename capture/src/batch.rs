//! Grouping samples by length into right-padded batches under a token budget.
use crate::input::InputSample;

/// One forward's input: the samples, their ids right-padded into one `[rows, cols]` block.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PaddedBatch {
    /// Row-major `[rows, cols]` token ids, 0 after each sample's end.
    pub ids: Vec<i64>,
    /// Samples in the batch.
    pub rows: i64,
    /// The longest sample's length.
    pub cols: i64,
    /// The samples, row by row.
    pub samples: Vec<InputSample>,
}

impl PaddedBatch {
    /// Pads `samples` to the longest of them.
    pub fn new(samples: Vec<InputSample>) -> Self {
        let cols = samples.iter().map(|s| s.input_ids.len()).max().unwrap_or(0);
        let mut ids = vec![0i64; samples.len() * cols];
        for (r, s) in samples.iter().enumerate() {
            for (c, &t) in s.input_ids.iter().enumerate() {
                ids[r * cols + c] = t as i64;
            }
        }
        PaddedBatch {
            ids,
            rows: samples.len() as i64,
            cols: cols as i64,
            samples,
        }
    }

    /// Tokens computed only to pad rows to the longest.
    pub fn padding_tokens(&self) -> u64 {
        let real: usize = self.samples.iter().map(|s| s.input_ids.len()).sum();
        (self.ids.len() - real) as u64
    }
}

/// Indices into the sample list, one `Vec` per batch; `batch.len() * longest <= budget`
/// unless a single sample alone exceeds it.
pub(crate) fn plan_batches(
    samples: &[InputSample],
    max_tokens_per_batch: usize,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..samples.len()).collect();
    // Longest first: similar lengths share a batch (little padding), and the largest
    // batch runs first, so an out-of-memory budget fails at once rather than hours in.
    order.sort_by_key(|&i| {
        (
            std::cmp::Reverse(samples[i].input_ids.len()),
            samples[i].sample_id,
        )
    });
    let mut batches: Vec<Vec<usize>> = vec![];
    let mut current: Vec<usize> = vec![];
    let mut longest = 0;
    for i in order {
        let len = samples[i].input_ids.len();
        let new_longest = longest.max(len);
        if !current.is_empty() && (current.len() + 1) * new_longest > max_tokens_per_batch {
            batches.push(std::mem::take(&mut current));
            longest = 0;
        }
        longest = longest.max(len);
        current.push(i);
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(lens: &[usize]) -> Vec<InputSample> {
        lens.iter()
            .enumerate()
            .map(|(i, &n)| InputSample {
                sample_id: i as u64,
                input_ids: vec![1; n],
                loss_mask: vec![1; n],
            })
            .collect()
    }

    #[test]
    fn batches_stay_under_budget_and_cover_every_sample_once() {
        let s = samples(&[5, 100, 7, 64, 3, 64, 10, 1]);
        let b = plan_batches(&s, 128);
        for batch in &b {
            let longest = batch.iter().map(|&i| s[i].input_ids.len()).max().unwrap();
            assert!(batch.len() * longest <= 128, "{batch:?}");
        }
        let mut all: Vec<usize> = b.concat();
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert_eq!(b[0], vec![1]);
        assert_eq!(b[1], vec![3, 5]);
    }

    #[test]
    fn a_sample_longer_than_the_budget_runs_alone() {
        let s = samples(&[300, 2]);
        assert_eq!(plan_batches(&s, 128), vec![vec![0], vec![1]]);
    }

    #[test]
    fn pads_every_row_to_the_longest_with_zeros() {
        let mut s = samples(&[2, 3]);
        s[0].input_ids = vec![7, 8];
        s[1].input_ids = vec![4, 5, 6];
        let b = PaddedBatch::new(s);
        assert_eq!((b.rows, b.cols), (2, 3));
        assert_eq!(b.ids, vec![7, 8, 0, 4, 5, 6]);
        assert_eq!(b.padding_tokens(), 1);
    }
}
