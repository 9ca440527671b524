// ResNet-18/34/50/101/152 with torchvision's architecture and parameter names (conv1, bn1,
// layer1.0.conv1, ..., layer1.0.downsample.0, fc: a torchvision state dict loads as it is, and
// dtrain's exports load into torchvision), its initialization (Kaiming normal, fan out, for the
// convolutions; BatchNorm at 1 and 0), Bottleneck with the stride on its 3x3 convolution (v1.5).
// Described as stages (the stem, each residual block, the head) for zero3, pipelines and
// activation checkpointing. Input: images [B, C, H, W]; output: logits [B, classes].
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/common/Model.h"

namespace dtrain::models {

/// `depth` 18, 34, 50, 101 or 152 (InputError otherwise); `channels` of the input (torchvision's
/// 3; 1 for Fashion-MNIST); activation checkpointing as ModelSpec's.
Model make_torchvision_resnet(int64_t depth, int64_t channels, int64_t classes,
                              const std::string& checkpointing = "none");

}  // namespace dtrain::models
