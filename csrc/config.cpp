#include <torchleaf/config.h>

#include <atomic>

#include "replay.h" // TORCHLEAF_INLINE_REPLAY_SUPPORTED

namespace torchleaf {
namespace {
std::atomic<bool> g_validate_outputs{false};
std::atomic<bool> g_check_escaped_gradients{true};
std::atomic<bool> g_inline_replay{true};
} // namespace

bool Config::validate_outputs() {
  return g_validate_outputs.load(std::memory_order_relaxed);
}
void Config::set_validate_outputs(bool enabled) {
  g_validate_outputs.store(enabled);
}
bool Config::check_escaped_gradients() {
  return g_check_escaped_gradients.load(std::memory_order_relaxed);
}
void Config::set_check_escaped_gradients(bool enabled) {
  g_check_escaped_gradients.store(enabled);
}
bool Config::inline_replay() {
  return TORCHLEAF_INLINE_REPLAY_SUPPORTED &&
      g_inline_replay.load(std::memory_order_relaxed);
}
void Config::set_inline_replay(bool enabled) {
  g_inline_replay.store(enabled);
}

} // namespace torchleaf
