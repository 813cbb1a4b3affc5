//! Walking a process's streams item by item, block by block (the rules are in
//! [`crate::stream_order`]): reads each block of `shuffle_buffer` items from the source,
//! hands them out in the block's order, and says after each item where the stream stands, so
//! that a resume re-reads only the block in progress.

use crate::stream_order::{StreamConfig, StreamCursor, block_order, stream_shards};

/// A shard's items from some item on, as a source opens them.
pub type ShardReader<'a, I, E> = Box<dyn Iterator<Item = Result<I, E>> + Send + 'a>;

/// Opens shard `shard` at item `skip`.
pub type ShardOpener<'a, I, E> =
    Box<dyn FnMut(usize, u64) -> Result<ShardReader<'a, I, E>, E> + Send + 'a>;

/// Where the streams stand after an item: the stream (its position in the list walked) and
/// its cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walked {
    /// Streams of the list finished before this one.
    pub stream: usize,
    /// Where this stream continues.
    pub cursor: StreamCursor,
}

/// Reading a shard failed.
#[derive(Debug)]
pub struct ShardFailed<E> {
    /// The shard's number in the source.
    pub shard: usize,
    /// The source's error.
    pub source: E,
}

/// Items of a list of streams (a process's own, or the ones dealt to it after a change of
/// world size), in order; an iterator of `(item, where the walk stands after it)`.
pub struct StreamWalk<'a, I, E> {
    config: StreamConfig,
    epoch: u64,
    streams: Vec<StreamCursor>,
    /// The stream being read: its position in `streams`, and its shard list.
    current: usize,
    shards: Vec<usize>,
    open: ShardOpener<'a, I, E>,
    /// The reader of the shard at `next.0` (its position in `shards`), positioned at `next.1`.
    reader: Option<ShardReader<'a, I, E>>,
    next: (usize, u64),
    /// The block being handed out: its cursor (emitted = items handed out), its items in the
    /// block's order, and the position after it.
    block: Option<Block<I>>,
    failed: bool,
}

struct Block<I> {
    cursor: StreamCursor,
    items: std::vec::IntoIter<I>,
    after: (usize, u64),
}

impl<'a, I, E> StreamWalk<'a, I, E> {
    /// Walks `streams` of epoch `epoch`, opening shards with `open(shard, first_item)`.
    pub fn new(
        (config, epoch): (StreamConfig, u64),
        streams: Vec<StreamCursor>,
        open: impl FnMut(usize, u64) -> Result<ShardReader<'a, I, E>, E> + Send + 'a,
    ) -> Self {
        let mut walk = Self {
            config,
            epoch,
            streams,
            current: 0,
            shards: Vec::new(),
            open: Box::new(open),
            reader: None,
            next: (0, 0),
            block: None,
            failed: false,
        };
        walk.enter(0);
        walk
    }

    /// Starts reading stream `index` where its cursor says.
    fn enter(&mut self, index: usize) {
        self.current = index;
        self.reader = None;
        if let Some(c) = self.streams.get(index) {
            self.shards = stream_shards(&self.config, self.epoch, (c.world, c.rank));
            self.next = (c.shard, c.item);
        }
    }

    /// The next item of the current stream in shard order, or `None` at its end.
    fn read_item(&mut self) -> Result<Option<I>, ShardFailed<E>> {
        loop {
            let Some(&shard) = self.shards.get(self.next.0) else {
                return Ok(None);
            };
            let reader = match self.reader.as_mut() {
                Some(reader) => reader,
                None => {
                    let opened = (self.open)(shard, self.next.1)
                        .map_err(|source| ShardFailed { shard, source })?;
                    self.reader.insert(opened)
                }
            };
            match reader.next() {
                Some(item) => {
                    self.next.1 += 1;
                    return item
                        .map(Some)
                        .map_err(|source| ShardFailed { shard, source });
                }
                None => {
                    self.reader = None;
                    self.next = (self.next.0 + 1, 0);
                }
            }
        }
    }

    /// Reads the current stream's next block (from `self.next`); `None` at its end.
    fn read_block(&mut self, cursor: StreamCursor) -> Result<Option<Block<I>>, ShardFailed<E>> {
        let size = self.config.shuffle_buffer.max(1);
        let mut items = Vec::with_capacity(size.min(1 << 16));
        while items.len() < size {
            match self.read_item()? {
                Some(item) => items.push(item),
                None => break,
            }
        }
        if items.is_empty() {
            return Ok(None);
        }
        let order = block_order(&self.config, self.epoch, &cursor, items.len());
        let mut slots: Vec<Option<I>> = items.into_iter().map(Some).collect();
        let ordered: Vec<I> = order
            .into_iter()
            .skip(cursor.emitted)
            .filter_map(|i| slots[i].take())
            .collect();
        Ok(Some(Block {
            cursor,
            items: ordered.into_iter(),
            after: self.next,
        }))
    }

    fn step(&mut self) -> Result<Option<(I, Walked)>, ShardFailed<E>> {
        loop {
            if let Some(block) = self.block.as_mut()
                && let Some(item) = block.items.next()
            {
                block.cursor.emitted += 1;
                let cursor = if block.items.len() == 0 {
                    // The block is done: the stream continues with the next one.
                    StreamCursor {
                        shard: block.after.0,
                        item: block.after.1,
                        block: block.cursor.block + 1,
                        emitted: 0,
                        ..block.cursor
                    }
                } else {
                    block.cursor
                };
                let stream = self.current;
                return Ok(Some((item, Walked { stream, cursor })));
            }
            // The next block of this stream: where the last one ended, or the cursor's.
            let cursor = match self.block.take() {
                Some(done) => StreamCursor {
                    shard: done.after.0,
                    item: done.after.1,
                    block: done.cursor.block + 1,
                    emitted: 0,
                    ..done.cursor
                },
                None => match self.streams.get(self.current) {
                    Some(c) => *c,
                    None => return Ok(None),
                },
            };
            match self.read_block(cursor)? {
                Some(block) => self.block = Some(block),
                None => {
                    // This stream is finished: on to the next in the list.
                    self.enter(self.current + 1);
                    if self.current >= self.streams.len() {
                        return Ok(None);
                    }
                }
            }
        }
    }
}

impl<I, E> Iterator for StreamWalk<'_, I, E> {
    type Item = Result<(I, Walked), ShardFailed<E>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let step = self.step();
        self.failed = step.is_err();
        step.transpose()
    }
}

/// The streams a process still reads once the walk stands at `walked` in `streams`.
pub fn remaining_streams(streams: &[StreamCursor], walked: Walked) -> Vec<StreamCursor> {
    let mut rest = vec![walked.cursor];
    rest.extend(streams.iter().skip(walked.stream + 1));
    rest
}
