//! Three weights' columns side by side (`[d_in, a + b + c]` from `[d_in, a]`, `[d_in, b]` and
//! `[d_in, c]`): attention's query, key and value weights made one matrix for one product. A
//! Burn operation whose output is recomputed for the backward pass rather than kept, on every
//! checkpointing strategy: Burn's `cat` is kept until backward under the default one, which
//! holds a copy of every layer's three weights through the whole step, and under ZeRO-3 keeps
//! each sharded layer's gathered weights whole after its forward pass (they are gathered again
//! in backward, and the copy made again, one pass over the weights).

use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;

use super::{contiguous, flex_tensor, values};

/// The columns of `parts` (2-d, the same rows), side by side.
pub(super) fn forward(parts: [&FlexTensor; 3]) -> FlexTensor {
    let shapes = parts.map(|p| p.shape());
    let rows = shapes[0].as_slice().first().copied().unwrap_or(0);
    let widths = shapes.map(|s| s.as_slice().get(1).copied().unwrap_or(0));
    let total: usize = widths.iter().sum();
    let parts = parts.map(contiguous);
    let mut out = Vec::with_capacity(rows * total);
    for row in 0..rows {
        for (part, width) in parts.iter().zip(widths) {
            out.extend_from_slice(&values(part)[row * width..(row + 1) * width]);
        }
    }
    flex_tensor(out, burn::tensor::Shape::from([rows, total]))
}

/// The backward node: each part's columns of the gradient.
#[derive(Debug)]
struct CatBackward {
    widths: [usize; 3],
}

impl Backward<Flex, 3> for CatBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy: FlexTensor = grads.consume::<Flex>(&ops.node);
        let dy = contiguous(&dy);
        let dy = values(&dy);
        let total: usize = self.widths.iter().sum();
        let rows = dy.len().checked_div(total).unwrap_or(0);
        let mut start = 0;
        for (parent, width) in ops.parents.into_iter().zip(self.widths) {
            if let Some(parent) = parent {
                let mut part = Vec::with_capacity(rows * width);
                for row in 0..rows {
                    let at = row * total + start;
                    part.extend_from_slice(&dy[at..at + width]);
                }
                let shape = burn::tensor::Shape::from([rows, width]);
                grads.register::<Flex>(parent.id, flex_tensor(part, shape));
            }
            start += width;
        }
    }
}

/// The concatenation again, from the parts, when a backward pass needs it.
#[derive(Debug)]
struct RetroCat {
    inputs: [NodeId; 3],
}

impl RetroForward for RetroCat {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let parts: [FlexTensor; 3] = self.inputs.map(|id| states.get_state(&id));
        states.save(out_node, forward([&parts[0], &parts[1], &parts[2]]));
    }
}

/// The concatenation under autodiff: memory-bound with a retro-forward, prepared with Burn's
/// balanced strategy whatever the model's, so it is recomputed and never kept.
pub(super) fn tracked<C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<Flex, C>>,
    b: FloatTensor<Autodiff<Flex, C>>,
    c: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    let out = forward([a.primitive(), b.primitive(), c.primitive()]);
    let widths = [&a, &b, &c].map(|p| {
        p.primitive()
            .shape()
            .as_slice()
            .get(1)
            .copied()
            .unwrap_or(0)
    });
    CatBackward { widths }
        .prepare::<BalancedCheckpointing>([a.node(), b.node(), c.node()])
        .memory_bound()
        .retro_forward(RetroCat {
            inputs: [a.node().id(), b.node().id(), c.node().id()],
        })
        .parents([&a, &b, &c])
        .stateless(out)
}
