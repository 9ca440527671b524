// Reading the CPU's model and its vector and bf16 instructions from /proc/cpuinfo.
#include "dtrain/common/Cpu.h"

#include <fstream>
#include <set>
#include <sstream>

namespace dtrain {

namespace {

std::string trimmed(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  const auto end = s.find_last_not_of(" \t\r");
  return begin == std::string::npos ? "" : s.substr(begin, end - begin + 1);
}

}  // namespace

CpuInfo parse_cpuinfo(const std::string& text) {
  CpuInfo info;
  std::istringstream in(text);
  std::string line;
  std::set<std::string> flags;
  bool seen_processor = false;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trimmed(line.substr(0, colon));
    const std::string value = trimmed(line.substr(colon + 1));
    if (key == "processor") {
      if (seen_processor) break;  // the first processor's block describes them all
      seen_processor = true;
    } else if (key == "model name" || (key == "Model" && info.model == "unknown CPU")) {
      info.model = value;
    } else if (key == "flags" || key == "Features") {  // x86; Arm
      std::istringstream words(value);
      std::string word;
      while (words >> word) flags.insert(word);
      info.unknown = false;
    }
  }
  info.avx2 = flags.count("avx2") > 0;
  info.fma = flags.count("fma") > 0;
  info.avx512f = flags.count("avx512f") > 0;
  info.avx512_skylake = info.avx512f && flags.count("avx512cd") > 0 &&
                        flags.count("avx512bw") > 0 && flags.count("avx512dq") > 0 &&
                        flags.count("avx512vl") > 0;
  info.avx512_bf16 = flags.count("avx512_bf16") > 0;
  info.amx_bf16 = flags.count("amx_bf16") > 0;
  info.arm_bf16 = flags.count("bf16") > 0 || flags.count("svebf16") > 0;
  return info;
}

std::string CpuInfo::vector_summary() const {
  if (unknown) return "instruction set unknown";
  std::string out = avx512f ? "AVX-512" : avx2 ? "AVX2" : "";
  std::string bf16;
  if (avx512_bf16) bf16 = "AVX512-BF16";
  if (amx_bf16) bf16 += bf16.empty() ? "AMX-BF16" : " and AMX-BF16";
  if (arm_bf16) bf16 = "Arm BF16";
  if (out.empty()) return bf16.empty() ? "no bf16 instructions" : bf16;
  if (bf16.empty())
    return out + (avx512f ? ", no bf16 instructions" : " only, no bf16 instructions");
  return out + " with " + bf16;
}

const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    std::ifstream file("/proc/cpuinfo");
    if (!file) return CpuInfo{};
    std::stringstream text;
    text << file.rdbuf();
    return parse_cpuinfo(text.str());
  }();
  return info;
}

}  // namespace dtrain
