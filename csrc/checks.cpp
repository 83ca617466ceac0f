// The checks of a real call that are not about gradients, and running a
// leaf's fake implementation; see checks.h.

#include "checks.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <torchleaf/errors.h>

#include "capture.h"
#include "torch_private.h"

namespace torchleaf {

void name_the_leaf(c10::Error& e, const char* what, const LeafEntry& entry) {
  if (dynamic_cast<LeafError*>(&e) == nullptr) {
    e.add_context(
        std::string("while running the ") + what + " of leaf function '" +
        entry.name + "'");
  }
}

bool aliases(const at::Tensor& a, const at::Tensor& b) {
  return a.has_storage() && b.has_storage() && a.is_alias_of(b);
}

std::string describe_input(const LeafEntry& entry, int64_t plan, size_t i) {
  std::string name;
  if (entry.input_name) {
    try {
      name = entry.input_name(plan, i);
    } catch (const std::exception&) {
      name.clear(); // an error message must not fail for want of a name
    }
  }
  return name.empty() ? c10::str("input ", i, " (flattened position)")
                      : c10::str("input ", i, " (", name, ")");
}

namespace {

// For an error about input i: the other inputs that are views of the same
// tensor (they share its version counter, so any of them may be the one
// that changed).
std::string views_of_one_tensor(const TensorList& inputs, size_t i) {
  std::string others;
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (j != i && aliases(inputs[j], inputs[i])) {
      others += c10::str(others.empty() ? "" : ", ", j);
    }
  }
  return others.empty()
      ? std::string()
      : c10::str(
            " or one of the inputs that are views of the same tensor (",
            others,
            ")");
}

} // namespace

void refuse_jit_tracing(const LeafEntry& entry) {
  TORCHLEAF_CHECK(
      !torch_private::jit_tracing(),
      entry.name,
      "was called under torch.jit.trace, which cannot record a leaf function: "
      "it would trace the function's body with its inputs baked in as "
      "constants. Use torch.compile, or torch.export (a Python leaf needs "
      "a name, leaf_function(name=\"ns::op\")).");
}

void check_read_and_mutated_disjoint(
    const LeafEntry& entry,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs) {
  for (size_t m = 0; m < mutable_inputs.size(); ++m) {
    for (size_t r = 0; mutable_inputs[m] && r < inputs.size(); ++r) {
      TORCHLEAF_CHECK(
          mutable_inputs[r] || !aliases(inputs[r], inputs[m]),
          entry.name,
          "received the same tensor (or views of one tensor) as input ",
          r,
          ", which it reads, and as input ",
          m,
          ", which it mutates in place (flattened positions). Pass a clone as "
          "the read-only input, or pass the tensor only once.");
    }
  }
}

void check_undeclared_mutation(
    const LeafEntry& entry,
    int64_t plan,
    const TensorList& inputs,
    c10::ArrayRef<bool> mutable_inputs,
    c10::ArrayRef<uint32_t> versions) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if ((mutable_inputs.empty() || !mutable_inputs[i]) &&
        !inputs[i].is_inference()) {
      TORCHLEAF_CHECK(
          version_of(inputs[i]) == versions[i],
          entry.name,
          "mutated its ",
          describe_input(entry, plan, i),
          views_of_one_tensor(inputs, i),
          " in place without declaring it. Declare it "
          "with mutates_args={...} (Python) or LeafOptions::mutates (C++), "
          "or clone the input before changing it.");
    }
  }
}

void check_mutation_without_history(
    const LeafEntry& entry,
    const TensorList& inner,
    c10::ArrayRef<bool> mutable_inputs) {
  for (size_t i = 0, k = 0; i < mutable_inputs.size();
       k += mutable_inputs[i], ++i) {
    // (Named by k, its place among the declared-mutable tensors: i depends
    // on how the call was made, eager or from which graph.)
    TORCHLEAF_CHECK(
        !mutable_inputs[i] || inner[i].grad_fn() == nullptr ||
            !entry.check_escaped_gradients(),
        entry.name,
        "changed its declared-mutable tensor ",
        k,
        " (counting from 0: the tensor arguments mutates_args names, in "
        "parameter order, then the buffers of the modules it names) in place "
        "with a value that has autograd history (computed from tensors that "
        "require grad): the caller's tensor gets the new data but not that "
        "history, so their gradient through it would be lost. Compute the new "
        "value out of place and return it as an output instead, compute the "
        "change from detached tensors (or under torch.no_grad()) if no "
        "gradient is wanted, or set torchleaf.config.check_escaped_gradients "
        "= False (C++: LeafOptions::check_escaped) to drop it knowingly.");
  }
}

