#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <functional>
#include <string>

#include <torchleaf/export.h>

namespace torchleaf {

// Every user-facing error raised by torchleaf. It is a c10::Error, so C++
// callers that already catch c10::Error keep working; the message always names
// the leaf function and says how to fix the problem.
class TORCHLEAF_API LeafError : public c10::Error {
 public:
  explicit LeafError(std::string msg) : c10::Error(std::move(msg)) {}
};

// The function that raises torchleaf errors. The Python bindings replace it so
// that errors surface as torchleaf.LeafFunctionError on every path (eager,
// compiled graphs, autograd engine threads). Pass nullptr to restore the
// default, which throws LeafError.
using ErrorThrower = void (*)(const std::string& message);
TORCHLEAF_API void set_error_thrower(ErrorThrower thrower);

namespace detail {
[[noreturn]] TORCHLEAF_API void throw_leaf_error(
    const std::string& leaf_name,
    const std::string& message);
} // namespace detail

} // namespace torchleaf

// TORCH_CHECK for user errors that concern one leaf function: the message is
// prefixed with the leaf's name.
#define TORCHLEAF_CHECK(cond, leaf_name, ...)                              \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                                    \
    ::torchleaf::detail::throw_leaf_error((leaf_name), c10::str(__VA_ARGS__)); \
  }
