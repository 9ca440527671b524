#include "dtrain/services/federated/aggregation/Buffered.h"

#include <cmath>
#include <cstdlib>
#include <sstream>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"

namespace dtrain::services::federated {

namespace {

std::string number(double x) {
  std::ostringstream out;
  out << x;
  return out.str();
}

}  // namespace

double hashed_uniform(uint64_t seed, uint64_t salt, int64_t index) {
  uint64_t z = (seed ^ salt) + 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(index) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

double StalenessRule::weight(int64_t staleness) const {
  const auto s = static_cast<double>(std::max<int64_t>(0, staleness));
  switch (kind) {
    case Poly:
      return std::pow(1.0 + s, -a);
    case Hinge:
      return s <= b ? 1.0 : 1.0 / (a * (s - b) + 1.0);
    case Constant:
      break;
  }
  return 1.0;
}

StalenessRule parse_staleness(const std::string& text) {
  StalenessRule rule;
  const auto bad = [&](const std::string& why) {
    DTRAIN_THROW(InputError, "--staleness '", text, "': ", why,
                 " (expected constant, poly:A with A >= 0, or hinge:A,B with A >= 0, B >= 0)");
  };
  if (text == "constant") {
    rule.kind = StalenessRule::Constant;
    return rule;
  }
  const auto colon = text.find(':');
  if (colon == std::string::npos) bad("unknown rule");
  const std::string kind = text.substr(0, colon), args = text.substr(colon + 1);
  if (kind == "poly") {
    rule.kind = StalenessRule::Poly;
    if (!parse_finite_number(args, &rule.a) || rule.a < 0)
      bad("the exponent '" + args + "' is not >= 0");
  } else if (kind == "hinge") {
    rule.kind = StalenessRule::Hinge;
    const auto comma = args.find(',');
    if (comma == std::string::npos) bad("hinge takes two numbers A,B");
    const std::string a = args.substr(0, comma), b = args.substr(comma + 1);
    if (!parse_finite_number(a, &rule.a) || rule.a < 0) bad("the slope '" + a + "' is not >= 0");
    if (!parse_finite_number(b, &rule.b) || rule.b < 0) bad("the hinge '" + b + "' is not >= 0");
  } else {
    bad("unknown rule '" + kind + "'");
  }
  return rule;
}

std::string to_string(const StalenessRule& rule) {
  switch (rule.kind) {
    case StalenessRule::Poly:
      return "poly:" + number(rule.a);
    case StalenessRule::Hinge:
      return "hinge:" + number(rule.a) + "," + number(rule.b);
    case StalenessRule::Constant:
      break;
  }
  return "constant";
}

void validate(const BufferSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.size >= 0, "--buffer-size must be >= 0 (0 = synchronous rounds), got ",
                     spec.size);
  DTRAIN_CHECK_INPUT(spec.concurrency >= 0,
                     "--concurrency must be >= 0 (0 = 10 x --buffer-size), got ", spec.concurrency);
  DTRAIN_CHECK_INPUT(!spec.enabled() || spec.clients_at_once() >= spec.size, "--concurrency ",
                     spec.clients_at_once(), " is below --buffer-size ", spec.size,
                     ": the buffer could never fill");
}

double ClientSpeed::slowness(int64_t client, uint64_t seed) const {
  switch (kind) {
    case LogNormal: {
      // Box-Muller from two hashed uniforms: N(0, 1).
      const double u1 = hashed_uniform(seed, 0x5BEED1ULL, client);
      const double u2 = hashed_uniform(seed, 0x5BEED2ULL, client);
      const double z = std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * M_PI * u2);
      return std::exp(shape * z);
    }
    case Pareto:
      return std::pow(1.0 - hashed_uniform(seed, 0x5BEED3ULL, client), -1.0 / shape);
    case Constant:
    case None:
      break;
  }
  return 1.0;
}

double ClientSpeed::minutes(int64_t client, int64_t steps, uint64_t seed) const {
  return slowness(client, seed) * step_seconds * static_cast<double>(steps) / 60.0;
}

ClientSpeed parse_client_speed(const std::string& text) {
  ClientSpeed speed;
  if (text == "none") return speed;
  if (text == "constant") {
    speed.kind = ClientSpeed::Constant;
    return speed;
  }
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "lognormal" || kind == "pareto") {
    speed.kind = kind == "lognormal" ? ClientSpeed::LogNormal : ClientSpeed::Pareto;
    DTRAIN_CHECK_INPUT(parse_finite_number(arg, &speed.shape) && speed.shape > 0,
                       "--client-speed '", text, "': ", kind, " takes a shape > 0 (",
                       kind == "lognormal" ? "SIGMA" : "ALPHA", ")");
    return speed;
  }
  DTRAIN_THROW(InputError, "--client-speed '", text,
               "': expected none, constant, lognormal:SIGMA or pareto:ALPHA");
}

std::string to_string(const ClientSpeed& speed) {
  switch (speed.kind) {
    case ClientSpeed::Constant:
      return "constant";
    case ClientSpeed::LogNormal:
      return "lognormal:" + number(speed.shape);
    case ClientSpeed::Pareto:
      return "pareto:" + number(speed.shape);
    case ClientSpeed::None:
      break;
  }
  return "none";
}

}  // namespace dtrain::services::federated
