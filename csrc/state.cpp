#include "state.h"
#include "torch_private.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <torchleaf/errors.h>
#include <torchleaf/leaf.h>

namespace torchleaf {
namespace {

std::atomic<int64_t> g_live_states{0};
std::atomic<int64_t> g_next_handle_value{1};

// What a handle's storage owns. The state lives in the DataPtr's context,
// out of reach of the tensor's data (which only shows the handle's value):
// writing into a handle cannot make it name another state.
struct HandleBox {
  int64_t value;
  std::shared_ptr<CapturedState> state;
};

void release_handle(void* context) {
  // Deleting the box frees the state: freeing a graph can free handles of
  // nested leaf calls, which re-enter this function (no lock is held).
  delete static_cast<HandleBox*>(context);
}

// States made while saved-tensor hooks were active, by handle value.
struct KeptStates {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<CapturedState>> states;
  // states.size(), readable without the lock: every traced backward asks.
  std::atomic<size_t> count{0};
};

KeptStates& kept_states() {
  static auto* instance = new KeptStates(); // leaked: see registry.cpp
  return *instance;
}

bool is_handle_storage(const at::Tensor& handle) {
  return handle.storage().data_ptr().get_deleter() == &release_handle;
}

// What the storage of a stacked handle (stack_state_handles) owns: one value
// and one state per element, element k at storage offset k.
struct StackedHandleBox {
  std::vector<int64_t> values;
  std::vector<std::shared_ptr<CapturedState>> states;
};

void release_stacked_handle(void* context) {
  delete static_cast<StackedHandleBox*>(context);
}

bool is_stacked_handle_storage(const at::Tensor& handle) {
  return handle.storage().data_ptr().get_deleter() == &release_stacked_handle;
}

// The state of the element of `storage` at `offset`, or nullptr.
std::shared_ptr<CapturedState> state_at(
    const c10::Storage& storage,
    int64_t offset) {
  const auto& data = storage.data_ptr();
  if (data.get_deleter() == &release_handle) {
    return offset == 0
        ? static_cast<const HandleBox*>(data.get_context())->state
        : nullptr;
  }
  if (data.get_deleter() == &release_stacked_handle) {
    const auto* box = static_cast<const StackedHandleBox*>(data.get_context());
    if (offset >= 0 && static_cast<size_t>(offset) < box->states.size()) {
      return box->states[offset];
    }
  }
  return nullptr;
}

std::atomic<SavedHookMayCopy> g_saved_hook_may_copy{nullptr};

// Whether saved-tensor hooks are active that may save a copy of a handle
// (which then finds its state by value: see make_state_handle).
bool hooks_may_copy_handles() {
  const auto hooks = torch_private::saved_tensor_default_hooks();
  if (!hooks.has_value()) {
    return false;
  }
  const auto may_copy = g_saved_hook_may_copy.load(std::memory_order_acquire);
  return may_copy == nullptr || may_copy(hooks->first);
}

} // namespace

void set_saved_hook_may_copy(SavedHookMayCopy check) {
  g_saved_hook_may_copy.store(check, std::memory_order_release);
}

LiveStateCounter::LiveStateCounter() {
  g_live_states.fetch_add(1, std::memory_order_relaxed);
}

LiveStateCounter::~LiveStateCounter() {
  g_live_states.fetch_sub(1, std::memory_order_relaxed);
}

at::Tensor make_state_handle(std::shared_ptr<CapturedState> state) {
  const int64_t value =
      g_next_handle_value.fetch_add(1, std::memory_order_relaxed);
  if (hooks_may_copy_handles()) {
    auto& kept = kept_states();
    std::lock_guard<std::mutex> lock(kept.mutex);
    kept.states.emplace(value, state);
    kept.count.store(kept.states.size(), std::memory_order_relaxed);
  }
  auto* box = new HandleBox{value, std::move(state)};
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
  const bool well_formed = is_concrete_handle(handle) &&
      handle.scalar_type() == at::kLong && handle.dim() == 0;
  std::shared_ptr<CapturedState> state;
  if (well_formed && is_handle_storage(handle)) {
    state =
        static_cast<const HandleBox*>(handle.storage().data_ptr().get_context())
            ->state;
  } else if (well_formed && is_stacked_handle_storage(handle)) {
    state = state_at(handle.storage(), handle.storage_offset());
  } else if (well_formed) { // a copy made by a saved-tensor hook?
    auto& kept = kept_states();
    std::lock_guard<std::mutex> lock(kept.mutex);
    auto it = kept.states.find(*handle.const_data_ptr<int64_t>());
    if (it != kept.states.end()) {
      state = it->second;
    }
  }
  TORCHLEAF_CHECK(
      state != nullptr,
      entry.name,
      "backward received a state argument that is not a state handle (",
      handle.defined() ? c10::str(handle.toString(), handle.sizes())
                       : "undefined",
      "), or a copy of one whose state was released. Pass the 0-dim int64 "
      "handle that torchleaf::forward returned for this call; a copy (such "
      "as a saved-tensor hook makes) is only valid until a backward that "
      "does not retain the graph ran through it.");
  TORCHLEAF_CHECK(
      state->entry.get() == &entry,
      entry.name,
      "backward received the state handle of a call of leaf function '",
      state->entry->name,
      "'; pass the handle that this leaf's forward returned.");
  return state;
}

std::shared_ptr<CapturedState> lookup_state(
    const at::Tensor& handle,
    int64_t leaf) {
  if (is_concrete_handle(handle) && is_handle_storage(handle)) {
    const auto& held =
        static_cast<const HandleBox*>(handle.storage().data_ptr().get_context())
            ->state;
    if (held->entry->id == leaf && handle.scalar_type() == at::kLong &&
        handle.dim() == 0) {
      return held;
    }
  }
  return lookup_state(handle, *get_leaf(leaf));
}

at::Tensor stack_state_handles(at::TensorList handles) {
  TORCH_CHECK(!handles.empty(), "stack_state_handles: no handles");
  const auto shape = handles[0].sizes().vec();
  auto box = std::make_unique<StackedHandleBox>();
  for (const auto& h : handles) {
    TORCH_CHECK(
        is_concrete_handle(h) && h.scalar_type() == at::kLong &&
            h.sizes().equals(shape),
        "stack_state_handles: expected state handles of shape ",
        shape,
        ", got ",
        h.defined() ? c10::str(h.toString(), h.sizes()) : "undefined");
    // Every element of `h` in row-major order, found through its storage
    // offset (a view of a stacked handle selects some of its states).
    const auto numel = h.numel();
    std::vector<int64_t> index(h.dim(), 0);
    for (int64_t n = 0; n < numel; ++n) {
      int64_t offset = h.storage_offset();
      for (int64_t d = 0; d < h.dim(); ++d) {
        offset += index[d] * h.stride(d);
      }
      auto state = state_at(h.storage(), offset);
      TORCH_CHECK(
          state != nullptr,
          "stack_state_handles: element ",
          n,
          " of a handle has no captured state (not a state handle, or a copy "
          "of one)");
      box->values.push_back(
          static_cast<const int64_t*>(h.storage().data())[offset]);
      box->states.push_back(std::move(state));
      for (int64_t d = h.dim() - 1; d >= 0; --d) {
        if (++index[d] < h.size(d)) {
          break;
        }
        index[d] = 0;
      }
    }
  }
  std::vector<int64_t> sizes{static_cast<int64_t>(handles.size())};
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  const size_t count = box->values.size();
  auto* raw = box.release();
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      count * sizeof(int64_t),
      c10::DataPtr(
          raw->values.data(),
          raw,
          &release_stacked_handle,
          c10::Device(c10::kCPU)),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  auto stacked = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::Make<int64_t>());
  stacked.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return stacked;
}

