#include "detach.h"

#include <ATen/ATen.h>

#include <typeinfo>

#include "torch_private.h"

namespace torchleaf {

at::Tensor detached(const at::Tensor& t) {
  constexpr auto dispatched_keys = c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot});
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (typeid(*impl) != typeid(c10::TensorImpl) ||
      impl->key_set().has_any(dispatched_keys) || impl->is_inference() ||
      c10::InferenceMode::is_enabled() ||
      torch_private::tls_is_dispatch_key_included(c10::DispatchKey::Python)) {
    return t.detach();
  }
  return torch_private::shallow_detach(impl);
}

} // namespace torchleaf
