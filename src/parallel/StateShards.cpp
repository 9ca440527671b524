// Sharded checkpoint files: pieces of parameters and their optimizer state, re-joined at load
// for whatever pieces the loading strategy and world size need.
#include "dtrain/parallel/StateShards.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <regex>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/optim/StateSize.h"

namespace fs = std::filesystem;

namespace dtrain::parallel {

namespace {

// `t` flattened (scalars stay 0-dim), owning exactly its elements: pickling a view would
// write its whole storage.
// What a state file holds of `t`: its elements alone, flat, on the CPU (a checkpoint made on a
// GPU resumes anywhere).
at::Tensor compact(const at::Tensor& t) {
  const at::Tensor flat = (t.dim() == 0 ? t.detach() : t.detach().reshape({-1})).cpu();
  const bool exact =
      flat.is_contiguous() && flat.storage_offset() == 0 &&
      flat.storage().nbytes() == static_cast<size_t>(flat.numel() * flat.element_size());
  return exact ? flat : flat.clone();
}

// The number of files M of directory's state-R-of-M.pt set, checking that all are present.
int count_state_files(const std::string& directory) {
  static const std::regex pattern(R"(state-(\d+)-of-(\d+)\.pt)");
  int ranks = 0;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, pattern)) continue;
    const int m = std::stoi(match[2].str());
    DTRAIN_CHECK_INPUT(ranks == 0 || ranks == m, "checkpoint ", directory, " mixes state files of ",
                       ranks, " and ", m, " ranks");
    ranks = m;
  }
  DTRAIN_CHECK_INPUT(!error, "cannot list checkpoint ", directory, ": ", error.message());
  DTRAIN_CHECK_INPUT(ranks > 0, "checkpoint ", directory, " has no state-R-of-N.pt files");
  for (int r = 0; r < ranks; ++r) {
    DTRAIN_CHECK_INPUT(fs::exists(state_file(directory, r, ranks)), "checkpoint ", directory,
                       " is incomplete: ", state_file(directory, r, ranks), " is missing");
  }
  return ranks;
}

c10::impl::GenericDict load_file(const std::string& path) {
  // (No format check: the pieces are what a state file must hold.)
  c10::impl::GenericDict file = load_pickled_dict(path, "dtrain state file");
  DTRAIN_CHECK_INPUT(file.contains("pieces"), path, " is not a dtrain state file (no 'pieces')");
  return file;
}

// Positions in the full tensor (flattened) of elements [offset, offset + numel) of a block
// [start, start + length) along `dim` of a tensor of `shape` (dim < 0: the whole tensor).
// Increasing, as a block of a row-major tensor is visited in order.
at::Tensor full_positions(const std::vector<int64_t>& shape, int64_t dim, int64_t start,
                          int64_t length, int64_t offset, int64_t numel) {
  const auto options = at::TensorOptions().dtype(at::kLong);
  if (dim < 0) return at::arange(offset, offset + numel, options);
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= shape[d];
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const at::Tensor positions =
      (at::arange(outer, options) * (shape[dim] * inner)).view({outer, 1, 1}) +
      ((at::arange(length, options) + start) * inner).view({1, length, 1}) +
      at::arange(inner, options).view({1, 1, inner});
  return positions.view({-1}).narrow(0, offset, numel);
}

// Which elements a stored piece gives a wanted piece: a run [lo, hi) when both count elements
// of the same block, else matching position lists (into the wanted piece, into the stored one).
struct Transfer {
  int64_t lo = 0, hi = 0;
  at::Tensor into_want, from_have;
  int64_t count() const {
    return into_want.defined() ? into_want.numel() : std::max<int64_t>(0, hi - lo);
  }
};

}  // namespace

std::vector<PieceRef> with_splits(std::vector<PieceRef> pieces,
                                  const nn::tensor::ParameterSplits& splits, bool keep_replicated) {
  std::vector<PieceRef> out;
  for (auto& piece : pieces) {
    const auto it = splits.find(piece.name);
    if (it == splits.end()) {
      if (keep_replicated) out.push_back(std::move(piece));
      continue;
    }
    piece.shape = it->second.full_shape;
    piece.split_dim = it->second.dim;
    piece.split_start = it->second.start;
    piece.split_length = it->second.length;
    out.push_back(std::move(piece));
  }
  return out;
}

std::vector<PieceRef> whole_pieces(const std::vector<std::string>& names,
                                   const std::vector<at::Tensor>& parameters) {
  std::vector<PieceRef> pieces;
  for (size_t k = 0; k < parameters.size(); ++k) {
    pieces.push_back({names[k], 0, parameters[k], parameters[k].sizes().vec()});
  }
  return pieces;
}

std::string state_file(const std::string& directory, int rank, int ranks) {
  return concat(directory, "/state-", rank, "-of-", ranks, ".pt");
}