namespace {

// Drops the kept reference to the state of `handle`, if any.
void forget_kept(const at::Tensor& handle) {
  auto& kept = kept_states();
  const int64_t value = *handle.const_data_ptr<int64_t>();
  std::shared_ptr<CapturedState> doomed;
  {
    std::lock_guard<std::mutex> lock(kept.mutex);
    auto it = kept.states.find(value);
    if (it == kept.states.end()) {
      return;
    }
    doomed = std::move(it->second);
    kept.states.erase(it);
    kept.count.store(kept.states.size(), std::memory_order_relaxed);
  }
  // `doomed` dies here, outside the lock (freeing a graph may re-enter).
}

} // namespace

void release_after_backward(const at::Tensor& handle) {
  if (kept_states().count.load(std::memory_order_relaxed) == 0) {
    return; // the usual case: no saved-tensor hooks, nothing kept
  }
  if (torch_private::current_graph_task_id() != -1 &&
      torch_private::current_graph_task_keep_graph()) {
    return; // retain_graph=True: a later backward may need it
  }
  forget_kept(handle);
}

void held_by_its_handle_alone(const at::Tensor& handle) {
  if (kept_states().count.load(std::memory_order_relaxed) == 0 ||
      !is_concrete_handle(handle)) {
    return;
  }
  forget_kept(handle);
}

int64_t live_state_count() {
  return g_live_states.load(std::memory_order_relaxed);
}

int64_t live_states() {
  return live_state_count();
}

} // namespace torchleaf
