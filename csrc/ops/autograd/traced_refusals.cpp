#include "traced_refusals.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace torchleaf::ops {

namespace {

struct TracedRefusal {
  c10::weak_intrusive_ptr<c10::TensorImpl> handle;
  torch::autograd::Edge edge;
};
std::mutex traced_refusals_mutex;
std::vector<TracedRefusal> traced_refusals;

} // namespace

void remember_traced_refusal(
    const at::Tensor& handle,
    torch::autograd::Edge edge) {
  std::lock_guard<std::mutex> lock(traced_refusals_mutex);
  traced_refusals.erase(
      std::remove_if(
          traced_refusals.begin(),
          traced_refusals.end(),
          [](const TracedRefusal& r) { return r.handle.expired(); }),
      traced_refusals.end());
  traced_refusals.push_back(
      {c10::weak_intrusive_ptr<c10::TensorImpl>(handle.getIntrusivePtr()),
       std::move(edge)});
}

torch::autograd::Edge traced_refusal(const at::Tensor& handle) {
  std::lock_guard<std::mutex> lock(traced_refusals_mutex);
  for (const auto& r : traced_refusals) {
    auto impl = r.handle.lock();
    if (impl && impl.get() == handle.unsafeGetTensorImpl()) {
      return r.edge;
    }
  }
  return {};
}

} // namespace torchleaf::ops