void check_outputs_defined(const LeafEntry& entry, const TensorList& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCHLEAF_CHECK(
        outputs[i].defined(),
        entry.name,
        "real function returned an undefined tensor at output ",
        i,
        "; it must return tensors.");
  }
}

void validate_against_fake(
    const LeafEntry& entry,
    const TensorList& inputs,
    const TensorList& real,
    CallSite& site) {
  TensorList fake;
  {
    at::NoGradGuard no_grad;
    fake = run_fake(entry, inputs, site); // site.result: the real description
  }
  TORCHLEAF_CHECK(
      fake.size() == real.size(),
      entry.name,
      "returned ",
      real.size(),
      " tensor(s) but its fake implementation returned ",
      fake.size(),
      ". Make the fake return the same outputs as the real function.");
  for (size_t i = 0; i < real.size(); ++i) {
    const auto& r = real[i];
    const auto& f = fake[i];
    TORCHLEAF_CHECK(
        r.defined() == f.defined(),
        entry.name,
        "output ",
        i,
        " is ",
        r.defined() ? "a tensor" : "undefined",
        " in the real function but ",
        f.defined() ? "a tensor" : "undefined",
        " in the fake implementation.");
    if (!r.defined()) {
      continue;
    }
    TORCHLEAF_CHECK(
        r.sym_sizes() == f.sym_sizes(),
        entry.name,
        "output ",
        i,
        " has shape ",
        r.sym_sizes(),
        " but its fake implementation gives shape ",
        f.sym_sizes(),
        ". Fix the fake so that shapes match.");
    TORCHLEAF_CHECK(
        r.scalar_type() == f.scalar_type(),
        entry.name,
        "output ",
        i,
        " has dtype ",
        r.scalar_type(),
        " but its fake implementation gives dtype ",
        f.scalar_type(),
        ". Fix the fake so that dtypes match.");
    TORCHLEAF_CHECK(
        r.device() == f.device(),
        entry.name,
        "output ",
        i,
        " is on device ",
        r.device(),
        " but its fake implementation puts it on ",
        f.device(),
        ". Fix the fake so that devices match.");
  }
}

namespace {

// Whether `t` aliases any of `others` (aliases() with each, in one pass: a
// call with a module argument compares each output with hundreds of
// inputs). Two storages alias when they are one StorageImpl, or when they
// share data through PyTorch's refcounted deleter (isSharedStorageAlias),
// which a storage without that deleter never does, not even with itself.
bool aliases_any(const at::Tensor& t, at::TensorList others) {
  if (!t.has_storage()) {
    return false;
  }
  const c10::Storage& storage = t.storage();
  const c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  const bool may_share = c10::isSharedStorageAlias(storage, storage);
  for (const auto& other : others) {
    if (other.has_storage() &&
        (other.storage().unsafeGetStorageImpl() == impl ||
         (may_share && c10::isSharedStorageAlias(storage, other.storage())))) {
      return true;
    }
  }
  return false;
}

} // namespace

void copy_aliased_outputs(TensorList& outputs, const TensorList& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (aliases_any(outputs[i], inputs) ||
        aliases_any(outputs[i], at::TensorList(outputs.data(), i))) {
      outputs[i] = outputs[i].clone();
    }
  }
}

TensorList run_fake(
    const LeafEntry& entry,
    const TensorList& inputs,
    CallSite& site) {
  TORCHLEAF_CHECK(
      static_cast<bool>(entry.fake),
      entry.name,
      "requires a fake implementation to be traced (torch.compile, make_fx, "
      "torch.export, meta or fake tensors) or validated. Register one with "
      "@",
      entry.name,
      ".register_fake (Python) or pass a fake LeafFn to "
      "torchleaf::define_leaf (C++); it must return outputs with the same "
      "structure, shapes and dtypes as the real function.");
  TensorList outputs;
  try {
    outputs = entry.fake(inputs, site);
  } catch (c10::Error& e) {
    name_the_leaf(e, "fake implementation", entry);
    throw;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCHLEAF_CHECK(
        outputs[i].defined(),
        entry.name,
        "fake implementation returned an undefined tensor at output ",
        i,
        "; it must return tensors.");
  }
  return outputs;
}

} // namespace torchleaf
