//! The collectives over the slots: each one goes through its buffer in segments of one slot,
//! with a barrier between writing and reading the peers' slots.

use std::sync::Arc;
use std::time::Duration;

use accelerate_kernels::reduce::{reduce_bytes, scale_bytes};
use memmap2::MmapMut;

use super::ShmEngine;
use crate::comm::call::CallDesc;
use crate::comm::engine::{AbortNotice, Engine, Split, chunk_bytes, count_bytes};
use crate::error::CommError;

impl Engine for ShmEngine {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank)?;
        self.publish(call);
        let (n, rank) = (self.world_size, self.rank);
        let elem = dtype.size();
        let segment = (self.region.slot_bytes() / elem).max(1) * elem;
        if buf.is_empty() {
            return self.barrier_wait(call, true);
        }
        let mut first = true;
        for start in (0..buf.len()).step_by(segment) {
            let end = (start + segment).min(buf.len());
            let part = &mut buf[start..end];
            let len = part.len();
            let b = self.next_buffer();
            // Stage only the parts the peers reduce: this rank's own part is read from `part`.
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = chunk_bytes(len, elem, n, peer);
                self.region.write_slot(rank, b, theirs.start, &part[theirs]);
            }
            self.barrier_wait(call, first)?;
            first = false;
            let mine = chunk_bytes(len, elem, n, rank);
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = self.region.slot(peer, b, mine.start, mine.len());
                reduce_bytes(dtype, op, &mut part[mine.clone()], theirs);
            }
            if let Some(factor) = scale {
                scale_bytes(dtype, &mut part[mine.clone()], factor);
            }
            self.region
                .write_slot(rank, b, mine.start, &part[mine.clone()]);
            self.barrier_wait(call, false)?;
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = chunk_bytes(len, elem, n, peer);
                part[theirs.clone()].copy_from_slice(self.region.slot(
                    peer,
                    b,
                    theirs.start,
                    theirs.len(),
                ));
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.publish(call);
        if buf.is_empty() {
            return self.barrier_wait(call, true);
        }
        let segment = self.region.slot_bytes();
        let mut first = true;
        for start in (0..buf.len()).step_by(segment) {
            let end = (start + segment).min(buf.len());
            let b = self.next_buffer();
            if self.rank == root {
                self.region.write_slot(root, b, 0, &buf[start..end]);
            }
            self.barrier_wait(call, first)?;
            first = false;
            if self.rank != root {
                buf[start..end].copy_from_slice(self.region.slot(root, b, 0, end - start));
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        self.publish(call);
        let block = input.len();
        output[self.rank * block..(self.rank + 1) * block].copy_from_slice(input);
        if block == 0 {
            return self.barrier_wait(call, true);
        }
        let segment = self.region.slot_bytes();
        let mut first = true;
        for start in (0..block).step_by(segment) {
            let end = (start + segment).min(block);
            let b = self.next_buffer();
            self.region.write_slot(self.rank, b, 0, &input[start..end]);
            self.barrier_wait(call, first)?;
            first = false;
            for peer in (0..self.world_size).filter(|&p| p != self.rank) {
                output[peer * block + start..peer * block + end].copy_from_slice(self.region.slot(
                    peer,
                    b,
                    0,
                    end - start,
                ));
            }
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank)?;
        self.publish(call);
        let (n, rank) = (self.world_size, self.rank);
        let elem = dtype.size();
        let parts = count_bytes(counts, elem);
        let longest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
        output.copy_from_slice(&input[parts[rank].clone()]);
        if longest == 0 {
            return self.barrier_wait(call, true);
        }
        // Each slot holds one sub-block of every part.
        let step = (self.region.slot_bytes() / n / elem).max(1) * elem;
        let mut first = true;
        for offset in (0..longest).step_by(step) {
            let b = self.next_buffer();
            for (p, part) in parts.iter().enumerate().filter(|&(p, _)| p != rank) {
                let end = (offset + step).min(part.len());
                if offset < end {
                    self.region.write_slot(
                        rank,
                        b,
                        p * step,
                        &input[part.start + offset..part.start + end],
                    );
                }
            }
            self.barrier_wait(call, first)?;
            first = false;
            let end = (offset + step).min(parts[rank].len());
            if offset < end {
                for peer in (0..n).filter(|&p| p != rank) {
                    let theirs = self.region.slot(peer, b, rank * step, end - offset);
                    reduce_bytes(dtype, op, &mut output[offset..end], theirs);
                }
            }
        }
        Ok(())
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.begin(call)
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn split(&mut self, call: &CallDesc, parts: &[Vec<usize>]) -> Result<Split, CommError> {
        Ok(match self.split_part(call, parts)? {
            Some(engine) => Split::Formed(Box::new(engine)),
            None => Split::Alone,
        })
    }

    fn create_shared(
        &mut self,
        call: &CallDesc,
        bytes: usize,
    ) -> Result<Option<MmapMut>, CommError> {
        self.create_shared_buffer(call, bytes)
    }

    fn all_reduce_shared(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank)?;
        self.all_reduce_in_shared(call, buf, dtype, op, scale)
    }

    fn abort(&mut self, reason: &str) {
        self.board.tell(reason);
    }

    fn abort_notice(&self) -> Option<Arc<dyn AbortNotice>> {
        Some(Arc::clone(&self.board) as Arc<dyn AbortNotice>)
    }
}