void write_state_shard(const std::string& directory, int rank, int ranks,
                       const std::vector<PieceRef>& pieces,
                       const torch::optim::Optimizer* optimizer, const NamedTensors& buffers) {
  torch::NoGradGuard no_grad;
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& piece : pieces) {
    c10::Dict<std::string, at::Tensor> tensors;
    tensors.insert("param", compact(piece.tensor));
    if (optimizer) {
      for (const auto& [key, value] : optim::get_param_state(*optimizer, piece.tensor)) {
        tensors.insert(key, compact(value));
      }
    }
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("name", piece.name);
    entry.insert("offset", piece.offset);
    entry.insert("shape", c10::List<int64_t>(piece.shape));
    if (piece.split_dim >= 0) {
      entry.insert("split",
                   c10::List<int64_t>({piece.split_dim, piece.split_start, piece.split_length}));
    }
    entry.insert("tensors", tensors);
    list.push_back(entry);
  }
  c10::Dict<std::string, at::Tensor> buffer_dict;
  for (const auto& [name, tensor] : buffers) {
    buffer_dict.insert(name, compact(tensor).view(tensor.sizes()));
  }
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  file.insert("format", "dtrain-state-1");
  file.insert("pieces", list);
  file.insert("buffers", buffer_dict);
  save_pickled_dict(state_file(directory, rank, ranks), file);
}

