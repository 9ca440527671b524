#include "dtrain/comm/Compression.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

bool all_finite(const at::Tensor& t) {
  return t.numel() == 0 || std::isfinite(t.sum(at::kDouble).item<double>());
}

CompressionSpec parse_compression(const std::string& text, const std::string& flag) {
  CompressionSpec spec;
  if (text == "none") return spec;
  if (text == "q8") {
    spec.kind = CompressionSpec::Quant8;
    return spec;
  }
  if (text.rfind("topk:", 0) == 0) {
    const std::string number = text.substr(5);
    char* end = nullptr;
    const double fraction = std::strtod(number.c_str(), &end);
    DTRAIN_CHECK_INPUT(
        !number.empty() && end != nullptr && *end == '\0' && fraction > 0 && fraction <= 1, flag,
        " '", text, "': topk takes a fraction in (0, 1], e.g. topk:0.01");
    spec.kind = CompressionSpec::TopK;
    spec.fraction = fraction;
    return spec;
  }
  DTRAIN_THROW(InputError, flag, " '", text, "': expected none, q8 or topk:FRACTION");
}

std::string to_string(const CompressionSpec& spec) {
  switch (spec.kind) {
    case CompressionSpec::Quant8:
      return "q8";
    case CompressionSpec::TopK:
      return concat("topk:", spec.fraction, spec.error_feedback ? "" : " (no error feedback)");
    case CompressionSpec::None:
      break;
  }
  return "none";
}

int64_t EncodedUpdate::payload_bytes() const {
  int64_t bytes = 0;
  for (const auto& part : parts) bytes += static_cast<int64_t>(part.second.nbytes());
  return bytes;
}

EncodedUpdate encode_update(const at::Tensor& delta, const CompressionSpec& spec,
                            at::Tensor* residual, uint64_t seed) {
  DTRAIN_CHECK(
      delta.dim() == 1 && (delta.scalar_type() == at::kFloat || delta.scalar_type() == at::kDouble),
      "an update must be a flat float32 or float64 tensor");
  EncodedUpdate out;
  const int64_t n = delta.numel();
  switch (spec.kind) {
    case CompressionSpec::None:
      out.encoding = "none";
      out.parts.emplace_back("delta", delta.contiguous());
      return out;
    case CompressionSpec::Quant8: {
      out.encoding = "q8";
      // Per block: lo = min, step = (max - min) / 255; q = floor((x - lo) / step + u), u
      // uniform in [0, 1): E[lo + q step] = x.
      const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
      const at::Tensor padded =
          at::cat({delta.to(at::kDouble), at::zeros({blocks * kQuantBlock - n}, at::kDouble)})
              .view({blocks, kQuantBlock});
      // Padding must not widen a block's range: the last block's padding copies its first value.
      if (blocks * kQuantBlock > n) {
        padded[blocks - 1]
            .slice(0, n - (blocks - 1) * kQuantBlock)
            .fill_(delta[(blocks - 1) * kQuantBlock].item<double>());
      }
      const at::Tensor lo = std::get<0>(padded.min(1)).to(at::kFloat);
      const at::Tensor hi = std::get<0>(padded.max(1));
      // The step rounded to float32 up, so lo + 255 step covers the block.
      at::Tensor step = ((hi - lo.to(at::kDouble)) / 255.0).to(at::kFloat);
      step = at::where(step.to(at::kDouble) * 255.0 + lo.to(at::kDouble) < hi,
                       at::nextafter(step, at::full_like(step, INFINITY)), step);
      at::Generator generator = at::detail::createCPUGenerator(seed);
      const at::Tensor safe = step.to(at::kDouble).clamp_min(1e-300).unsqueeze(1);
      const at::Tensor scaled = (padded - lo.to(at::kDouble).unsqueeze(1)) / safe;
      const at::Tensor noise = at::rand({blocks, kQuantBlock}, generator, at::kDouble);
      const at::Tensor q = at::floor(scaled + noise)
                               .clamp(0, 255)
                               .where(step.unsqueeze(1) > 0, at::zeros({1}, at::kDouble));
      out.parts.emplace_back("q", q.reshape({-1}).slice(0, 0, n).to(at::kByte).contiguous());
      out.parts.emplace_back("lo", lo.contiguous());
      out.parts.emplace_back("step", step.contiguous());
      return out;
    }
    case CompressionSpec::TopK: {
      out.encoding = "topk";
      at::Tensor acc = delta;
      if (spec.error_feedback && residual != nullptr && residual->defined()) {
        DTRAIN_CHECK(residual->sizes() == delta.sizes(), "an error-feedback residual of ",
                     residual->numel(), " elements for an update of ", n);
        acc = delta + residual->to(delta.scalar_type());
      }
      const auto k = std::min<int64_t>(
          n, std::max<int64_t>(
                 1, static_cast<int64_t>(std::ceil(spec.fraction * static_cast<double>(n)))));
      const at::Tensor chosen = std::get<1>(acc.abs().topk(k, 0, true, false));
      const at::Tensor indices = std::get<0>(chosen.sort());
      const at::Tensor values = acc.index_select(0, indices);
      out.parts.emplace_back(
          "indices", n <= std::numeric_limits<int32_t>::max() ? indices.to(at::kInt) : indices);
      out.parts.emplace_back("values", values.contiguous());
      if (spec.error_feedback && residual != nullptr) {
        at::Tensor left = acc.clone();
        left.index_fill_(0, indices, 0.0);
        *residual = left;
      }
      return out;
    }
  }
  return out;
}

