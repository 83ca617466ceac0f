#pragma once

// The refused edge of a traced forward (a fake or functional state handle,
// which has no CapturedState to keep CapturedState::refused_outer on): a
// compiled torch.func.grad of a leaf records forward and backward in one
// trace, and without this its gradient reached no outer input (a
// second-order term missing silently, issue 36). Keyed by the handle's
// TensorImpl, held weakly; entries of dead handles are dropped on the next
// insertion.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h> // (Edge holds a Node)

namespace torchleaf::ops {

void remember_traced_refusal(
    const at::Tensor& handle,
    torch::autograd::Edge edge);

// The edge remembered for `handle`, or an invalid edge.
torch::autograd::Edge traced_refusal(const at::Tensor& handle);

} // namespace torchleaf::ops
