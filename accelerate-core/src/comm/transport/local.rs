//! In-process transport: each pair of threads shares a channel. Used by tests (threads as
//! ranks) and by several devices driven from one process.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Instant;

use crate::comm::call::Header;
use crate::comm::link::{Link, LinkError};

type Message = (Header, Vec<u8>);

/// One rank's end of an in-process group.
pub struct LocalLink {
    rank: usize,
    to: Vec<Sender<Message>>,
    from: Vec<Receiver<Message>>,
    /// The payload of the last header received from each peer.
    pending: Vec<Vec<u8>>,
}

impl LocalLink {
    /// The links of a group of `world_size` in-process ranks, in rank order.
    pub fn group(world_size: usize) -> Vec<LocalLink> {
        let mut to: Vec<Vec<Sender<Message>>> = (0..world_size).map(|_| Vec::new()).collect();
        let mut from: Vec<Vec<Option<Receiver<Message>>>> = (0..world_size)
            .map(|_| (0..world_size).map(|_| None).collect())
            .collect();
        for (sender, outgoing) in to.iter_mut().enumerate() {
            for receiver_inbox in from.iter_mut() {
                let (tx, rx) = mpsc::channel();
                outgoing.push(tx);
                receiver_inbox[sender] = Some(rx);
            }
        }
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| LocalLink {
                rank,
                to,
                from: from.into_iter().flatten().collect(),
                pending: vec![Vec::new(); world_size],
            })
            .collect()
    }
}

impl Link for LocalLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.to.len()
    }

    fn name(&self) -> &'static str {
        "local"
    }

    fn send(&mut self, peer: usize, header: &Header, payload: &[u8]) -> Result<(), LinkError> {
        self.to[peer]
            .send((*header, payload.to_vec()))
            .map_err(|_| LinkError::Lost("its thread ended".into()))
    }

    fn recv_header(&mut self, peer: usize, deadline: Instant) -> Result<Header, LinkError> {
        let left = deadline.saturating_duration_since(Instant::now());
        let (header, payload) = self.from[peer].recv_timeout(left).map_err(|e| match e {
            RecvTimeoutError::Timeout => LinkError::Timeout,
            RecvTimeoutError::Disconnected => LinkError::Lost("its thread ended".into()),
        })?;
        self.pending[peer] = payload;
        Ok(header)
    }

    fn recv_payload(
        &mut self,
        peer: usize,
        buf: &mut Vec<u8>,
        len: usize,
        _deadline: Instant,
    ) -> Result<(), LinkError> {
        let payload = std::mem::take(&mut self.pending[peer]);
        if payload.len() != len {
            return Err(LinkError::Lost(format!(
                "its message has {} bytes, its header said {len}",
                payload.len()
            )));
        }
        *buf = payload;
        Ok(())
    }
}
