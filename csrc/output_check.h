#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torchleaf {

struct LeafEntry;
using TensorList = std::vector<at::Tensor>;

// The always-on check of a traced call's real outputs against its fake's.
//
// A graph is traced with the fake's outputs: their rank, sizes, dtype,
// device and (Inductor asserts them) strides. A wrong fake used to give
// silent garbage under aot_eager (the real tensor has a shape the graph did
// not assume) or an Inductor assert that names no leaf. Each time a leaf's
// fake runs through an operator's fake kernel (tracing), the metadata of its
// inputs and outputs is recorded per call structure (plan), with symbolic
// sizes and strides (dynamic shapes, unbacked sizes) marked unknown; records
// of the same plan and the same input metadata are merged (entries that
// differ become unknown). Every real call then looks up the records whose
// input metadata matches its inputs and fails, naming the leaf and the
// output, when its outputs agree with none of them.
//
// Keyed by inputs, not only by plan: a C++ leaf's calls all have plan 0, and
// a Python leaf's traced plans also serve eager calls under dispatch modes
// and functorch transforms, whose inputs may have any shape; such a call is
// checked only when a trace saw inputs like its own, and a fake is a
// function of its inputs' metadata and the plan's constants. Output strides
// are recorded only by traces that rely on them (Inductor's lowering), and
// compared only when the inputs' strides match the traced ones too (and, as
// Inductor does, only in dimensions of size > 1); a record whose input
// strides match decides alone, so that a trace of another input layout
// cannot accept what this layout's trace rules out.
//
// Cost per real call: an atomic load when the leaf was never traced;
// otherwise a mutex, a hash lookup and a comparison of a few integers per
// tensor.
class FakeOutputRecords {
 public:
  // Records the fake outputs of one traced call of `plan`. Their strides
  // only when `output_strides`: when the code being compiled relies on them
  // (Inductor asserts its extern kernels' output strides; aot_eager and
  // eager graphs run whatever layout comes back).
  void record(
      int64_t plan,
      const TensorList& inputs,
      const TensorList& outputs,
      bool output_strides);

  // Fails with a LeafFunctionError naming `entry` when a record of `plan`
  // matches `inputs` and none of the matching records accepts `outputs`.
  void check(
      const LeafEntry& entry,
      int64_t plan,
      const TensorList& inputs,
      const TensorList& outputs) const;

  // Number of records (tests).
  size_t size() const;

  static constexpr int64_t kUnknown = INT64_MIN;
  // Records kept per plan. One more input signature drops the least
  // recently matched record (check() keeps them in that order), so that
  // the signatures in use stay checked: a cap of 16 that disabled the plan's
  // check was silent garbage under aot_eager from the 17th static signature
  // on (issue 36). A signature whose record was dropped is checked by the
  // records that still match it (less specific ones: sizes, not strides)
  // or not at all.
  static constexpr size_t kMaxRecordsPerPlan = 256;

  struct Meta {
    bool known = false; // false: nothing is checked (nested tensors, ...)
    bool dtype_known = true;
    bool device_known = true;
    bool strided = true; // strides recorded (a layout with strides, and a trace
                         // that relies on them)
    at::ScalarType dtype = at::ScalarType::Undefined;
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    c10::SmallVector<int64_t, 6> sizes; // kUnknown where symbolic or differing
    c10::SmallVector<int64_t, 6> strides;
  };
  struct Record {
    std::vector<Meta> inputs;
    std::vector<Meta> outputs;
  };

 private:
  struct PlanRecords {
    std::vector<Record> records;
  };

  mutable std::mutex mutex_;
  std::atomic<bool> any_{false};
  mutable std::unordered_map<int64_t, PlanRecords>
      plans_; // (check() reorders records)
};

} // namespace torchleaf
