#include "state.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>

namespace torchleaf {
namespace {

struct StateTable {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<CapturedState>> states;
  int64_t next_id = 1;
};

StateTable& table() {
  static auto* instance = new StateTable(); // leaked: see registry.cpp
  return *instance;
}

// The handle's storage: its data is the id, its deleter releases the state.
struct HandleBox {
  int64_t id;
};

void release_handle(void* data) {
  auto* box = static_cast<HandleBox*>(data);
  std::shared_ptr<CapturedState> doomed;
  {
    auto& t = table();
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.states.find(box->id);
    if (it != t.states.end()) {
      doomed = std::move(it->second);
      t.states.erase(it);
    }
  }
  delete box;
  // `doomed` dies here, outside the lock: freeing a graph can free handles
  // of nested leaf calls, which re-enter this function.
}

} // namespace

at::Tensor make_state_handle(std::shared_ptr<CapturedState> state) {
  auto& t = table();
  auto* box = new HandleBox{0};
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    box->id = t.next_id++;
    t.states.emplace(box->id, std::move(state));
  }
  static_assert(offsetof(HandleBox, id) == 0, "the id must be the data");
  // A storage whose deleter is release_handle (a plain function pointer: no
  // std::function per call, unlike at::from_blob).
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      sizeof(int64_t),
      c10::DataPtr(box, box, &release_handle, c10::Device(c10::kCPU)),
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
  const int64_t id = *handle.const_data_ptr<int64_t>();
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.states.find(id);
  TORCHLEAF_CHECK(
      it == t.states.end() || it->second->entry.get() == &entry,
      entry.name,
      "backward received the state handle of a call of leaf function '",
      it == t.states.end() ? "" : it->second->entry->name,
      "'; pass the handle that this leaf's forward returned.");
  TORCHLEAF_CHECK(
      it != t.states.end(),
      entry.name,
      "cannot run backward: the autograd state saved by its forward call was "
      "already released (backward ran once without retain_graph=True, or "
      "the graph was freed). Pass retain_graph=True to the first backward "
      "to backpropagate through the same call twice.");
  return it->second;
}

int64_t live_state_count() {
  auto& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  return static_cast<int64_t>(t.states.size());
}

int64_t live_states() {
  return live_state_count();
}

} // namespace torchleaf
