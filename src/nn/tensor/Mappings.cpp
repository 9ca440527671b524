// Paired autograd functions of tensor parallelism (see Mappings.h). The collectives move
// the split dimension to the front, so every rank's share is one contiguous run of a flat
// buffer, in rank order, as the Communicator's allgather and reduce_scatter lay them out.
#include "dtrain/nn/tensor/Mappings.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/tensor/Split.h"

namespace dtrain::nn::tensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool trivial(const comm::CommunicatorPtr& group) { return !group || group->size() == 1; }

struct GroupHolder : torch::CustomClassHolder {
  comm::CommunicatorPtr group;
};

void keep_group(AutogradContext* ctx, const comm::CommunicatorPtr& group, int64_t dim = 0) {
  auto holder = c10::make_intrusive<GroupHolder>();
  holder->group = group;
  ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
  ctx->saved_data["dim"] = dim;
}

comm::CommunicatorPtr group_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())
      ->group;
}

int64_t normalize(const at::Tensor& x, int64_t dim) {
  DTRAIN_CHECK(x.dim() > 0, "a tensor-parallel split needs a tensor with dimensions");
  return dim < 0 ? dim + x.dim() : dim;
}

at::Tensor allreduce_sum(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  trace::Span span("comm", "tp allreduce");
  at::Tensor out = x.contiguous().clone();
  comm::on_lane(group)->allreduce(out)->wait();
  return out;
}

at::Tensor share(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim) {
  const auto [start, length] = split_range(x.size(dim), group->size(), group->rank());
  return x.narrow(dim, start, length);
}

// Every rank's share along `dim` in rank order; `total` is the gathered size of `dim` (shares
// by split_range), or -1 when every rank holds as many as this one.
at::Tensor allgather_along(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim,
                           int64_t total) {
  trace::Span span("comm", "tp allgather");
  const at::Tensor moved = x.movedim(dim, 0).contiguous();
  const int ranks = group->size();
  if (total < 0) total = moved.size(0) * ranks;
  const int64_t inner = moved.size(0) == 0 ? 0 : moved.numel() / moved.size(0);
  std::vector<int64_t> counts;
  for (int r = 0; r < ranks; ++r) counts.push_back(split_range(total, ranks, r).second * inner);
  DTRAIN_CHECK(counts[group->rank()] == moved.numel(), "gather along dimension ", dim, " of ",
               x.sizes(), " over group '", group->name(), "': this rank's share should have ",
               split_range(total, ranks, group->rank()).second, " rows of ", total);
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] = total;
  at::Tensor output = at::empty(shape, moved.options());
  comm::AllgatherOptions options;
  options.counts = counts;
  comm::on_lane(group)->allgather(output.view({-1}), moved.view({-1}), options)->wait();
  return output.movedim(0, dim);
}

// Starts the reduce-scatter along `dim`; `output` (this rank's part, `dim` in place) holds it
// once the work is done. `scratch`: `x` may be overwritten.
comm::WorkPtr start_reduce_scatter_along(const at::Tensor& x, const comm::CommunicatorPtr& group,
                                         int64_t dim, bool scratch, at::Tensor& output) {
  DTRAIN_CHECK_INPUT(x.size(dim) % group->size() == 0, "sequence parallelism splits dimension ",
                     dim, " of ", x.sizes(), " over ", group->size(), " ranks of group '",
                     group->name(), "': it must divide evenly");
  const at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= group->size();
  at::Tensor flat = at::empty(shape, moved.options());
  output = flat.movedim(0, dim);
  comm::ReduceScatterOptions options;
  options.input_is_scratch = scratch;
  return comm::on_lane(group)->reduce_scatter(flat.view({-1}), moved.view({-1}), options);
}

