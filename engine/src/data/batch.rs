//! Mini-batches over a dataset: one optional seeded shuffle per epoch,
//! then contiguous row copies into fresh buffers per batch.

use ndarray::{ArrayD, IxDyn};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::dataset::Dataset;
use crate::error::{EngineError, EngineResult};
use crate::value::Value;

/// One mini-batch: `x` is f32 `[B, ...feature_shape]`, `y` is i64 `[B]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub x: Value,
    pub y: Value,
}

impl Batch {
    /// Number of samples in the batch.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}

/// An epoch's batches, in order. Every sample appears exactly once, except
/// that `drop_last` drops a final short batch.
#[derive(Clone, Debug)]
pub struct Batches<'a> {
    data: &'a Dataset,
    order: Vec<usize>,
    pos: usize,
    batch_size: usize,
    drop_last: bool,
}

impl Dataset {
    /// Batches of `batch_size` samples. With `shuffle_seed` the order is a
    /// permutation drawn from `StdRng::seed_from_u64(seed)`, so the same
    /// seed always gives the same batches; pass e.g. `base_seed + epoch`
    /// for a different order each epoch. Without, dataset order.
    pub fn batches(
        &self,
        batch_size: usize,
        shuffle_seed: Option<u64>,
        drop_last: bool,
    ) -> EngineResult<Batches<'_>> {
        if batch_size == 0 {
            return Err(EngineError::Shape("batch size must be at least 1".into()));
        }
        let mut order: Vec<usize> = (0..self.len()).collect();
        if let Some(seed) = shuffle_seed {
            order.shuffle(&mut StdRng::seed_from_u64(seed));
        }
        Ok(Batches {
            data: self,
            order,
            pos: 0,
            batch_size,
            drop_last,
        })
    }
}

impl<'a> Batches<'a> {
    /// The sample order of this epoch.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Indices of the next batch, advancing; `None` at the end of the epoch.
    fn next_indices(&mut self) -> Option<&[usize]> {
        let left = self.order.len() - self.pos;
        let take = left.min(self.batch_size);
        if take == 0 || (self.drop_last && take < self.batch_size) {
            self.pos = self.order.len();
            return None;
        }
        let start = self.pos;
        self.pos += take;
        Some(&self.order[start..self.pos])
    }

    /// Fills caller-owned buffers with the next batch instead of allocating
    /// (clears them first) and returns its size, or `None` at the end.
    /// For loops that hand raw slices to a kernel and reuse the buffers.
    pub fn next_into(&mut self, x: &mut Vec<f32>, y: &mut Vec<i64>) -> Option<usize> {
        let data = self.data;
        let idx = self.next_indices()?;
        x.clear();
        y.clear();
        data.gather(idx, x, y);
        Some(idx.len())
    }
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let data = self.data;
        let idx = self.next_indices()?;
        let b = idx.len();
        let mut x = Vec::with_capacity(b * data.feature_len());
        let mut y = Vec::with_capacity(b);
        data.gather(idx, &mut x, &mut y);
        let mut shape = Vec::with_capacity(1 + data.feature_shape().len());
        shape.push(b);
        shape.extend_from_slice(data.feature_shape());
        // Sizes match by construction: `gather` copies exactly
        // `feature_len` values per index.
        let x = ArrayD::from_shape_vec(IxDyn(&shape), x).expect("batch features match shape");
        let y = ArrayD::from_shape_vec(IxDyn(&[b]), y).expect("batch labels match shape");
        Some(Batch {
            x: Value::F32(x),
            y: Value::I64(y),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.order.len() - self.pos;
        let n = if self.drop_last {
            left / self.batch_size
        } else {
            left.div_ceil(self.batch_size)
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Batches<'_> {}
