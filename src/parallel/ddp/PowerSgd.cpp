// PowerSGD for one bucket of the Reducer (see PowerSgd.h).
#include "parallel/ddp/PowerSgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdlib>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ddp {

namespace {

bool parse_count(const std::string& text, int64_t min, int64_t& out) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end == nullptr || *end != '\0' || value < min) return false;
  out = value;
  return true;
}

}  // namespace

PowerSgdOptions parse_powersgd(const std::string& text, const std::string& flag) {
  PowerSgdOptions options;
  const std::string prefix = "powersgd:";
  std::vector<std::string> fields;
  if (text.rfind(prefix, 0) == 0) {
    std::string rest = text.substr(prefix.size()) + ":";
    for (auto colon = rest.find(':'); colon != std::string::npos; colon = rest.find(':')) {
      fields.push_back(rest.substr(0, colon));
      rest.erase(0, colon + 1);
    }
  }
  bool ok = !fields.empty() && fields.size() <= 4 && parse_count(fields[0], 1, options.rank) &&
            (fields.size() < 2 || parse_count(fields[1], 0, options.start_step));
  if (ok && fields.size() >= 3) {
    char* end = nullptr;
    options.min_compression_rate = std::strtod(fields[2].c_str(), &end);
    ok = !fields[2].empty() && *end == '\0' && options.min_compression_rate >= 0;
  }
  if (ok && fields.size() == 4) {
    ok = fields[3] == "fp16" || fields[3] == "bf16";
    options.wire_dtype = fields[3] == "fp16" ? at::kHalf : at::kBFloat16;
  }
  DTRAIN_CHECK_INPUT(ok, flag, " '", text,
                     "': expected powersgd:RANK[:START_STEP[:MIN_RATE[:WIRE]]] (RANK >= 1; exact "
                     "allreduce for START_STEP steps; matrices compressed where that saves at "
                     "least MIN_RATE x, default 2; WIRE fp16 or bf16 sends the factors in 16 "
                     "bits), e.g. powersgd:4, powersgd:4:100 or powersgd:16:100:2:fp16");
  return options;
}

PowerSgdBucket::PowerSgdBucket(const at::Tensor& flat,
                               const std::vector<std::vector<int64_t>>& shapes,
                               const std::vector<int64_t>& offsets, const PowerSgdOptions& options,
                               int64_t bucket_index) {
  DTRAIN_CHECK(options.rank >= 1, "PowerSGD needs a rank >= 1");
  DTRAIN_CHECK_EQ(shapes.size(), offsets.size(), "one offset per gradient");
  struct Layout {
    int64_t offset, rows, cols, rank;
  };
  std::vector<Layout> compressed;
  std::vector<std::pair<int64_t, int64_t>> plain;  // offset, numel
  int64_t p_numel = 0, q_numel = 0, error_numel = 0, plain_numel = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : shapes[i]) numel *= d;
    const int64_t rows = shapes[i].empty() ? 1 : shapes[i][0];
    const int64_t cols = rows == 0 ? 0 : numel / rows;
    const int64_t r = std::min({options.rank, rows, cols});
    const bool worth = shapes[i].size() >= 2 && r > 0 &&
                       static_cast<double>(rows) * cols >=
                           options.min_compression_rate * static_cast<double>(r) * (rows + cols);
    if (worth) {
      compressed.push_back({offsets[i], rows, cols, r});
      p_numel += rows * r;
      q_numel += cols * r;
      error_numel += numel;
    } else {
      plain.emplace_back(offsets[i], numel);
      plain_numel += numel;
    }
  }
  const auto options_of = flat.options();
  p_buffer_ = at::empty({p_numel + plain_numel}, options_of);
  q_buffer_ = at::empty({q_numel}, options_of);
  error_ = at::zeros({error_numel}, options_of);
  const bool cast =
      options.wire_dtype != at::ScalarType::Undefined && options.wire_dtype != flat.scalar_type();
  p_wire_ = cast ? at::empty_like(p_buffer_, options_of.dtype(options.wire_dtype)) : p_buffer_;
  q_wire_ = cast ? at::empty_like(q_buffer_, options_of.dtype(options.wire_dtype)) : q_buffer_;
  // The first Q of every matrix: the same draw on every rank (a CPU generator, then moved).
  auto generator = at::detail::createCPUGenerator(options.seed + 7919ULL * bucket_index);
  int64_t p_at = 0, q_at = 0, e_at = 0;
  for (const Layout& l : compressed) {
    Matrix m;
    m.m = flat.narrow(0, l.offset, l.rows * l.cols).view({l.rows, l.cols});
    m.p = p_buffer_.narrow(0, p_at, l.rows * l.rank).view({l.rows, l.rank});
    m.q = q_buffer_.narrow(0, q_at, l.cols * l.rank).view({l.cols, l.rank});
    m.error = error_.narrow(0, e_at, l.rows * l.cols).view({l.rows, l.cols});
    m.q.copy_(at::randn({l.cols, l.rank}, generator, at::TensorOptions(at::kDouble)));
    p_at += l.rows * l.rank;
    q_at += l.cols * l.rank;
    e_at += l.rows * l.cols;
    matrices_.push_back(std::move(m));
  }
  for (const auto& [offset, numel] : plain) {
    plain_.push_back({flat.narrow(0, offset, numel), p_buffer_.narrow(0, p_at, numel)});
    p_at += numel;
  }
}

comm::WorkPtr PowerSgdBucket::start(comm::Communicator& comm) {
  for (Matrix& m : matrices_) {
    m.m.add_(m.error);
    at::mm_out(m.p, m.m, m.q);
  }
  for (Plain& p : plain_) p.wire.copy_(p.grad);
  if (!p_wire_.is_same(p_buffer_)) p_wire_.copy_(p_buffer_);
  return comm.allreduce(p_wire_);
}

comm::WorkPtr PowerSgdBucket::middle(comm::Communicator& comm) {
  if (!p_wire_.is_same(p_buffer_)) p_buffer_.copy_(p_wire_);
  for (Matrix& m : matrices_) {
    // Householder QR (LAPACK): orthonormal columns even when P is rank-deficient (a zero
    // gradient), where Gram-Schmidt would divide by zero. Low precisions go through float32.
    const bool low = m.p.scalar_type() == at::kHalf || m.p.scalar_type() == at::kBFloat16;
    const at::Tensor orthonormal =
        std::get<0>(at::linalg_qr(low ? m.p.to(at::kFloat) : m.p, "reduced"));
    m.p.copy_(orthonormal);
    at::mm_out(m.q, m.m.t(), m.p);
    // What this rank's share of the approximation leaves out of its own M (Vogels et al.'s
    // error: M - decompress(compress(M)), with this rank's Q before the average).
    at::mm_out(m.error, m.p, m.q.t());
    m.error.neg_().add_(m.m);
  }
  if (matrices_.empty()) return nullptr;
  if (!q_wire_.is_same(q_buffer_)) q_wire_.copy_(q_buffer_);
  return comm.allreduce(q_wire_);
}

void PowerSgdBucket::finish() {
  if (!q_wire_.is_same(q_buffer_)) q_buffer_.copy_(q_wire_);
  for (Matrix& m : matrices_) at::mm_out(m.m, m.p, m.q.t());
  for (Plain& p : plain_) p.grad.copy_(p.wire);
}

}  // namespace dtrain::parallel::ddp
