#include "output_check.h"

#include <algorithm>

#include <ATen/ATen.h>

#include <sstream>

#include <torchleaf/errors.h>

#include "registry.h"

namespace torchleaf {
namespace {

using Meta = FakeOutputRecords::Meta;
using Record = FakeOutputRecords::Record;
constexpr int64_t kUnknown = FakeOutputRecords::kUnknown;

int64_t concrete(const c10::SymInt& s) {
  return s.maybe_as_int().value_or(kUnknown);
}

// What a fake (or real) tensor tells a graph about itself; strides only when
// `with_strides`.
Meta meta_of(const at::Tensor& t, bool with_strides = true) {
  Meta m;
  if (!t.defined() || t.is_nested()) {
    return m;
  }
  m.known = true;
  m.dtype = t.scalar_type();
  m.device = t.device();
  for (const auto& s : t.sym_sizes()) {
    m.sizes.push_back(concrete(s));
  }
  m.strided = with_strides && t.layout() == at::kStrided;
  if (m.strided) {
    for (const auto& s : t.sym_strides()) {
      m.strides.push_back(concrete(s));
    }
  }
  return m;
}

bool same(const Meta& a, const Meta& b) {
  return a.known == b.known && a.dtype_known == b.dtype_known &&
      a.device_known == b.device_known && a.strided == b.strided &&
      a.dtype == b.dtype && a.device == b.device && a.sizes == b.sizes &&
      a.strides == b.strides;
}

bool same_inputs(const std::vector<Meta>& a, const std::vector<Meta>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same(a[i], b[i])) {
      return false;
    }
  }
  return true;
}

// `into` becomes what both traces agree on.
void merge(Meta& into, const Meta& other) {
  if (!into.known) {
    return;
  }
  if (!other.known || into.sizes.size() != other.sizes.size()) {
    into = Meta{};
    return;
  }
  into.dtype_known =
      into.dtype_known && other.dtype_known && into.dtype == other.dtype;
  into.device_known =
      into.device_known && other.device_known && into.device == other.device;
  for (size_t d = 0; d < into.sizes.size(); ++d) {
    if (into.sizes[d] != other.sizes[d]) {
      into.sizes[d] = kUnknown;
    }
  }
  // Strides: only traces that rely on them record them (Inductor's); the
  // others have no opinion.
  if (!other.strided) {
    return;
  }
  if (!into.strided) {
    into.strided = true;
    into.strides = other.strides;
    return;
  }
  for (size_t d = 0; d < into.strides.size(); ++d) {
    if (into.strides[d] != other.strides[d]) {
      into.strides[d] = kUnknown;
    }
  }
}

// A real tensor whose sizes and strides can be read as integers.
bool readable(const at::Tensor& t) {
  return t.defined() && !t.is_nested() &&
      !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// Whether a real input has the metadata a trace saw (unknown entries match
// anything); `strides_match` is cleared when its strides differ.
bool input_matches(const Meta& m, const at::Tensor& t, bool& strides_match) {
  if (!m.known) {
    return true;
  }
  if (!readable(t) || (m.dtype_known && t.scalar_type() != m.dtype) ||
      (m.device_known && t.device() != m.device)) {
    return false;
  }
  const auto sizes = t.sizes();
  if (sizes.size() != m.sizes.size()) {
    return false;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (m.sizes[d] != kUnknown && m.sizes[d] != sizes[d]) {
      return false;
    }
  }
  if (strides_match) {
    if (!m.strided || t.layout() != at::kStrided) {
      strides_match = false;
      return true;
    }
    const auto strides = t.strides();
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] > 1 && m.strides[d] != kUnknown &&
          m.strides[d] != strides[d]) {
        strides_match = false;
        break;
      }
    }
  }
  return true;
}

std::string show(c10::ArrayRef<int64_t> values) {
  std::ostringstream ss;
  ss << "[";
  for (size_t i = 0; i < values.size(); ++i) {
    ss << (i > 0 ? ", " : "");
    if (values[i] == kUnknown) {
      ss << "?";
    } else {
      ss << values[i];
    }
  }
  ss << "]";
  return ss.str();
}

// Empty when `out` agrees with what the fake gave; otherwise what differs.
std::string output_mismatch(
    const Meta& m,
    const at::Tensor& out,
    bool check_strides) {
  if (!m.known || !readable(out)) {
    return {};
  }
  const auto sizes = out.sizes();
  bool sizes_ok = sizes.size() == m.sizes.size();
  for (size_t d = 0; sizes_ok && d < sizes.size(); ++d) {
    sizes_ok = m.sizes[d] == kUnknown || m.sizes[d] == sizes[d];
  }
  if (!sizes_ok) {
    return c10::str(
        sizes.size() == m.sizes.size() ? "shape "
                                       : c10::str(sizes.size(), "-d shape "),
        show(sizes),
        " but the fake implementation returned ",
        sizes.size() == m.sizes.size() ? "shape "
                                       : c10::str(m.sizes.size(), "-d shape "),
        show(m.sizes));
  }
  if (m.dtype_known && out.scalar_type() != m.dtype) {
    return c10::str(
        "dtype ",
        out.scalar_type(),
        " but the fake implementation returned dtype ",
        m.dtype);
  }
  if (m.device_known && out.device() != m.device) {
    return c10::str(
        "device ",
        out.device(),
        " but the fake implementation returned device ",
        m.device);
  }
  if (check_strides && m.strided && out.layout() == at::kStrided) {
    const auto strides = out.strides();
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] > 1 && m.strides[d] != kUnknown &&
          m.strides[d] != strides[d]) {
        return c10::str(
            "strides ",
            show(strides),
            " (shape ",
            show(sizes),
            ") but the fake implementation returned strides ",
            show(m.strides),
            " (compiled code such as Inductor's relies on them; e.g. return "
            "torch.empty_like(x) for an output laid out like input x, or make "
            "the real output .contiguous(). An output that is a view of an "
            "input or of another output is returned as a copy, laid out as "
            ".clone() lays it out: contiguous unless the view is dense)");
      }
    }
  }
  return {};
}

} // namespace

