#pragma once

#include <c10/core/DispatchKeySet.h>

#include "torch_private.h"

namespace torchleaf {

// The dispatch keys of user code that runs inside a kernel (the body, a
// replayed graph), as code outside any kernel has them. A kernel below the
// Autograd key runs with the autograd keys excluded: re-enabled when
// `autograd`, as the caller of the leaf had it. A kernel reached from a
// TorchDispatchMode's handler (a user's mode, FlopCounterMode, AOTAutograd's
// runtime check of custom operators) runs with every key above Python
// excluded, the conjugate, negative and zero-tensor fallbacks among them:
// without those, `z.conj() * 1j` in the body reads z's unconjugated data.
struct UserCodeKeysGuard {
  explicit UserCodeKeysGuard(bool autograd) : guard_(enabled_keys(autograd)) {}

 private:
  static torch_private::LocalDispatchKeySet enabled_keys(bool autograd) {
    constexpr auto view_fallbacks = c10::DispatchKeySet(
        {c10::DispatchKey::Conjugate,
         c10::DispatchKey::Negative,
         c10::DispatchKey::ZeroTensor});
    auto keys = torch_private::tls_local_dispatch_key_set();
    // ADInplaceOrView bumps version counters, which inference mode keeps
    // for normal tensors: excluded here, an in-place change in the body
    // would escape the mutation check and the saved-tensor check.
    keys.excluded_ = keys.excluded_ - view_fallbacks -
        c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView);
    if (autograd) {
      keys.excluded_ =
          keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    }
    return keys;
  }
  torch_private::ForceDispatchKeyGuard guard_;
};

} // namespace torchleaf
