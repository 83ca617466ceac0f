#include "registry.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <torchleaf/config.h>
#include <torchleaf/errors.h>

namespace torchleaf {
namespace {

struct Registry {
  std::shared_mutex mutex;
  // Owned, never freed: see LeafEntry.
  std::vector<LeafEntry*> entries;
  std::unordered_map<std::string, int64_t> named;
};

Registry& registry() {
  // Leaked on purpose: kernels may run during static destruction of other
  // libraries, and entries hold Python objects that must not be destroyed
  // after the interpreter is gone.
  static auto* instance = new Registry();
  return *instance;
}

} // namespace

bool LeafEntry::validate_outputs() const {
  return options.validate_outputs.value_or(Config::validate_outputs());
}

bool LeafEntry::check_escaped_gradients() const {
  return options.check_escaped_gradients.value_or(
      Config::check_escaped_gradients());
}

bool LeafEntry::mutates(size_t flat_position) const {
  for (auto p : options.mutates_inputs) {
    if (static_cast<size_t>(p) == flat_position) {
      return true;
    }
  }
  return false;
}

LeafEntry& register_leaf(std::unique_ptr<LeafEntry> entry) {
  auto& reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mutex);
  if (entry->has_named_op) {
    TORCHLEAF_CHECK(
        reg.named.count(entry->name) == 0,
        entry->name,
        "is already defined. Each leaf function needs a unique "
        "\"namespace::name\"; pick another name or reuse the existing leaf "
        "(torchleaf::find_leaf).");
  }
  entry->id = static_cast<int64_t>(reg.entries.size());
  LeafEntry* raw = entry.release();
  reg.entries.push_back(raw);
  if (raw->has_named_op) {
    reg.named.emplace(raw->name, raw->id);
  }
  return *raw;
}

const LeafEntry& get_leaf(int64_t id) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  TORCH_CHECK(
      id >= 0 && static_cast<size_t>(id) < reg.entries.size(),
      "torchleaf: no leaf function has id ",
      id,
      ". Leaf ids are only valid in the process that defined the leaf; "
      "define the leaf (import its module or load its library) before "
      "running a graph that calls it.");
  return *reg.entries[id];
}

const LeafEntry* find_leaf_entry(const std::string& name) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  auto it = reg.named.find(name);
  return it == reg.named.end() ? nullptr : reg.entries[it->second];
}

std::vector<int64_t> named_leaf_ids() {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  std::vector<int64_t> ids;
  for (auto* e : reg.entries) {
    if (e->has_named_op) {
      ids.push_back(e->id);
    }
  }
  return ids;
}

} // namespace torchleaf
