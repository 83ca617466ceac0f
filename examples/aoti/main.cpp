// Loads an AOTInductor package whose graph calls the C++ leaf
// aoti_example::clip_rows and runs it, with no Python in the process:
//
//   aoti_example MODEL.pt2 CASES.pt
//
// CASES.pt is a torch.save'd list of {"inputs": [Tensor], "expected":
// [Tensor]} (examples/aoti/package.py writes it with eager outputs). Exits
// non-zero when an output differs from the expected one.
#include "leaves.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>
#include <iterator>

namespace {

std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& v : list.toListRef()) {
    out.push_back(v.toTensor());
  }
  return out;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt2 CASES.pt" << std::endl;
    return 2;
  }
  // The leaf's named operator must exist before the package is loaded: its
  // proxy executor looks up every custom operator in the dispatcher then.
  // Linking aoti_example_leaves defined it; say which leaf runs.
  std::cout << "leaf " << aoti_example::clip_rows().name() << " defined" << std::endl;

  std::ifstream file(argv[2], std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto cases = torch::jit::pickle_load(bytes).toList();

  c10::InferenceMode inference;
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  bool ok = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto entry = cases.get(i).toGenericDict();
    const auto outputs = loader.run(tensors(entry.at("inputs")));
    const auto expected = tensors(entry.at("expected"));
    bool same = outputs.size() == expected.size();
    for (size_t j = 0; same && j < outputs.size(); ++j) {
      same = outputs[j].sizes() == expected[j].sizes() &&
          at::allclose(outputs[j], expected[j], /*rtol=*/1e-5, /*atol=*/1e-6);
    }
    std::cout << "case " << i << " (batch " << entry.at("inputs").toListRef()[0].toTensor().size(0)
              << "): " << (same ? "matches" : "DIFFERS FROM") << " eager" << std::endl;
    ok = ok && same;
  }
  return ok ? 0 : 1;
}
