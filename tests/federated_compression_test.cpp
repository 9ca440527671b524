// Federated updates on the wire and in private: 8-bit stochastic rounding and top-k with error
// feedback (sizes, unbiasedness, convergence, malformed updates refused by name), and
// differential privacy (the sampled Gaussian's RDP accounting, the server's clip check and
// noise).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include <grpcpp/grpcpp.h>
#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"

#include <atomic>
#include <thread>

#include "FederatedTesting.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/services/federated/service/Server.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "services/federated/secagg/SecureServerRound.h"
#include "services/federated/service/FlWire.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

namespace {

// The bytes an encoded update takes in its upload's messages.
int64_t upload_bytes(const comm::EncodedUpdate& encoded) {
  int64_t bytes = 0;
  for (const auto& m : wire::update_messages(encoded, "c", 1, 10, 0.0, 1 << 20)) {
    bytes += wire::message_bytes(m);
  }
  return bytes;
}

// Through the upload's messages and back, as the server reads them.
at::Tensor round_trip(const comm::EncodedUpdate& encoded, int64_t n, at::ScalarType dtype) {
  dtrain::fl::UpdateChunk header;
  comm::EncodedUpdate received;
  at::Tensor out;
  const auto messages = wire::update_messages(encoded, "c", 1, 10, 0.0, 4096);
  EXPECT_EQ(wire::read_update(messages, n, &header, &received), "");
  EXPECT_EQ(comm::decode_update(received, n, dtype, &out), "");
  return out;
}

}  // namespace

// 8-bit quantization with stochastic rounding: every decoded element is within one step of the
// value, the mean of many decodings converges to it (unbiased; rounding to the nearest level
// would not, and the bound sees that), and the upload is >= 3.9x smaller than float32's.
TEST(Compression, EightBitStochasticRoundingIsUnbiasedAndFourTimesSmaller) {
  const int64_t n = 2500;  // two whole blocks and a partial one
  at::Generator gen = at::detail::createCPUGenerator(3);
  const at::Tensor x = at::randn({n}, gen, at::kFloat) * 0.01;
  const comm::CompressionSpec spec = comm::parse_compression("q8");
  const int trials = 400;
  at::Tensor sum = at::zeros({n}, at::kDouble);
  at::Tensor step;
  for (int t = 0; t < trials; ++t) {
    const comm::EncodedUpdate encoded = comm::encode_update(x, spec, nullptr, 100 + t);
    const at::Tensor* s = &encoded.parts[2].second;
    ASSERT_EQ(encoded.parts[2].first, "step");
    step = s->to(at::kDouble).repeat_interleave(comm::kQuantBlock).slice(0, 0, n);
    const at::Tensor decoded = round_trip(encoded, n, at::kFloat).to(at::kDouble);
    EXPECT_TRUE(((decoded - x.to(at::kDouble)).abs() <= step * (1 + 1e-6)).all().item<bool>());
    sum += decoded;
  }
  // Each rounding's error has a standard deviation <= step / 2: the mean's is step / (2 sqrt T).
  const at::Tensor bound = 6 * step / (2 * std::sqrt(static_cast<double>(trials)));
  const at::Tensor mean_error = (sum / trials - x.to(at::kDouble)).abs();
  EXPECT_TRUE((mean_error <= bound).all().item<bool>())
      << "largest bias " << (mean_error / bound).max().item<double>() << " of the bound";
  // Rounding to the nearest level is biased by up to half a step: the same bound catches it.
  const comm::EncodedUpdate first = comm::encode_update(x, spec, nullptr, 1);
  const at::Tensor lo =
      first.parts[1].second.to(at::kDouble).repeat_interleave(comm::kQuantBlock).slice(0, 0, n);
  const at::Tensor nearest = lo + at::round((x.to(at::kDouble) - lo) / step) * step;
  EXPECT_FALSE(((nearest - x.to(at::kDouble)).abs() <= bound).all().item<bool>());
  // Bytes: 1 per element and 8 per block against 4 per element (a model of 100k parameters).
  const at::Tensor big = at::randn({100000}, gen, at::kFloat);
  const double ratio =
      static_cast<double>(upload_bytes(comm::encode_update(big, {}, nullptr, 0))) /
      static_cast<double>(upload_bytes(comm::encode_update(big, spec, nullptr, 0)));
  EXPECT_GE(ratio, 3.9);
  EXPECT_LT(ratio, 4.0);
}

