#include "registry.h"

#include <mutex>
#include <random>
#include <shared_mutex>
#include <unordered_map>

#include <torchleaf/config.h>
#include <torchleaf/errors.h>

namespace torchleaf {
namespace {

constexpr int kIndexBits = 24;
constexpr int64_t kIndexMask = (int64_t{1} << kIndexBits) - 1;
// Set in the ids of named (C++) leaves, never in the others.
constexpr int64_t kNamedBit = int64_t{1} << 62;

int64_t named_id(const std::string& name) {
  uint64_t hash = 14695981039346656037ull; // FNV-1a
  for (unsigned char c : name) {
    hash = (hash ^ c) * 1099511628211ull;
  }
  return kNamedBit | static_cast<int64_t>(hash & (kNamedBit - 1));
}

int64_t random_prefix() {
  std::random_device device;
  std::uniform_int_distribution<int64_t> prefix(1, (int64_t{1} << 38) - 1);
  return prefix(device);
}

struct Registry {
  const int64_t prefix = random_prefix();
  std::shared_mutex mutex;
  // Owned, never freed: see LeafEntry.
  std::vector<LeafEntry*> entries;
  std::unordered_map<std::string, int64_t> named; // name -> index
  std::unordered_map<int64_t, size_t> named_ids; // id -> index
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
  TORCH_CHECK(
      static_cast<int64_t>(reg.entries.size()) < kIndexMask,
      "torchleaf: too many leaf functions and call structures registered (",
      reg.entries.size(),
      "); a Python leaf called with ever-changing constants under a tracer "
      "registers one per distinct call.");
  entry->index = reg.entries.size();
  if (entry->has_named_op) {
    entry->id = named_id(entry->name);
    TORCH_CHECK(
        reg.named_ids.count(entry->id) == 0,
        "torchleaf: the names '",
        entry->name,
        "' and '",
        reg.entries[reg.named_ids[entry->id]]->name,
        "' hash to the same leaf id; rename one of them.");
  } else {
    entry->id = (reg.prefix << kIndexBits) | static_cast<int64_t>(entry->index);
  }
  LeafEntry* raw = entry.release();
  reg.entries.push_back(raw);
  if (raw->has_named_op) {
    reg.named.emplace(raw->name, raw->index);
    reg.named_ids.emplace(raw->id, raw->index);
  }
  return *raw;
}

const LeafEntry& get_leaf(int64_t id) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  if (id & kNamedBit) {
    auto it = reg.named_ids.find(id);
    TORCH_CHECK(
        it != reg.named_ids.end(),
        "torchleaf: no C++ leaf function has id ",
        id,
        " in this process; load the library that defines it first.");
    return *reg.entries[it->second];
  }
  const auto index = static_cast<size_t>(id & kIndexMask);
  TORCH_CHECK(
      (id >> kIndexBits) == reg.prefix && index < reg.entries.size(),
      "torchleaf: no leaf function has id ",
      id,
      " in this process. Leaf ids are only valid in the process that traced "
      "the graph; re-trace (torch.compile does) instead of reusing a graph "
      "from another process, or use a C++ leaf's named operator (export).");
  return *reg.entries[index];
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
  for (const auto* e : reg.entries) {
    if (e->has_named_op) {
      ids.push_back(e->id);
    }
  }
  return ids;
}

} // namespace torchleaf
