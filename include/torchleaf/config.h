#pragma once

#include <torchleaf/export.h>

namespace torchleaf {

// Process-wide defaults. A leaf's own LeafOptions override them.
struct TORCHLEAF_API Config {
  // Compare real and fake outputs (count, shape, dtype, device) on every call.
  // Off by default: it runs the fake implementation a second time.
  static bool validate_outputs();
  static void set_validate_outputs(bool enabled);

  // Fail when the real function's autograd graph reaches a tensor that
  // requires grad but was not passed as an input (a closure or a global).
  // On by default: the check is a short walk of the captured graph.
  static bool check_escaped_gradients();
  static void set_check_escaped_gradients(bool enabled);

  // Backward of a traced call replays the captured graph. A small CPU graph
  // is replayed inline, in the calling thread, instead of through
  // torch::autograd::Engine::execute: the same gradients for a fraction of
  // the engine's fixed cost. On by default; turn it off to force the engine
  // (debugging, or to compare the two). The inline replay is written against
  // one PyTorch release's engine internals; built against any other,
  // inline_replay() is always false and every replay uses the engine.
  static bool inline_replay();
  static void set_inline_replay(bool enabled);
};

} // namespace torchleaf