namespace {

const at::Tensor* part(const EncodedUpdate& encoded, const std::string& name) {
  for (const auto& p : encoded.parts) {
    if (p.first == name) return &p.second;
  }
  return nullptr;
}

// "" when `encoded` has exactly `names`, each 1-D of the given dtype (kUndefined: float32 or
// float64) and, when `numel` >= 0, that size.
std::string check_parts(
    const EncodedUpdate& encoded,
    const std::vector<std::tuple<std::string, at::ScalarType, int64_t>>& names) {
  if (encoded.parts.size() != names.size()) {
    return concat("a ", encoded.encoding, " update has ", encoded.parts.size(), " parts, not ",
                  names.size());
  }
  for (const auto& [name, dtype, numel] : names) {
    const at::Tensor* t = part(encoded, name);
    if (t == nullptr)
      return concat("a ", encoded.encoding, " update without its '", name, "' part");
    const bool dtype_ok = dtype == at::ScalarType::Undefined
                              ? t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble
                              : t->scalar_type() == dtype;
    if (!dtype_ok || t->dim() != 1) {
      return concat("part '", name, "' is ", t->dim(), "-D ", t->scalar_type(), " (expected 1-D ",
                    dtype == at::ScalarType::Undefined ? "float32 or float64"
                                                       : std::string(c10::toString(dtype)),
                    ")");
    }
    if (numel >= 0 && t->numel() != numel) {
      return concat("part '", name, "' holds ", t->numel(), " elements, expected ", numel);
    }
  }
  return "";
}

std::string check_finite(const at::Tensor& t, const std::string& name) {
  if (!all_finite(t)) {
    return concat("part '", name, "' holds NaN or Inf values");
  }
  return "";
}

}  // namespace

