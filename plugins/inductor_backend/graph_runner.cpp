// Compiled graphs (AOTInductor packages) run without holding Python's GIL.
//
// torch's Python binding of its package loader keeps the GIL for the whole of a graph's run, so
// no other Python thread moves while the model steps: `nxdplug serve`'s HTTP thread could only
// send tokens between two steps, and async mode's host work could not overlap a compiled step.
// Here the same C++ loader is held by a TorchBind class; Python's calls into a TorchBind object
// release the GIL while the C++ method runs. The methods keep the names of torch's binding.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace {

class Package : public torch::CustomClassHolder {
 public:
  explicit Package(const std::string& path) : loader_(path) {}

  // The graph's outputs for its flat inputs (weights, caches, then the step's tensors).
  std::vector<at::Tensor> boxed_run(std::vector<at::Tensor> inputs) {
    return loader_.boxed_run(std::move(inputs));
  }

  // The input and output tree specs, as JSON.
  std::vector<std::string> get_call_spec() { return loader_.get_call_spec(); }

  c10::Dict<std::string, std::string> get_metadata() {
    c10::Dict<std::string, std::string> metadata;
    for (const auto& [key, value] : loader_.get_metadata()) {
      metadata.insert(key, value);
    }
    return metadata;
  }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

}  // namespace

TORCH_LIBRARY(nxdplug_graph_runner, m) {
  m.class_<Package>("Package")
      .def(torch::init<std::string>())
      .def("boxed_run", &Package::boxed_run)
      .def("get_call_spec", &Package::get_call_spec)
      .def("get_metadata", &Package::get_metadata);
}
