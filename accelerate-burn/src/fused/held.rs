//! [`HeldBytes`]: what a fused optimizer's buffers keep in memory from one step to the next.

/// Bytes a fused optimizer keeps on this process between steps, besides the model's own
/// parameters (buffers that live only inside one call, such as a column of ZeRO's
/// collectives, are not counted; nor are the half-precision wire's staging buffers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// The f32 master copy of the parameters kept apart from the model's: none where the
    /// model's own f32 parameters are updated in place (on the host) or view the buffers (on
    /// the GPU); for a model whose parameters are not f32, all of them (this rank's shard
    /// under ZeRO-1 and ZeRO-2).
    pub master_parameters: usize,
    /// Gradient buffers kept from step to step: the flat gradient several processes
    /// all-reduce without ZeRO, this rank's averaged shard under ZeRO-1 and ZeRO-2, none on
    /// one process and at ZeRO-3 (the update reads backward's gradients).
    pub gradients: usize,
    /// Optimizer state (moments): all of it, or this rank's shard under ZeRO.
    pub optimizer_state: usize,
}

impl HeldBytes {
    /// Everything counted.
    pub fn total(&self) -> usize {
        self.master_parameters
            .saturating_add(self.gradients)
            .saturating_add(self.optimizer_state)
    }
}
