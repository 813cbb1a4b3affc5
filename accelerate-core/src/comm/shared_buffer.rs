//! [`SharedBuffer`]: a buffer that the peers of a shared-memory group can read directly, so
//! that an all-reduce on it needs no staging copy.

use std::ops::{Deref, DerefMut};

use accelerate_kernels::Element;
use memmap2::MmapMut;

enum Storage<T> {
    Heap(Vec<T>),
    Mapped(MmapMut),
}

/// A buffer of `T` allocated by [`ProcessGroup::shared_buffer`](super::ProcessGroup::shared_buffer).
///
/// On a shared-memory group it lives in memory every rank has mapped, and
/// [`ProcessGroup::all_reduce_shared`](super::ProcessGroup::all_reduce_shared) reduces it in
/// place, each rank reading its peers' buffers directly. On other transports it is an ordinary
/// heap buffer and the all-reduce is the usual one. It starts zeroed and dereferences to `[T]`.
pub struct SharedBuffer<T: Element> {
    storage: Storage<T>,
    len: usize,
    id: u32,
    group: u64,
}

impl<T: Element> SharedBuffer<T> {
    pub(crate) fn heap(len: usize, id: u32, group: u64) -> Self {
        Self {
            storage: Storage::Heap(vec![T::zeroed(); len]),
            len,
            id,
            group,
        }
    }

    pub(crate) fn mapped(map: MmapMut, len: usize, id: u32, group: u64) -> Self {
        Self {
            storage: Storage::Mapped(map),
            len,
            id,
            group,
        }
    }

    /// True when the buffer lives in shared memory (and all-reduces on it are in place).
    pub fn is_shared_memory(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }

    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    pub(crate) fn group(&self) -> u64 {
        self.group
    }
}

impl<T: Element> Deref for SharedBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            Storage::Mapped(map) => bytemuck::cast_slice(&map[..self.len * size_of::<T>()]),
        }
    }
}

impl<T: Element> DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            Storage::Mapped(map) => bytemuck::cast_slice_mut(&mut map[..self.len * size_of::<T>()]),
        }
    }
}
