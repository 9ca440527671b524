// The small models the tests train on synthetic data.
#pragma once

#include <cstdint>

#include "dtrain/models/Zoo.h"

namespace dtrain::test {

/// An MLP inputs-hidden-classes (one hidden layer), for synthetic data of `inputs` features.
inline models::ModelSpec small_mlp(int64_t inputs, int64_t hidden, int64_t classes) {
  models::ModelSpec spec;
  spec.name = "mlp";
  spec.input_shape = {inputs};
  spec.hidden = {hidden};
  spec.classes = classes;
  return spec;
}

}  // namespace dtrain::test
