#include <torchleaf/errors.h>

#include <atomic>

namespace torchleaf {
namespace {
std::atomic<ErrorThrower> g_thrower{nullptr};
} // namespace

void set_error_thrower(ErrorThrower thrower) {
  g_thrower.store(thrower);
}

namespace detail {
void throw_leaf_error(const std::string& leaf_name, const std::string& message) {
  std::string full = "torchleaf: leaf function '" + leaf_name + "' " + message;
  if (auto thrower = g_thrower.load()) {
    thrower(full); // must throw
  }
  throw LeafError(std::move(full));
}
} // namespace detail

} // namespace torchleaf
