#include "registry.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <unordered_map>

#include <torchleaf/config.h>
#include <torchleaf/errors.h>

namespace torchleaf {
namespace {

constexpr int kCounterBits = 24;
// Set in the ids of named (C++) leaves, never in the others.
constexpr int64_t kNamedBit = int64_t{1} << 62;

uint64_t fnv1a(const std::string& s) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : s) {
    hash = (hash ^ c) * 1099511628211ull;
  }
  return hash;
}

int64_t random_prefix() {
  std::random_device device;
  std::uniform_int_distribution<int64_t> prefix(1, (int64_t{1} << 37) - 1);
  return prefix(device);
}

// TORCHLEAF_STABLE_IDS=1: Python leaves get ids that do not depend on the
// process (see register_leaf).
bool stable_ids_requested() {
  const char* value = std::getenv("TORCHLEAF_STABLE_IDS");
  return value != nullptr && std::string(value) == "1";
}

struct Registry {
  const bool stable_ids = stable_ids_requested();
  const int64_t prefix = random_prefix();
  int64_t next_counter = 0; // under `mutex`
  std::unordered_map<std::string, int64_t>
      definitions; // name -> Python leaves so named
  std::shared_mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<LeafEntry>> by_id;
  std::unordered_map<std::string, int64_t> named; // name -> id
  std::vector<int64_t> named_order; // definition order
};

Registry& registry() {
  // Leaked on purpose: kernels may run during static destruction of other
  // libraries, and Python entries must not be destroyed after the
  // interpreter is gone.
  static auto* instance = new Registry();
  return *instance;
}

bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) {
    return false;
  }
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) {
      return false;
    }
  }
  return true;
}

} // namespace

std::pair<std::string, std::string> split_qualified_name(
    const std::string& qualified_name) {
  const auto sep = qualified_name.find("::");
  std::string ns =
      sep == std::string::npos ? "" : qualified_name.substr(0, sep);
  std::string name =
      sep == std::string::npos ? "" : qualified_name.substr(sep + 2);
  TORCHLEAF_CHECK(
      is_identifier(ns) && is_identifier(name),
      qualified_name,
      "has a malformed name: expected \"namespace::name\" where both parts "
      "are identifiers (letters, digits, underscores), e.g. \"mylib::scale\".");
  // Operators of these namespaces are PyTorch's and torchleaf's own: a leaf
  // there would sit beside them (aten::add without an overload name) or
  // collide with them.
  for (const char* reserved : {"aten", "prim", "prims", "torchleaf"}) {
    TORCHLEAF_CHECK(
        ns != reserved,
        qualified_name,
        "uses the namespace '",
        ns,
        "', which holds PyTorch's (or torchleaf's) own operators. Give the "
        "leaf a namespace of its own, e.g. \"mylib::",
        name,
        "\".");
  }
  return {std::move(ns), std::move(name)};
}

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

void LeafEntry::check_input_count(size_t received) const {
  if (options.num_inputs.has_value()) {
    TORCHLEAF_CHECK(
        static_cast<int64_t>(received) == *options.num_inputs,
        name,
        "takes ",
        *options.num_inputs,
        " input tensor(s) (LeafOptions::inputs) but was called with ",
        received,
        ". Pass exactly ",
        *options.num_inputs,
        " tensors, mutable ones included, in the declared order.");
  }
}

int64_t named_leaf_id(const std::string& name) {
  return kNamedBit | static_cast<int64_t>(fnv1a(name) & (kNamedBit - 1));
}

void check_name_free(const std::string& name) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  TORCHLEAF_CHECK(
      reg.named.count(name) == 0,
      name,
      "is already defined. Each leaf function needs a unique "
      "\"namespace::name\"; pick another name or reuse the existing leaf "
      "(torchleaf::find_leaf).");
}