// Top-k with error feedback loses nothing, it only delays: after several updates, what was sent
// plus the residual left on the client is exactly the sum of the updates (float64). Without
// error feedback the unsent part is gone, and the same check fails.
TEST(Compression, TopKWithErrorFeedbackSendsEverythingEventually) {
  const int64_t n = 1000;
  const comm::CompressionSpec spec = comm::parse_compression("topk:0.02");
  comm::CompressionSpec no_feedback = spec;
  no_feedback.error_feedback = false;
  for (const comm::CompressionSpec& s : {spec, no_feedback}) {
    at::Tensor residual, sent = at::zeros({n}, at::kDouble), total = at::zeros({n}, at::kDouble);
    for (int round = 0; round < 6; ++round) {
      const at::Tensor delta =
          at::randn({n}, at::detail::createCPUGenerator(40 + round), at::kDouble);
      const comm::EncodedUpdate encoded = comm::encode_update(delta, s, &residual, 0);
      EXPECT_EQ(encoded.parts[0].second.numel(), 20);  // ceil(0.02 n)
      EXPECT_EQ(encoded.parts[0].second.scalar_type(), at::kInt);
      sent += round_trip(encoded, n, at::kDouble);
      total += delta;
    }
    const at::Tensor left = residual.defined() ? residual : at::zeros({n}, at::kDouble);
    const double error = (sent + left - total).abs().max().item<double>();
    if (s.error_feedback) {
      EXPECT_LE(error, kTightBound);
    } else {
      EXPECT_GT(error, 1.0);
    }
  }
  // 2% of float32 elements as (int32 index, float32 value): >= 20x fewer bytes.
  const at::Tensor x = at::randn({100000}, at::detail::createCPUGenerator(9));
  at::Tensor r;
  EXPECT_GE(static_cast<double>(upload_bytes(comm::encode_update(x, {}, nullptr, 0))) /
                static_cast<double>(upload_bytes(comm::encode_update(x, spec, &r, 0))),
            24.0);
}

// With differential privacy the clip bounds what the server decodes: an update clipped to the
// norm decodes above it after q8's stochastic rounding (almost always: the rounding adds
// variance), and top-k sends values from the update plus its residual. fit_within_norm scales
// what travels so the decoded norm is within the clip, and what it takes from top-k's values
// goes back into the residual (nothing lost).
TEST(Compression, ClippedUpdatesDecodeWithinTheClipWhateverTheCompression) {
  const int64_t n = 3000;
  const double clip = 1.0;
  int q8_over = 0;
  for (int seed = 0; seed < 8; ++seed) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor raw = at::randn({n}, at::detail::createCPUGenerator(70 + seed), dtype);
      const at::Tensor delta = clip_update(raw, clip);
      comm::EncodedUpdate q8 =
          comm::encode_update(delta, comm::parse_compression("q8"), nullptr, 100 + seed);
      if (round_trip(q8, n, dtype).to(at::kDouble).norm().item<double>() > clip) ++q8_over;
      fit_within_norm(&q8, n, dtype, clip, nullptr);
      const at::Tensor decoded = round_trip(q8, n, dtype).to(at::kDouble);
      EXPECT_LE(decoded.norm().item<double>(), clip) << "q8, seed " << seed;
      EXPECT_GE(decoded.norm().item<double>(), 0.99 * clip) << "q8, seed " << seed;
      // Top-k with a residual that carries the update past the clip.
      at::Tensor residual = raw.clone();
      comm::EncodedUpdate topk =
          comm::encode_update(delta, comm::parse_compression("topk:0.1"), &residual, 0);
      const at::Tensor before = round_trip(topk, n, dtype).to(at::kDouble) + residual;
      EXPECT_GT(round_trip(topk, n, dtype).to(at::kDouble).norm().item<double>(), clip);
      fit_within_norm(&topk, n, dtype, clip, &residual);
      const at::Tensor sent = round_trip(topk, n, dtype).to(at::kDouble);
      EXPECT_LE(sent.norm().item<double>(), clip) << "topk, seed " << seed;
      EXPECT_LE((sent + residual - before).abs().max().item<double>(),
                dtype == at::kDouble ? kTightBound : 1e-5);
    }
  }
  // Without the fit, q8 breaks the clip: the case the server refused.
  EXPECT_GT(q8_over, 8);
}

