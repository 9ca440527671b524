// Reader for the IDX format of (Fashion-)MNIST, raw or gzip-compressed. Every header field and
// length is checked: a bad file gives an InputError naming the file and what is wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dtrain::data {

/// Reads an IDX file of unsigned bytes (type code 0x08) into a uint8 tensor of its dimensions.
/// `expected_dims` (1 for labels, 3 for images) is checked against the header.
at::Tensor read_idx(const std::string& path, int expected_dims);

}  // namespace dtrain::data