int64_t register_leaf(std::shared_ptr<LeafEntry> entry) {
  auto& reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mutex);
  if (entry->has_named_op()) {
    TORCHLEAF_CHECK(
        reg.named.count(entry->name) == 0,
        entry->name,
        "is already defined. Each leaf function needs a unique "
        "\"namespace::name\"; pick another name or reuse the existing leaf "
        "(torchleaf::find_leaf).");
    entry->id = named_leaf_id(entry->name);
    auto clash = reg.by_id.find(entry->id);
    TORCH_CHECK(
        clash == reg.by_id.end(),
        "torchleaf: the names '",
        entry->name,
        "' and '",
        clash == reg.by_id.end() ? "" : clash->second->name,
        "' hash to the same leaf id; rename one of them.");
    reg.named.emplace(entry->name, entry->id);
    reg.named_order.push_back(entry->id);
  } else if (!reg.stable_ids) {
    // A per-process random prefix: a graph compiled in one process never
    // calls a leaf of another. PyTorch's on-disk compile caches key graphs by
    // their text, which shows a call's id and plan but not the shapes its
    // fake gives, so another process's leaf of the same name and another
    // fake would get this process's compiled code.
    TORCH_CHECK(
        reg.next_counter < (int64_t{1} << kCounterBits),
        "torchleaf: more than ",
        int64_t{1} << kCounterBits,
        " Python leaf functions were defined in this process; define leaves "
        "once (at module level) rather than per call.");
    entry->id = (reg.prefix << kCounterBits) | reg.next_counter++;
  } else {
    // Stable ids, asked for by a program that defines the same leaves with
    // the same fakes in every process: the k-th leaf of a name gets
    // hash(name) << kCounterBits | k, so that warm restarts find the on-disk
    // compile caches; never an id a dead leaf had (k only grows).
    int64_t& k = reg.definitions[entry->name];
    const int64_t prefix =
        static_cast<int64_t>(fnv1a(entry->name) & ((uint64_t{1} << 37) - 1)) |
        1;
    do {
      TORCH_CHECK(
          k < (int64_t{1} << kCounterBits),
          "torchleaf: more than ",
          int64_t{1} << kCounterBits,
          " Python leaf functions named '",
          entry->name,
          "' were defined in this process; define leaves once (at module "
          "level) rather than per call.");
      entry->id = (prefix << kCounterBits) | k++;
    } while (reg.by_id.count(entry->id) != 0); // two names' hashes met
  }
  const int64_t id = entry->id;
  reg.by_id.emplace(id, std::move(entry));
  return id;
}

void unregister_leaf(int64_t id) {
  std::shared_ptr<LeafEntry> doomed;
  {
    auto& reg = registry();
    std::unique_lock<std::shared_mutex> lock(reg.mutex);
    auto it = reg.by_id.find(id);
    if (it == reg.by_id.end()) {
      return;
    }
    TORCH_INTERNAL_ASSERT(
        !it->second->has_named_op(), "named leaves are never unregistered");
    doomed = std::move(it->second);
    reg.by_id.erase(it);
  }
  // `doomed` dies here, outside the lock: a Python entry's destructor takes
  // the GIL, which a thread waiting for this lock may hold.
}

LeafEntryPtr find_leaf(int64_t id) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  auto it = reg.by_id.find(id);
  return it != reg.by_id.end() ? it->second : nullptr;
}

LeafEntryPtr get_leaf(int64_t id) {
  if (auto entry = find_leaf(id)) {
    return entry;
  }
  if (id & kNamedBit) {
    TORCH_CHECK(
        false,
        "torchleaf: no C++ leaf function has id ",
        id,
        " in this process; load the library that defines it first.");
  }
  TORCH_CHECK(
      false,
      "torchleaf: no leaf function has id ",
      id,
      " in this process. Either its Python function was deleted (a graph "
      "that calls a leaf keeps only its id: keep the leaf alive as long as "
      "graphs that call it run), or the graph was traced in another process "
      "(re-trace it, as torch.compile does, or export a C++ leaf's named "
      "operator).");
}

LeafEntryPtr find_leaf_entry(const std::string& name) {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  auto it = reg.named.find(name);
  return it == reg.named.end() ? nullptr : reg.by_id.at(it->second);
}

std::vector<LeafEntryPtr> named_leaves() {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  std::vector<LeafEntryPtr> out;
  out.reserve(reg.named_order.size());
  for (auto id : reg.named_order) {
    out.push_back(reg.by_id.at(id));
  }
  return out;
}

size_t leaf_count() {
  auto& reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  return reg.by_id.size();
}

} // namespace torchleaf
