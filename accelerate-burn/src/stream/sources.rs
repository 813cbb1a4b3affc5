//! What a stream reads: the [`StreamSource`] trait, and sources made from a user's iterators
//! ([`IterShards`]) or from a data set read piece by piece ([`DatasetShards`], e.g. Parquet
//! row groups).

use std::sync::Arc;

use accelerate_core::ShardReader;
use burn::data::dataset::Dataset;

/// An error of a stream's source (the source's own error type, boxed).
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Data read as shards of items in sequence, with no length known ahead: files, Parquet row
/// groups, a generator's partitions. The loader assigns whole shards to processes and reads
/// each shard from its start, or from an item on when a resumed run continues one.
pub trait StreamSource<I>: Send + Sync {
    /// Shards the data is split into (at least as many as processes).
    fn shards(&self) -> usize;

    /// The items of shard `shard` (below [`shards`](Self::shards)) from item `skip` on. A
    /// source that cannot seek reads and drops the first `skip` items.
    fn read(&self, shard: usize, skip: u64)
    -> Result<ShardReader<'_, I, SourceError>, SourceError>;
}

/// A stream whose shards are a user's iterators: `open(shard)` returns shard `shard`'s items
/// (a file's lines, a generator's partition); resuming inside a shard reads its items again up
/// to where it stood.
///
/// ```
/// use accelerate_burn::stream::{IterShards, StreamSource};
///
/// // Four shards of numbers, as a generator would make them.
/// let source = IterShards::new(4, |shard| Ok::<_, std::io::Error>((0..10).map(move |i| shard * 100 + i)));
/// let rest: Vec<usize> = source.read(2, 7)?.collect::<Result<_, _>>()?;
/// assert_eq!(rest, [207, 208, 209]);
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub struct IterShards<F> {
    shards: usize,
    open: F,
}

impl<F> IterShards<F> {
    /// `shards` shards, shard `s` read from `open(s)`.
    pub fn new(shards: usize, open: F) -> Self {
        Self { shards, open }
    }
}

impl<I, It, E, F> StreamSource<I> for IterShards<F>
where
    I: 'static,
    F: Fn(usize) -> Result<It, E> + Send + Sync,
    It: IntoIterator<Item = I>,
    It::IntoIter: Send + 'static,
    E: Into<SourceError>,
{
    fn shards(&self) -> usize {
        self.shards
    }

    fn read(
        &self,
        shard: usize,
        skip: u64,
    ) -> Result<ShardReader<'_, I, SourceError>, SourceError> {
        let items = (self.open)(shard).map_err(Into::into)?.into_iter();
        let skip = usize::try_from(skip).map_err(|_| format!("cannot skip {skip} items"))?;
        Ok(Box::new(items.skip(skip).map(Ok)))
    }
}

/// A map-style data set read as a stream, one piece per shard: pieces of the given lengths in
/// data-set order, such as `ParquetDataset::pieces()` (its row groups, each decoded once as
/// its rows are read in sequence).
#[derive(Clone)]
pub struct DatasetShards<D> {
    dataset: Arc<D>,
    /// Where each piece starts, and the data set's end.
    starts: Arc<[usize]>,
}

impl<D> DatasetShards<D> {
    /// `dataset` in pieces of lengths `pieces` (which must add up to its length).
    pub fn new<I>(dataset: D, pieces: &[usize]) -> Result<Self, SourceError>
    where
        D: Dataset<I>,
    {
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        let mut at = 0usize;
        starts.push(0);
        for &len in pieces {
            at = at.checked_add(len).ok_or("the pieces' lengths overflow")?;
            starts.push(at);
        }
        if at != dataset.len() {
            return Err(format!(
                "the pieces add up to {at} items but the data set has {}",
                dataset.len()
            )
            .into());
        }
        Ok(Self {
            dataset: Arc::new(dataset),
            starts: starts.into(),
        })
    }
}

impl<I, D: Dataset<I> + 'static> StreamSource<I> for DatasetShards<D> {
    fn shards(&self) -> usize {
        self.starts.len() - 1
    }

    fn read(
        &self,
        shard: usize,
        skip: u64,
    ) -> Result<ShardReader<'_, I, SourceError>, SourceError> {
        let (Some(&start), Some(&end)) = (self.starts.get(shard), self.starts.get(shard + 1))
        else {
            return Err(format!("no shard {shard} (there are {})", self.shards()).into());
        };
        let skip = usize::try_from(skip).unwrap_or(usize::MAX);
        let first = start.saturating_add(skip).min(end);
        let dataset = &self.dataset;
        Ok(Box::new(
            (first..end).map(move |i| dataset.get(i).map_err(SourceError::from)),
        ))
    }
}
