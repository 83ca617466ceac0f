#include <torchleaf/errors.h>

#include <atomic>

namespace torchleaf {
namespace {
std::atomic<ErrorThrower> g_thrower{nullptr};
std::atomic<ForeignErrorNoter> g_noter{nullptr};
} // namespace

void set_error_thrower(ErrorThrower thrower) {
  g_thrower.store(thrower);
}

void set_foreign_error_noter(ForeignErrorNoter noter) {
  g_noter.store(noter);
}

namespace detail {
void note_foreign_error(const std::string& note) {
  if (auto noter = g_noter.load()) {
    noter(note);
  }
}

void throw_leaf_error(
    const std::string& leaf_name,
    const std::string& message) {
  std::string full = "torchleaf: leaf function '" + leaf_name + "' " + message;
  if (auto thrower = g_thrower.load()) {
    thrower(full); // must throw
  }
  throw LeafError(std::move(full));
}
} // namespace detail

} // namespace torchleaf
