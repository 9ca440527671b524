#include "services/federated/secagg/SecureServerRound.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

using Step = dtrain::fl::SecAggRequest;

SecureServerRound::SecureServerRound(const std::vector<std::string>& chosen,
                                     double threshold_fraction, int64_t ref_weight, int64_t numel,
                                     int graph, uint64_t seed, double dropout)
    : ref(ref_weight), graph_seed(seed) {
  const auto k = static_cast<int>(chosen.size());
  // SecAgg+: a round smaller than the degree needs uses the full graph.
  degree =
      graph > 0 && graph >= k - 1 ? 0 : secagg::round_degree(graph, k, threshold_fraction, dropout);
  threshold = secagg::secagg_threshold(threshold_fraction, degree > 0 ? degree + 1 : k);
  std::vector<uint32_t> all;
  for (int i = 0; i < k; ++i) {
    ids[chosen[i]] = static_cast<uint32_t>(i + 1);
    names[static_cast<uint32_t>(i + 1)] = chosen[i];
    all.push_back(static_cast<uint32_t>(i + 1));
  }
  // The input: the update's numel words, then its loss and its weight (secure_input).
  session = std::make_unique<secagg::ServerSession>(numel + 2, std::min(threshold, std::max(2, k)));
  if (degree > 0) session->set_graph(secagg::neighbour_graph(all, degree, graph_seed));
}

SecureServerRound::StepResult SecureServerRound::apply(const dtrain::fl::SecAggRequest& request,
                                                       uint32_t me) {
  auto late = [](const char* step) { return StepResult{StepResult::Late, step}; };
  auto malformed = [](std::string why) {
    return StepResult{StepResult::Malformed, std::move(why)};
  };
  try {
    switch (request.step()) {
      case Step::KEYS: {
        if (phase != Keys) return late("KEYS");
        const auto& k = request.keys();
        if (k.id() != me || k.c_public().size() != 32 || k.s_public().size() != 32) {
          return malformed(concat("SecAgg KEYS: field 'keys' must carry id ", me,
                                  " and two 32-byte public keys"));
        }
        secagg::PublicKeys keys;
        keys.id = me;
        std::memcpy(keys.c_public.data(), k.c_public().data(), 32);
        std::memcpy(keys.s_public.data(), k.s_public().data(), 32);
        session->add_keys(keys);
        sent_keys.insert(me);
        break;
      }
      case Step::SHARES: {
        if (phase != Shares) return late("SHARES");
        std::vector<secagg::SealedShares> sealed;
        for (const auto& share : request.shares()) {
          if (share.from() != me) {
            return malformed(concat("SecAgg SHARES: field 'from' is ", share.from(), ", not ", me));
          }
          sealed.push_back(
              {share.from(), share.to(),
               std::vector<uint8_t>(share.ciphertext().begin(), share.ciphertext().end())});
        }
        session->add_shares(sealed);
        sent_shares.insert(me);
        break;
      }
      case Step::REVEAL: {
        if (phase != Reveal) return late("REVEAL");
        secagg::Reveal reveal;
        reveal.from = me;
        for (const auto& r : request.reveal()) {
          if (r.words_size() != 8) {
            return malformed(concat("SecAgg REVEAL: field 'words' holds ", r.words_size(),
                                    " words, a share holds 8"));
          }
          auto& into = r.self_mask() ? reveal.b_shares : reveal.sk_shares;
          into[r.owner()] = std::vector<uint64_t>(r.words().begin(), r.words().end());
        }
        session->add_reveal(reveal);
        sent_reveal.insert(me);
        break;
      }
      case Step::SURVIVORS:
        break;
      default:
        return malformed(concat("SecAgg: field 'step' is ", static_cast<int>(request.step())));
    }
  } catch (const Error& e) {
    return {StepResult::Refused, e.what()};
  }
  return {};
}

SecureServerRound::Phase SecureServerRound::ready_at(dtrain::fl::SecAggRequest::Step step) {
  switch (step) {
    case Step::KEYS:
      return Shares;
    case Step::SHARES:
      return Masking;
    case Step::SURVIVORS:
      return Reveal;
    default:
      return Keys;
  }
}

void SecureServerRound::fill_reply(dtrain::fl::SecAggRequest::Step step, uint32_t me,
                                   dtrain::fl::SecAggReply* reply) const {
  if (step == Step::KEYS) {
    for (const auto& k : u1) {
      auto* keys = reply->add_keys();
      keys->set_id(k.id);
      keys->set_c_public(k.c_public.data(), 32);
      keys->set_s_public(k.s_public.data(), 32);
    }
  } else if (step == Step::SHARES) {
    for (uint32_t v : u2) reply->add_shared(v);
    for (const auto& sealed : session->shares_for(me)) {
      auto* share = reply->add_inbox();
      share->set_from(sealed.from);
      share->set_to(sealed.to);
      share->set_ciphertext(sealed.ciphertext.data(), sealed.ciphertext.size());
    }
  } else if (step == Step::SURVIVORS) {
    for (uint32_t v : u3) reply->add_masked(v);
  }
}

}  // namespace dtrain::services::federated