// A malformed encoding or upload is refused with the field named; nothing is decoded.
TEST(Compression, MalformedUpdatesAreRefusedByName) {
  const int64_t n = 10;
  at::Tensor out;
  auto why = [&](comm::EncodedUpdate e) {
    out = at::Tensor();
    const std::string reason = comm::decode_update(e, n, at::kFloat, &out);
    EXPECT_FALSE(out.defined()) << reason;
    return reason;
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  EXPECT_TRUE(has(why({"none", {{"delta", at::ones({9})}}}), "holds 9 elements, expected 10"));
  EXPECT_TRUE(has(why({"none", {{"delta", at::full({10}, NAN)}}}), "NaN or Inf"));
  EXPECT_TRUE(has(why({"none", {{"delta", at::ones({10}, at::kLong)}}}), "part 'delta'"));
  EXPECT_TRUE(has(why({"zip", {{"delta", at::ones({10})}}}), "unknown encoding 'zip'"));
  EXPECT_TRUE(has(why({"q8", {{"q", at::ones({10}, at::kByte)}, {"lo", at::zeros({1})}}}),
                  "2 parts, not 3"));
  EXPECT_TRUE(has(
      why({"q8",
           {{"q", at::ones({10}, at::kByte)}, {"lo", at::zeros({1})}, {"step", -at::ones({1})}}}),
      "negative step"));
  EXPECT_TRUE(
      has(why({"topk", {{"indices", at::tensor({3, 10}, at::kInt)}, {"values", at::ones({2})}}}),
          "outside [0, 10)"));
  EXPECT_TRUE(
      has(why({"topk", {{"indices", at::tensor({3, 3}, at::kInt)}, {"values", at::ones({2})}}}),
          "not strictly increasing"));
  EXPECT_TRUE(
      has(why({"topk", {{"indices", at::tensor({3}, at::kInt)}, {"values", at::ones({2})}}}),
          "holds 2 elements, expected 1"));
  // The messages: an unknown part, a part longer than the model, a gap, a part cut short.
  wire::PartsReader reader({{"delta", n}});
  dtrain::comm::rpc::TensorChunk chunk;
  chunk.set_name("weights");
  EXPECT_TRUE(has(reader.add(chunk, "chunk 0"), "field 'name' is 'weights'"));
  chunk.set_name("delta");
  chunk.set_dtype(dtrain::comm::rpc::FLOAT32);
  chunk.add_shape(11);
  EXPECT_TRUE(has(reader.add(chunk, "chunk 0"), "field 'shape'"));
  chunk.set_shape(0, 10);
  chunk.set_data(std::string(16, '\0'));
  EXPECT_EQ(reader.add(chunk, "chunk 0"), "");
  chunk.set_offset(5);
  EXPECT_TRUE(has(reader.add(chunk, "chunk 1"), "part 'delta' continues at 4"));
  wire::Parts parts;
  EXPECT_TRUE(has(reader.finish(&parts), "ended after 4 of its 10 elements"));
  chunk.set_offset(4);
  chunk.set_data(std::string(28, '\0'));
  EXPECT_TRUE(has(reader.add(chunk, "chunk 1"), "outside [0, 10)"));
}

// Top-k of 5% with error feedback converges, only later: in twice the rounds it gets the global
// model's training loss below what sending everything reaches; dropping what was not sent (no
// error feedback) ends at least 1.5x higher in the same rounds. Float64, a fixed seed: the same on
// any CPU.
TEST(Compression, TopKWithErrorFeedbackConvergesAndWithoutItLags) {
  at::set_num_threads(1);
  const auto train = synthetic64(800, 17);
  const auto test = synthetic64(400, 18);
  SimulationOptions options;
  options.clients = 10;
  options.fraction = 0.5;
  options.rounds = 30;
  options.round.local.epochs = 1;
  options.round.local.batch = 20;
  options.round.local.lr = 0.1;
  options.threads = 1;
  options.progress = false;
  auto final_loss = [&](const std::string& compression, bool feedback) {
    options.compression = comm::parse_compression(compression);
    options.compression.error_feedback = feedback;
    const auto result = simulate(mlp_spec(), train, test, options);
    // The global model's loss on all training examples: what the rounds minimize.
    Model model = model64(0);
    load_flat_parameters(model, result.global);
    return evaluate_model(model, train).first;
  };
  const double plain = final_loss("none", true);
  options.rounds = 60;
  const double with_feedback = final_loss("topk:0.05", true);
  const double without = final_loss("topk:0.05", false);
  std::printf(
      "training loss: uncompressed after 30 rounds %.4f; top-5%% after 60 rounds: with "
      "error feedback %.4f, without %.4f\n",
      plain, with_feedback, without);
  EXPECT_LT(with_feedback, plain);
  EXPECT_GT(without, with_feedback * 1.5);
}

// ---- Differential privacy ----

// The sampled Gaussian's RDP from the binomial expansion equals a direct numerical integration
// of E_{N(0, z^2)}[((1 - q) + q exp((2x - 1) / (2 z^2)))^alpha]; at q = 1 it is the Gaussian's
// alpha / (2 z^2).
TEST(Privacy, SampledGaussianRdpMatchesItsIntegralAndTheGaussianAtFullSampling) {
  for (const double q : {0.01, 0.1, 0.5}) {
    for (const double z : {0.8, 1.5, 4.0}) {
      for (int alpha = 2; alpha <= 8; ++alpha) {
        // Trapezoid over +-40 z with 400k steps: far below the checked 1e-9 relative error.
        const int64_t steps = 400000;
        const double lo = -40 * z, hi = 40 * z, h = (hi - lo) / steps;
        const at::Tensor x = at::linspace(lo, hi, steps + 1, at::kDouble);
        const at::Tensor density = at::exp(-x.pow(2) / (2 * z * z)) / (z * std::sqrt(2 * M_PI));
        const at::Tensor ratio = (1 - q) + q * at::exp((2 * x - 1) / (2 * z * z));
        const at::Tensor f = density * ratio.pow(alpha);
        const double integral =
            (f.sum().item<double>() - 0.5 * (f[0].item<double>() + f[-1].item<double>())) * h;
        const double expected = std::log(integral) / (alpha - 1);
        EXPECT_NEAR(sampled_gaussian_rdp(q, z, alpha), expected, 1e-9 * std::max(1.0, expected))
            << "q " << q << " z " << z << " alpha " << alpha;
      }
    }
  }
  EXPECT_NEAR(sampled_gaussian_rdp(1.0, 2.0, 7), 7 / (2 * 4.0), 1e-12);
  EXPECT_EQ(sampled_gaussian_rdp(0.0, 2.0, 7), 0.0);
  // Epsilon grows with rounds and shrinks with noise; no noise is no privacy.
  const double base = dp_epsilon(0.01, 1.1, 1000, 1e-5).first;
  EXPECT_GT(dp_epsilon(0.01, 1.1, 4000, 1e-5).first, base);
  EXPECT_LT(dp_epsilon(0.01, 2.0, 1000, 1e-5).first, base);
  EXPECT_TRUE(std::isinf(dp_epsilon(0.01, 0.0, 10, 1e-5).first));
}

// The server refuses updates above the clip, weighs clients equally, and adds noise of
// standard deviation z S to the sum before dividing by the selected clients.
TEST(Privacy, TheServerChecksTheClipAndAddsNoiseOfTheRightSize) {
  const int64_t n = 20000;
  RoundServerOptions options;
  options.clients_per_round = 5;
  options.dp.clip = 2.0;
  options.dp.noise_multiplier = 1.5;
  RoundServer server(at::zeros({n}, at::kDouble), options);
  const auto chosen = server.select({"a", "b", "c", "d", "e"});
  ASSERT_EQ(chosen.size(), 5u);
  const std::string refused = server.submit("a", at::full({n}, 1.0, at::kDouble), 10);
  EXPECT_NE(refused.find("exceeds the clip 2"), std::string::npos) << refused;
  for (const auto& id : chosen) EXPECT_EQ(server.submit(id, at::zeros({n}, at::kDouble), 10), "");
  server.close();
  // All updates were zero: what moved is the noise / 5, standard deviation 1.5 x 2 / 5 = 0.6.
  const double sd = server.global().std().item<double>();
  EXPECT_NEAR(sd, 0.6, 0.6 * 0.03);
  // Without noise, equal weights whatever the example counts: mean = (u1 + u2) / selected.
  RoundServerOptions plain = options;
  plain.clients_per_round = 2;
  plain.dp.noise_multiplier = 0;
  RoundServer exact(at::zeros({4}, at::kDouble), plain);
  exact.select({"a", "b"});
  EXPECT_EQ(exact.submit("a", at::full({4}, 0.5, at::kDouble), 1), "");
  EXPECT_EQ(exact.submit("b", at::full({4}, -0.25, at::kDouble), 1000), "");
  exact.close();
  EXPECT_TRUE(at::allclose(exact.global(), at::full({4}, 0.125, at::kDouble), 0, 1e-15));
  // And clip_update scales down only what is above the norm.
  const at::Tensor big = at::full({4}, 3.0, at::kDouble);  // norm 6
  EXPECT_NEAR(clip_update(big, 2.0).norm().item<double>(), 2.0, 1e-12);
  EXPECT_TRUE(at::equal(clip_update(big, 10.0), big));
}
