#include "dtrain/common/Model.h"

#include <torch/nn/modules/container/sequential.h>

namespace dtrain {

Model sequential_model(const torch::nn::Sequential& sequential) {
  Model model(sequential);
  const auto children = sequential->children();
  for (size_t i = 0; i < children.size(); ++i) {
    model.stages.push_back(
        {std::to_string(i), {children[i]}, [impl = sequential.ptr(), i](const at::Tensor& x) {
           return (impl->begin() + static_cast<std::ptrdiff_t>(i))->forward(x);
         }});
  }
  return model;
}

}  // namespace dtrain
