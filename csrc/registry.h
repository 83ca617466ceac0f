#pragma once

#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

#include <torchleaf/export.h>
#include <torchleaf/leaf.h>

namespace torchleaf {

// Everything torchleaf knows about one leaf function. Entries are created once
// and never destroyed (ids are baked into traced graphs), so kernels may keep
// plain pointers to them.
struct TORCHLEAF_API LeafEntry {
  // The id graphs refer to. PyTorch's on-disk compilation caches may reuse a
  // graph compiled in another process, so an id must mean the same leaf in
  // every process or in none: C++ leaves take a hash of their name (the same
  // library defines the same leaf), Python leaves a per-process random prefix
  // plus `index` (their call structures are process-local).
  int64_t id = -1;
  // Dense position in the registry, for per-entry caches.
  size_t index = 0;
  // "ns::name" for C++ leaves; the Python qualname for Python leaves.
  std::string name;
  LeafFn real;
  LeafFn fake;
  LeafOptions options;
  // True when the leaf owns a named operator `name` (C++ leaves). Python
  // leaves go through the generic torchleaf::call operator.
  bool has_named_op = false;
  // The operator fragment that defines the named operator; kept alive so the
  // registration stays in place.
  std::unique_ptr<torch::Library> library;

  bool validate_outputs() const;
  bool check_escaped_gradients() const;
  bool mutates(size_t flat_position) const;
};

// Internal API, exported for the Python bindings.

// Registers a new entry and returns it; the id is assigned here.
TORCHLEAF_API LeafEntry& register_leaf(std::unique_ptr<LeafEntry> entry);

// The entry for `id`; a clear error when there is none.
TORCHLEAF_API const LeafEntry& get_leaf(int64_t id);

// The entry whose name is `name`, or nullptr.
TORCHLEAF_API const LeafEntry* find_leaf_entry(const std::string& name);

// Ids of all leaves that own a named operator, in definition order.
TORCHLEAF_API std::vector<int64_t> named_leaf_ids();

} // namespace torchleaf