std::string decode_update(const EncodedUpdate& encoded, int64_t numel, at::ScalarType dtype,
                          at::Tensor* out) {
  std::string why;
  if (encoded.encoding == "none") {
    why = check_parts(encoded, {{"delta", at::ScalarType::Undefined, numel}});
    if (why.empty()) why = check_finite(*part(encoded, "delta"), "delta");
    if (!why.empty()) return why;
    *out = part(encoded, "delta")->to(dtype);
    return "";
  }
  if (encoded.encoding == "q8") {
    const int64_t blocks = (numel + kQuantBlock - 1) / kQuantBlock;
    why = check_parts(
        encoded,
        {{"q", at::kByte, numel}, {"lo", at::kFloat, blocks}, {"step", at::kFloat, blocks}});
    const at::Tensor* lo = part(encoded, "lo");
    const at::Tensor* step = part(encoded, "step");
    if (why.empty()) why = check_finite(*lo, "lo");
    if (why.empty()) why = check_finite(*step, "step");
    if (why.empty() && blocks > 0 && step->min().item<float>() < 0) {
      why = "part 'step' holds a negative step";
    }
    if (!why.empty()) return why;
    const at::Tensor q = part(encoded, "q")->to(at::kDouble);
    const at::Tensor index = at::arange(numel, at::kLong).div(kQuantBlock, "floor");
    *out = (lo->to(at::kDouble).index_select(0, index) +
            q * step->to(at::kDouble).index_select(0, index))
               .to(dtype);
    return "";
  }
  if (encoded.encoding == "topk") {
    const at::Tensor* indices = part(encoded, "indices");
    const at::Tensor* values = part(encoded, "values");
    if (indices == nullptr || values == nullptr) {
      return "a topk update needs its 'indices' and 'values' parts";
    }
    why = check_parts(encoded,
                      {{"indices", indices->scalar_type() == at::kLong ? at::kLong : at::kInt, -1},
                       {"values", at::ScalarType::Undefined, indices->numel()}});
    if (why.empty() && (indices->numel() < 1 || indices->numel() > numel)) {
      why = concat("part 'indices' holds ", indices->numel(), " elements (1 to ", numel, ")");
    }
    if (why.empty()) why = check_finite(*values, "values");
    if (!why.empty()) return why;
    const at::Tensor idx = indices->to(at::kLong);
    if (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= numel) {
      return concat("part 'indices' holds an index outside [0, ", numel, ")");
    }
    if (idx.numel() > 1 && !(idx.slice(0, 1) > idx.slice(0, 0, -1)).all().item<bool>()) {
      return "part 'indices' is not strictly increasing";
    }
    *out = at::zeros({numel}, dtype);
    out->index_copy_(0, idx, values->to(dtype));
    return "";
  }
  return concat("unknown encoding '", encoded.encoding, "' (none, q8 or topk)");
}

void fit_within_norm(EncodedUpdate* encoded, int64_t numel, at::ScalarType dtype, double max_norm,
                     at::Tensor* residual) {
  DTRAIN_CHECK(max_norm > 0, "fit_within_norm: a norm bound of ", max_norm);
  // A few tries: each scale is exact up to float32 rounding of the scaled parts, so one
  // almost always does; the margin keeps the rounded result below the bound.
  for (int attempt = 0; attempt < 4; ++attempt) {
    at::Tensor dense;
    const std::string why = decode_update(*encoded, numel, dtype, &dense);
    DTRAIN_CHECK(why.empty(), "fit_within_norm: ", why);
    const double norm = dense.to(at::kDouble).norm().item<double>();
    if (norm <= max_norm) return;
    const double scale = max_norm / norm * (1.0 - 1e-6);
    for (auto& [name, tensor] : encoded->parts) {
      if (name == "lo" || name == "step" || name == "delta") {
        tensor = tensor * scale;
      } else if (name == "values") {
        const at::Tensor scaled = tensor * scale;
        if (residual != nullptr && residual->defined()) {
          const at::Tensor* indices = part(*encoded, "indices");
          residual->index_add_(0, indices->to(at::kLong),
                               (tensor - scaled).to(residual->scalar_type()));
        }
        tensor = scaled;
      }
    }
  }
  DTRAIN_CHECK(false, "fit_within_norm: the ", encoded->encoding,
               " update still exceeds the L2 norm ", max_norm, " after scaling");
}

}  // namespace dtrain::comm
