#pragma once
// A profiler range around one of torchleaf's calls that costs one
// thread-local check when no profiler listens. RECORD_FUNCTION builds an
// empty callback set on every call (~250 instructions, three times per
// compiled step); PyTorch's dispatcher asks whether there are callbacks
// first, as this does.

#include <ATen/record_function.h>

#include <optional>
#include <string_view>

namespace torchleaf {

class ProfilerRange {
 public:
  explicit ProfilerRange(std::string_view name) {
    auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
    if (C10_UNLIKELY(callbacks.has_value())) {
      range_.emplace(std::move(*callbacks));
      range_->before(name, c10::ArrayRef<const c10::IValue>{});
    }
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  std::optional<at::RecordFunction> range_;
};

} // namespace torchleaf