void FakeOutputRecords::record(
    int64_t plan,
    const TensorList& inputs,
    const TensorList& outputs,
    bool output_strides) {
  Record rec;
  rec.inputs.reserve(inputs.size());
  for (const auto& t : inputs) {
    rec.inputs.push_back(meta_of(t));
  }
  rec.outputs.reserve(outputs.size());
  for (const auto& t : outputs) {
    rec.outputs.push_back(meta_of(t, output_strides));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto& records = plans_[plan];
  for (auto& existing : records.records) {
    if (same_inputs(existing.inputs, rec.inputs)) {
      if (existing.outputs.size() != rec.outputs.size()) {
        // Structure differs between traces of one call structure (the
        // Python layer reports that itself): no opinion.
        for (auto& m : existing.outputs) {
          m = Meta{};
        }
        return;
      }
      for (size_t i = 0; i < rec.outputs.size(); ++i) {
        merge(existing.outputs[i], rec.outputs[i]);
      }
      return;
    }
  }
  if (records.records.size() >= kMaxRecordsPerPlan) {
    // The least recently matched one (see kMaxRecordsPerPlan).
    records.records.erase(records.records.begin());
  }
  records.records.push_back(std::move(rec));
  any_.store(true, std::memory_order_release);
}

void FakeOutputRecords::check(
    const LeafEntry& entry,
    int64_t plan,
    const TensorList& inputs,
    const TensorList& outputs) const {
  if (!any_.load(std::memory_order_acquire)) {
    return;
  }
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(plan);
    if (it == plans_.end()) {
      return;
    }
    // A record whose input strides match this call's decides alone when
    // there is one: a trace with other input layouts (only sizes match)
    // expected other output strides and would accept what this layout's
    // trace rules out.
    bool exact_seen = false;
    bool loose_accepts = false;
    std::string loose_failure;
    // Newest or most recently matched first: a hit is found at once, and
    // is moved to the back (kMaxRecordsPerPlan drops from the front).
    auto& recs = it->second.records;
    for (size_t r = recs.size(); r-- > 0;) {
      const auto& rec = recs[r];
      if (rec.inputs.size() != inputs.size()) {
        continue;
      }
      bool matches = true;
      bool strides_match = true;
      for (size_t i = 0; matches && i < inputs.size(); ++i) {
        matches = input_matches(rec.inputs[i], inputs[i], strides_match);
      }
      if (!matches || (exact_seen && !strides_match)) {
        continue;
      }
      std::string why;
      if (rec.outputs.size() != outputs.size()) {
        why = c10::str(
            "returned ",
            outputs.size(),
            " tensor(s), but its fake implementation returned ",
            rec.outputs.size(),
            " when the graph was traced");
      }
      for (size_t i = 0; why.empty() && i < outputs.size(); ++i) {
        auto what = output_mismatch(rec.outputs[i], outputs[i], strides_match);
        if (!what.empty()) {
          why = c10::str(
              "output ", i, " has ", what, " when the graph was traced");
        }
      }
      if (strides_match) {
        if (why.empty()) {
          std::rotate(recs.begin() + r, recs.begin() + r + 1, recs.end());
          return; // a trace of this very layout agrees with this call
        }
        if (!exact_seen) {
          exact_seen = true;
          failure = std::move(why);
        }
      } else if (why.empty()) {
        loose_accepts = true;
      } else if (loose_failure.empty()) {
        loose_failure = std::move(why);
      }
    }
    if (!exact_seen) {
      if (loose_accepts) {
        return;
      }
      failure = std::move(loose_failure);
    }
  }
  if (!failure.empty()) {
    detail::throw_leaf_error(
        entry.name,
        c10::str(
            failure,
            ". The graph was built from the fake's outputs, so it would compute "
            "garbage or fail inside compiled code. Fix the fake implementation "
            "(register_fake in Python, the fake LeafFn in C++) so that it returns "
            "what the real function returns; torchleaf.config.validate_outputs = "
            "True compares them on every call."));
  }
}

size_t FakeOutputRecords::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = 0;
  for (const auto& [plan, records] : plans_) {
    n += records.records.size();
  }
  return n;
}

} // namespace torchleaf
