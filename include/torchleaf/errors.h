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

// Called inside a catch block with a note naming the leaf, for exceptions
// that are not c10::Errors (a Python exception raised in backward): the
// Python bindings add the note to the Python exception, which keeps its type.
using ForeignErrorNoter = void (*)(const std::string& note);
TORCHLEAF_API void set_foreign_error_noter(ForeignErrorNoter noter);

namespace detail {
// Inside a catch block only; no-op without a noter.
TORCHLEAF_API void note_foreign_error(const std::string& note);
[[noreturn]] TORCHLEAF_API void throw_leaf_error(
    const std::string& leaf_name,
    const std::string& message);
} // namespace detail

} // namespace torchleaf

// TORCH_CHECK for user errors that concern one leaf function: the message is
// prefixed with the leaf's name.
#define TORCHLEAF_CHECK(cond, leaf_name, ...)                                  \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                                        \
    ::torchleaf::detail::throw_leaf_error((leaf_name), c10::str(__VA_ARGS__)); \
  }