at::Tensor reduce_scatter_along(const at::Tensor& x, const comm::CommunicatorPtr& group,
                                int64_t dim) {
  trace::Span span("comm", "tp reduce-scatter");
  at::Tensor output;
  start_reduce_scatter_along(x, group, dim, /*scratch=*/false, output)->wait();
  return output;
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g) {
    keep_group(ctx, g);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allreduce_sum(grads[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g) {
    return allreduce_sum(x, g);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct ScatterToGroup : torch::autograd::Function<ScatterToGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g,
                            int64_t dim) {
    keep_group(ctx, g, dim);
    ctx->saved_data["total"] = x.size(dim);
    return share(x, g, dim).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allgather_along(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt(),
                            ctx->saved_data["total"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

struct GatherFromGroup : torch::autograd::Function<GatherFromGroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g,
                            int64_t dim, int64_t total) {
    keep_group(ctx, g, dim);
    return allgather_along(x, g, dim, total);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {share(grads[0], group_of(ctx), ctx->saved_data["dim"].toInt()).contiguous(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g) {
    keep_group(ctx, g, 1);
    return allgather_along(x, g, 1, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter_along(grads[0], group_of(ctx), 1), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g) {
    keep_group(ctx, g, 1);
    return reduce_scatter_along(x, g, 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allgather_along(grads[0], group_of(ctx), 1, -1), at::Tensor()};
  }
};

// Rows of `x` to every rank and back: send_rows[j] rows to rank j, recv_rows[i] from rank i.
at::Tensor all_to_all_rows_now(const at::Tensor& x, const comm::CommunicatorPtr& group,
                               const std::vector<int64_t>& send_rows,
                               const std::vector<int64_t>& recv_rows) {
  trace::Span span("comm", "all_to_all");
  // (detached: the exchange runs on the group's thread, which must not end up holding the last
  // reference to an autograd graph, and so to the group)
  const at::Tensor in = x.detach().contiguous();
  int64_t row = 1;
  for (int64_t d = 1; d < in.dim(); ++d) row *= in.size(d);
  int64_t received = 0;
  comm::AllToAllOptions options;
  for (size_t r = 0; r < send_rows.size(); ++r) {
    options.send_counts.push_back(send_rows[r] * row);
    options.recv_counts.push_back(recv_rows[r] * row);
    received += recv_rows[r];
  }
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = received;
  at::Tensor output = at::empty(shape, in.options());
  comm::on_lane(group)->all_to_all(output, in, options)->wait();
  return output;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::CommunicatorPtr g,
                            std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
    keep_group(ctx, g);
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    return all_to_all_rows_now(x, g, send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_to_all_rows_now(grads[0], group_of(ctx), ctx->saved_data["recv"].toIntVector(),
                                ctx->saved_data["send"].toIntVector()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Megatron's LinearWithGradAccumulationAndAsyncCommunication, for a column-parallel layer. (An
// autograd function takes no undefined tensors: without a bias, ColumnParallelLinearNoBias.)
struct ColumnParallelLinearFn : torch::autograd::Function<ColumnParallelLinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, comm::CommunicatorPtr g,
                            bool sequence_parallel) {
    keep_group(ctx, g, 1);
    ctx->saved_data["sequence_parallel"] = sequence_parallel;
    ctx->saved_data["bias"] = bias.defined();
    if (bias.defined()) ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    const at::Tensor total = sequence_parallel ? allgather_along(x, g, 1, -1) : x;
    // (Autocast casts here as it does for at::linear; the matmuls of backward follow the
    // output gradient's dtype.)
    ctx->save_for_backward({total, weight});
    return at::linear(
        total, weight,
        bias.defined() ? c10::optional<at::Tensor>(bias) : c10::optional<at::Tensor>());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &total = saved[0], &weight = saved[1];
    const comm::CommunicatorPtr group = group_of(ctx);
    const bool sequence_parallel = ctx->saved_data["sequence_parallel"].toBool();
    const at::Tensor dy = grads[0].contiguous();
    const auto dtype = dy.scalar_type();
    const int64_t out = weight.size(0), in = weight.size(1);
    at::Tensor dx;
    comm::WorkPtr reduction;
    if (ctx->needs_input_grad(0)) {
      at::Tensor dtotal = dy.matmul(weight.to(dtype));
      // The input gradient's collective runs on the group's thread while dW is computed here.
      if (sequence_parallel) {
        reduction = start_reduce_scatter_along(dtotal, group, 1, /*scratch=*/true, dx);
      } else {
        dx = dtotal.contiguous();
        reduction = comm::on_lane(group)->allreduce(dx);
      }
    }
    at::Tensor dweight, dbias;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor dy2 = dy.reshape({-1, out});
      dweight = dy2.t().mm(total.to(dtype).reshape({-1, in})).to(weight.scalar_type());
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      dbias = dy.reshape({-1, out}).sum(0).to(
          static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    }
    if (reduction) {
      trace::Span span("comm", sequence_parallel ? "tp reduce-scatter (overlapped, waited)"
                                                 : "tp allreduce (overlapped, waited)");
      reduction->wait();
    }
    return {dx, dweight, dbias, at::Tensor(), at::Tensor()};
  }
};

struct ColumnParallelLinearNoBias : torch::autograd::Function<ColumnParallelLinearNoBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            comm::CommunicatorPtr g, bool sequence_parallel) {
    return ColumnParallelLinearFn::forward(ctx, x, weight, at::Tensor(), std::move(g),
                                           sequence_parallel);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto all = ColumnParallelLinearFn::backward(ctx, std::move(grads));
    return {all[0], all[1], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, const comm::CommunicatorPtr& group,
                                  bool sequence_parallel) {
  if (trivial(group)) return at::linear(x, weight, bias);
  return bias.defined() ? ColumnParallelLinearFn::apply(x, weight, bias, group, sequence_parallel)
                        : ColumnParallelLinearNoBias::apply(x, weight, group, sequence_parallel);
}

at::Tensor copy_to_group(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return trivial(group) ? x : CopyToGroup::apply(x, group);
}

at::Tensor reduce_from_group(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return trivial(group) ? x : ReduceFromGroup::apply(x, group);
}

at::Tensor scatter_to_group(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim) {
  return trivial(group) ? x : ScatterToGroup::apply(x, group, normalize(x, dim));
}

at::Tensor gather_from_group(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim,
                             int64_t total) {
  return trivial(group) ? x : GatherFromGroup::apply(x, group, normalize(x, dim), total);
}

at::Tensor gather_from_sequence(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return trivial(group) ? x : GatherFromSequence::apply(x, group);
}

at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return trivial(group) ? x : ReduceScatterToSequence::apply(x, group);
}

at::Tensor all_to_all_rows(const at::Tensor& x, const comm::CommunicatorPtr& group,
                           const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows) {
  if (trivial(group)) return x;
  DTRAIN_CHECK(static_cast<int>(send_rows.size()) == group->size() &&
                   static_cast<int>(recv_rows.size()) == group->size(),
               "all_to_all_rows over group '", group->name(), "': ", send_rows.size(), " and ",
               recv_rows.size(), " row counts for ", group->size(), " ranks");
  return AllToAllRows::apply(x, group, send_rows, recv_rows);
}

}  // namespace dtrain::nn::tensor
