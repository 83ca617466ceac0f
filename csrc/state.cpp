#include "state.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>

#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>

namespace torchleaf {
namespace {

std::atomic<int64_t> g_live_states{0};
std::atomic<int64_t> g_next_handle_value{1};

// What a handle's storage owns. The state lives in the DataPtr's context,
// out of reach of the tensor's data (which only shows a number for
// debugging): writing into a handle cannot make it name another state.
struct HandleBox {
  int64_t value;
  std::shared_ptr<CapturedState> state;
};

void release_handle(void* context) {
  // Deleting the box frees the state: freeing a graph can free handles of
  // nested leaf calls, which re-enter this function (no lock is held).
  delete static_cast<HandleBox*>(context);
  g_live_states.fetch_sub(1, std::memory_order_relaxed);
}

} // namespace

at::Tensor make_state_handle(std::shared_ptr<CapturedState> state) {
  auto* box = new HandleBox{
      g_next_handle_value.fetch_add(1, std::memory_order_relaxed), std::move(state)};
  g_live_states.fetch_add(1, std::memory_order_relaxed);
  // A storage whose deleter is release_handle (a plain function pointer: no
  // std::function per call, unlike at::from_blob).
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      sizeof(int64_t),
      c10::DataPtr(&box->value, box, &release_handle, c10::Device(c10::kCPU)),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  auto handle = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::Make<int64_t>());
  handle.unsafeGetTensorImpl()->set_sizes_contiguous({});
  return handle;
}

bool is_concrete_handle(const at::Tensor& handle) {
  // Fake and functional tensors seen while tracing carry these keys; meta
  // tensors fail the device test.
  constexpr auto tracing_keys = c10::DispatchKeySet(
      {c10::DispatchKey::Python,
       c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::Functionalize});
  return handle.defined() && handle.device().is_cpu() &&
      !handle.key_set().has_any(tracing_keys) &&
      handle.storage().data() != nullptr;
}

std::shared_ptr<CapturedState> lookup_state(
    const at::Tensor& handle,
    const LeafEntry& entry) {
  TORCHLEAF_CHECK(
      is_concrete_handle(handle) && handle.scalar_type() == at::kLong &&
          handle.dim() == 0 &&
          handle.storage().data_ptr().get_deleter() == &release_handle,
      entry.name,
      "backward received a state argument that is not a state handle (",
      handle.defined() ? c10::str(handle.toString(), handle.sizes()) : "undefined",
      "); pass the 0-dim int64 handle that torchleaf::forward returned for "
      "this call itself: a copy of it is not a handle, since the state lives "
      "exactly as long as the handle's own storage.");
  const auto* box =
      static_cast<const HandleBox*>(handle.storage().data_ptr().get_context());
  TORCHLEAF_CHECK(
      box->state->entry.get() == &entry,
      entry.name,
      "backward received the state handle of a call of leaf function '",
      box->state->entry->name,
      "'; pass the handle that this leaf's forward returned.");
  return box->state;
}

int64_t live_state_count() {
  return g_live_states.load(std::memory_order_relaxed);
}

int64_t live_states() {
  return live_state_count();
}

} // namespace torchleaf