void read_state_shards(const std::string& directory, const std::vector<PieceRef>& values,
                       torch::optim::Optimizer* optimizer, const std::vector<PieceRef>& states,
                       const NamedTensors* buffers) {
  torch::NoGradGuard no_grad;
  const int ranks = count_state_files(directory);
  std::multimap<std::string, size_t> value_index, state_index;
  for (size_t i = 0; i < values.size(); ++i) value_index.emplace(values[i].name, i);
  if (optimizer) {
    for (size_t i = 0; i < states.size(); ++i) state_index.emplace(states[i].name, i);
  }
  std::vector<int64_t> value_covered(values.size(), 0), state_covered(states.size(), 0);
  std::vector<optim::ParamState> assembled(states.size());
  std::vector<bool> buffer_found(buffers ? buffers->size() : 0, false);

  for (int r = 0; r < ranks; ++r) {
    const std::string path = state_file(directory, r, ranks);
    const auto file = load_file(path);
    try {
      for (const auto& item : file.at("pieces").toList()) {
        const auto entry = item.get().toGenericDict();
        const std::string name = entry.at("name").toStringRef();
        const int64_t offset = entry.at("offset").toInt();
        const auto tensors = entry.at("tensors").toGenericDict();
        const at::Tensor param = tensors.at("param").toTensor();
        const int64_t numel = param.numel();
        const std::vector<int64_t> shape = entry.at("shape").toIntVector();
        int64_t split_dim = -1, split_start = 0, split_length = 0;
        if (entry.contains("split")) {
          const std::vector<int64_t> split = entry.at("split").toIntVector();
          DTRAIN_CHECK_INPUT(
              split.size() == 3 && split[0] >= 0 && split[0] < static_cast<int64_t>(shape.size()),
              path, ": piece of '", name, "' has a malformed split");
          split_dim = split[0], split_start = split[1], split_length = split[2];
        }
        auto check_shape = [&](const PieceRef& want) {
          DTRAIN_CHECK_INPUT(want.shape.empty() || want.shape == shape, "checkpoint ", directory,
                             " does not match the model: '", name, "' has shape ",
                             c10::IntArrayRef(shape), " there and ", c10::IntArrayRef(want.shape),
                             " in the model (", path, ")");
        };
        // The elements this piece has of `want`.
        auto overlap = [&](const PieceRef& want) {
          check_shape(want);
          Transfer transfer;
          const bool same_block =
              want.split_dim == split_dim && (split_dim < 0 || (want.split_start == split_start &&
                                                                want.split_length == split_length));
          // Blocks of the same dimension that do not meet (another tensor-parallel rank's, as
          // every file but a rank's own has when the layout is the same): nothing, without the
          // positions of every element.
          const bool apart = split_dim >= 0 && want.split_dim == split_dim &&
                             (want.split_start + want.split_length <= split_start ||
                              split_start + split_length <= want.split_start);
          if (apart) return transfer;
          if (same_block) {
            transfer.lo = std::max(offset, want.offset);
            transfer.hi = std::min(offset + numel, want.offset + want.tensor.numel());
            return transfer;
          }
          const at::Tensor wanted =
              full_positions(shape, want.split_dim, want.split_start, want.split_length,
                             want.offset, want.tensor.numel());
          const at::Tensor have =
              full_positions(shape, split_dim, split_start, split_length, offset, numel);
          if (have.numel() == 0 || wanted.numel() == 0) return transfer;
          const at::Tensor where = at::searchsorted(have, wanted).clamp_max(have.numel() - 1);
          const at::Tensor found = have.index_select(0, where).eq(wanted).nonzero().view({-1});
          transfer.into_want = found;
          transfer.from_have = where.index_select(0, found);
          return transfer;
        };
        // Copies what `transfer` names of this piece's `from` into `target` (a run starting at
        // element `base`), cast to the target's dtype (a float64 checkpoint read by a float32
        // model, as the contiguous path's copy_ does).
        auto copy = [&](const Transfer& t, const at::Tensor& from, const at::Tensor& target,
                        int64_t base) {
          if (t.into_want.defined()) {
            target.view({-1}).index_copy_(
                0, t.into_want, from.index_select(0, t.from_have).to(target.scalar_type()));
          } else if (t.lo < t.hi) {
            target.view({-1})
                .narrow(0, t.lo - base, t.hi - t.lo)
                .copy_(from.narrow(0, t.lo - offset, t.hi - t.lo));
          }
        };
        auto range = value_index.equal_range(name);
        for (auto it = range.first; it != range.second; ++it) {
          const PieceRef& want = values[it->second];
          const Transfer transfer = overlap(want);
          if (transfer.count() == 0) continue;
          copy(transfer, param, want.tensor, want.offset);
          value_covered[it->second] += transfer.count();
        }
        // Copied where it goes: its pages of the file leave this process's memory (below, each
        // state's too), so reading a checkpoint holds one tensor of it at a time beside what the
        // rank keeps.
        release_file_pages(param);
        range = state_index.equal_range(name);
        for (auto it = range.first; it != range.second; ++it) {
          const PieceRef& want = states[it->second];
          const Transfer transfer = overlap(want);
          if (transfer.count() == 0) continue;
          auto& state = assembled[it->second];
          for (const auto& kv : tensors) {
            const std::string key = kv.key().toStringRef();
            if (key == "param") continue;
            const at::Tensor t = kv.value().toTensor();
            if (t.dim() == 0) {  // a scalar such as Adam's step (a copy: not the file's)
              state[key] = t.to(want.tensor.device(), /*non_blocking=*/false, /*copy=*/true);
              continue;
            }
            DTRAIN_CHECK_INPUT(t.numel() == numel, path, ": state '", key, "' of '", name, "' has ",
                               t.numel(), " elements, its piece ", numel);
            auto slot = state.find(key);
            if (slot == state.end()) {
              slot = state
                         .emplace(key, at::zeros({want.tensor.numel()},
                                                 t.options().device(want.tensor.device())))
                         .first;
            }
            copy(transfer, t, slot->second, want.offset);
            release_file_pages(t);
          }
          state_covered[it->second] += transfer.count();
        }
        for (const auto& kv : tensors) release_file_pages(kv.value().toTensor());
      }
      if (buffers) {
        const auto saved = file.at("buffers").toGenericDict();
        for (size_t i = 0; i < buffers->size(); ++i) {
          const auto& [name, target] = (*buffers)[i];
          if (!saved.contains(name)) continue;
          const at::Tensor value = saved.at(name).toTensor();
          DTRAIN_CHECK_INPUT(value.sizes() == target.sizes(), path, ": buffer '", name,
                             "' has shape ", value.sizes(), ", the model's ", target.sizes());
          target.copy_(value);
          buffer_found[i] = true;
        }
      }
    } catch (const c10::Error& e) {
      DTRAIN_THROW(InputError, path, " is malformed: ", e.what_without_backtrace());
    }
  }
  for (size_t i = 0; i < values.size(); ++i) {
    DTRAIN_CHECK_INPUT(value_covered[i] == values[i].tensor.numel(), "checkpoint ", directory,
                       " covers ", value_covered[i], " of elements [", values[i].offset, ", ",
                       values[i].offset + values[i].tensor.numel(), ") of '", values[i].name,
                       "' (a different model?)");
  }
  for (size_t i = 0; optimizer && i < states.size(); ++i) {
    const bool has_state = !assembled[i].empty();
    DTRAIN_CHECK_INPUT(!has_state || state_covered[i] == states[i].tensor.numel(), "checkpoint ",
                       directory, " has optimizer state for only ", state_covered[i],
                       " of elements [", states[i].offset, ", ",
                       states[i].offset + states[i].tensor.numel(), ") of '", states[i].name, "'");
    // Adopted, not copied: the optimizer's state is what was assembled (a copy would hold
    // the state twice).
    optim::adopt_param_state(*optimizer, states[i].tensor, std::move(assembled[i]));
  }
  for (size_t i = 0; i < buffer_found.size(); ++i) {
    DTRAIN_CHECK_INPUT(buffer_found[i], "checkpoint ", directory, " lacks buffer '",
                       (*buffers)[i].first, "'");
  }
}

}  // namespace dtrain::parallel
