// Initial values that any rank can draw in part: a parameter's values are a function of a seed,
// the parameter's name and each element's index in the full tensor, nothing else (a counter-based
// stream: SplitMix64 of the key and the index; normal values by Box-Muller). So a rank that keeps
// a ZeRO-3 shard, a tensor-parallel slice or a pipeline stage draws only those elements, in any
// order, and every layout starts from the same model as one process with the same seed.
//
// A model built under an InitScope gets placeholder parameters (their shapes, no memory) and a
// DeferredInit that knows each one's rule: the strategy that shards them draws its parts
// (fill), any other materializes them whole (materialize_all).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/tensor/Split.h"

namespace torch::nn {
class Module;
}

namespace dtrain::nn {

/// How a parameter's elements are drawn.
struct InitRule {
  enum class Kind { kNormal, kUniform, kConstant };
  Kind kind = Kind::kConstant;
  /// normal: mean and standard deviation; uniform: the bounds [a, b); constant: a.
  double a = 0.0;
  double b = 0.0;
  static InitRule normal(double std) { return {Kind::kNormal, 0.0, std}; }
  static InitRule uniform(double bound) { return {Kind::kUniform, -bound, bound}; }
  static InitRule constant(double value) { return {Kind::kConstant, value, 0.0}; }
};

/// A parameter's key: the seed and its full name (as in Module::named_parameters) mixed.
uint64_t parameter_key(uint64_t seed, const std::string& name);

/// Writes into `out` (contiguous, any dtype and device) the elements [begin, begin + numel) of a
/// parameter's local values in row-major order: the local tensor is `split`'s range of the full
/// one (or the full one when `split` is null), and element values depend only on `key` and their
/// index in the full tensor. Values are rounded to float32 first, as a parameter built in float32
/// and converted would be.
void fill_keyed(at::Tensor out, const InitRule& rule, uint64_t key,
                const std::vector<int64_t>& local_shape, const tensor::ParameterSplit* split,
                int64_t begin);

/// The parameters of one model whose values are drawn from their keys.
class DeferredInit {
 public:
  explicit DeferredInit(uint64_t seed) : seed_(seed) {}

  /// Records how `parameter` (made by new_parameter, not yet named) is drawn.
  void record(const at::Tensor& parameter, InitRule rule);
  /// Names the recorded parameters from the finished module and its tensor-parallel splits.
  void bind(const torch::nn::Module& root);

  /// Whether the parameters are still placeholders (no memory).
  bool pending() const { return pending_; }
  /// The bound parameter of that name (as in named_parameters) is drawn from its key.
  bool has(const std::string& name) const { return by_name_.count(name) > 0; }
  /// Elements [begin, begin + out.numel()) of that parameter's local values, into `out`.
  void fill(const std::string& name, int64_t begin, at::Tensor out) const;
  /// Gives every placeholder its memory and its values (on the placeholders' device and dtype);
  /// with `draw` false only its memory (for values about to be overwritten).
  void materialize_all(bool draw = true);
  /// Gives these parameters of the model (placeholders or not) their memory and values; the
  /// others stay placeholders (a pipeline rank's stages: it builds only what it keeps).
  void materialize(const std::vector<at::Tensor>& parameters);
  /// Placeholders of this device and dtype from now on (still no memory; parameters that have
  /// their values are left as they are).
  void to(const at::TensorOptions& options);
  /// The largest parameter's elements (what materializing one at a time holds at most).
  int64_t largest_numel() const;
  /// Where materialize() and materialize_all() take whole parameters' values from instead of
  /// the seed: `source(name, out)` fills that parameter's local values (a weights file: a
  /// pipeline rank started from one reads only the stages it builds). fill() still draws.
  using Source = std::function<void(const std::string& name, at::Tensor out)>;
  void set_source(Source source) { source_ = std::move(source); }

 private:
  struct Entry {
    at::Tensor parameter;
    InitRule rule;
    uint64_t key = 0;
    bool split = false;
    tensor::ParameterSplit range;
  };
  uint64_t seed_;
  bool pending_ = true;
  std::map<const void*, InitRule> rules_;  // TensorImpl -> rule, until bind()
  std::vector<Entry> entries_;
  std::map<std::string, size_t> by_name_;
  Source source_;

  /// A whole parameter's local values: from the source when there is one, else drawn.
  void values_into(const std::string& name, const at::Tensor& out) const;
};

/// While alive, parameters made by new_parameter on this thread are placeholders recorded in
/// `init` (layers built inside it: the tensor-parallel layers, the decoder's).
class InitScope {
 public:
  explicit InitScope(DeferredInit& init);
  ~InitScope();
  InitScope(const InitScope&) = delete;
  InitScope& operator=(const InitScope&) = delete;

 private:
  DeferredInit* previous_;
};

/// The DeferredInit of the innermost InitScope on this thread (nullptr: none).
DeferredInit* current_init();

/// A parameter of `shape` (float32, CPU) drawn by `rule`: a placeholder of that shape recorded
/// in the current InitScope's DeferredInit (an Error outside one).
at::Tensor new_parameter(const std::vector<int64_t>& shape, const InitRule& rule);

/// A tensor of `shape` and `options` without memory (its storage empty), for parameters that
/// are given memory later.
at::Tensor placeholder(const std::vector<int64_t>& shape, const at::TensorOptions& options);

/// Whether `t` is a placeholder: elements but no memory.
bool is_placeholder(const at::Tensor& t);

/// Module::to for a model whose parameters may be placeholders: those stay without memory (of
/// the new device and dtype), the other parameters and the buffers are converted (a dtype only
/// where they are floating point, as Module::to does).
void module_to(torch::nn::Module& module, const at::TensorOptions& options);

}  // namespace dtrain::nn
