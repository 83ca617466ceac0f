#pragma once

#include <ATen/core/Tensor.h>

namespace torchleaf {

// An alias of `t` outside any autograd graph: what t.detach() returns (a
// shallow copy sharing t's version counter, without autograd metadata). A
// plain tensor gets it directly, one TensorImpl where the dispatcher's
// detach makes two through three kernels (~2k instructions, paid per input
// and per output of every call). Tensors and states whose detach a dispatch
// key may change -- subclasses, functorch and functional wrappers, Python
// dispatch, inference mode -- take detach() itself.
at::Tensor detached(const at::Tensor& t);

} // namespace torchleaf
