// `dtrain status`: a run's state from metrics.jsonl and its checkpoints folder.
#include "dtrain/train/RunStatus.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "dtrain/common/Error.h"

namespace dtrain::train {

namespace {

namespace fs = std::filesystem;

double seconds_since(const fs::path& path) {
  std::error_code error;
  const auto written = fs::last_write_time(path, error);
  if (error) return 0.0;
  return std::chrono::duration<double>(fs::file_time_type::clock::now() - written).count();
}

// "1 h 02 min", "3 min 05 s", "12 s".
std::string duration(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char text[64];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%lld h %02lld min", static_cast<long long>(s / 3600),
                  static_cast<long long>(s % 3600 / 60));
  } else if (s >= 60) {
    std::snprintf(text, sizeof(text), "%lld min %02lld s", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(text, sizeof(text), "%lld s", static_cast<long long>(s));
  }
  return text;
}

// 4 significant digits, whole numbers from 1000 on.
std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), std::fabs(value) >= 1000 ? "%.0f" : "%.4g", value);
  return text;
}

struct StepPoint {
  int64_t step;
  double time;
};

}  // namespace

RunStatus read_run_status(const std::string& run_dir) {
  RunStatus status;
  status.run_dir = run_dir;
  fs::path metrics = run_dir;
  if (fs::is_directory(metrics)) metrics /= "metrics.jsonl";
  DTRAIN_CHECK_INPUT(fs::exists(run_dir), "dtrain status ", run_dir, ": no such folder or file");
  DTRAIN_CHECK_INPUT(fs::is_regular_file(metrics), "dtrain status ", run_dir,
                     ": no metrics.jsonl in it (a run folder is what dtrain train --run-dir DIR, "
                     "or runs/MODEL-DATE-TIME, holds)");
  const fs::path folder = metrics.parent_path();
  std::ifstream in(metrics);
  std::string line;
  int64_t line_number = 0;
  std::vector<StepPoint> points;  // this attempt's step records
  while (std::getline(in, line)) {
    ++line_number;
    if (line.empty()) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // The last line of a file being written may be cut short: ignored.
      if (in.peek() == std::char_traits<char>::eof()) break;
      DTRAIN_THROW(InputError, metrics.string(), ":", line_number, ": not a JSON record (",
                   e.what(), ")");
    }
    const std::string event = record.value("event", "");
    const auto get = [&](const char* key) -> std::optional<double> {
      const auto found = record.find(key);
      if (found == record.end() || !found->is_number()) return std::nullopt;
      return found->get<double>();
    };
    if (event == "start") {
      status.state = "starting";
      status.start_step = static_cast<int64_t>(get("step").value_or(0));
      status.step = std::max(status.step, status.start_step);
      status.total_steps = static_cast<int64_t>(get("total_steps").value_or(0));
      status.world_size = static_cast<int>(get("world_size").value_or(0));
      status.strategy = record.value("strategy", "");
      status.layout = concat("DP ", get("data_parallel").value_or(1), " x PP ",
                             get("pipeline_parallel").value_or(1), " x TP ",
                             get("tensor_parallel").value_or(1));
      if (get("context_parallel").value_or(1) > 1) {
        status.layout += concat(" x CP ", get("context_parallel").value_or(1));
      }
      if (get("expert_parallel").value_or(1) > 1) {
        status.layout += concat(", experts over ", get("expert_parallel").value_or(1));
      }
      status.stopped_by_signal = 0;
      points.clear();
    } else if (event == "step") {
      status.state = "training";
      status.step = static_cast<int64_t>(get("step").value_or(status.step));
      if (const auto v = get("epoch")) status.epoch = static_cast<int64_t>(*v);
      status.loss = get("loss");
      status.lr = get("lr");
      if (const auto v = get("tokens_per_s")) {
        status.throughput = v;
        status.throughput_unit = "tokens/s";
      } else if (const auto w = get("samples_per_s")) {
        status.throughput = w;
      }
      if (const auto v = get("replicas")) status.replicas = static_cast<int64_t>(*v);
      if (const auto t = get("time")) points.push_back({status.step, *t});
    } else if (event == "eval") {
      status.val_loss = get("val_loss");
      status.val_step = static_cast<int64_t>(get("step").value_or(-1));
    } else if (event == "summary") {
      const auto signal = get("stopped_by_signal");
      status.stopped_by_signal = signal ? static_cast<int>(*signal) : 0;
      status.state = signal ? "stopped" : "finished";
      if (const auto v = get("steps")) status.step = static_cast<int64_t>(*v);
    }
  }
  // Seconds a step: over this attempt's last 20 step records.
  if (points.size() >= 2) {
    const StepPoint& last = points.back();
    const StepPoint& first = points[points.size() > 20 ? points.size() - 21 : 0];
    if (last.step > first.step) {
      status.seconds_per_step =
          (last.time - first.time) / static_cast<double>(last.step - first.step);
    }
  }
  status.seconds_since_record = seconds_since(metrics);
  if (status.seconds_per_step && status.total_steps > status.step &&
      (status.state == "training" || status.state == "starting")) {
    status.eta_seconds =
        *status.seconds_per_step * static_cast<double>(status.total_steps - status.step);
  }
  if (status.state == "training" || status.state == "starting") {
    const double quiet = std::max(120.0, 20.0 * status.seconds_per_step.value_or(0.0));
    if (status.seconds_since_record > quiet) status.state = "silent";
  }
  // The newest checkpoint: `latest` names it.
  const fs::path checkpoints = folder / "checkpoints";
  std::ifstream latest(checkpoints / "latest");
  std::string name;
  if (latest >> name && fs::is_directory(checkpoints / name)) {
    status.checkpoint_path = (checkpoints / name).string();
    const auto dash = name.rfind('-');
    if (dash != std::string::npos) status.checkpoint_step = std::atoll(name.c_str() + dash + 1);
    status.seconds_since_checkpoint = seconds_since(checkpoints / name);
  }
  return status;
}

std::string describe(const RunStatus& s) {
  std::string out = s.run_dir + ": " + s.state;
  if (s.state == "stopped")
    out += concat(" on request (signal ", s.stopped_by_signal, "; resumable)");
  out += concat(", step ", s.step);
  if (s.total_steps > 0) {
    out += concat(
        " of ", s.total_steps, " (",
        static_cast<int>(100.0 * static_cast<double>(s.step) / static_cast<double>(s.total_steps)),
        "%)");
  }
  if (s.epoch >= 0) out += concat(", epoch ", s.epoch);
  if (s.start_step > 0) out += concat(", resumed from step ", s.start_step);
  out += "\n";
  if (s.loss || s.val_loss) {
    out += " ";
    if (s.loss) out += concat(" loss ", number(*s.loss));
    if (s.lr) out += concat(", lr ", number(*s.lr));
    if (s.val_loss)
      out += concat(s.loss ? "; " : " ", "validation loss ", number(*s.val_loss), " at step ",
                    s.val_step);
    out += "\n";
  }
  if (s.seconds_per_step || s.throughput) {
    out += " ";
    if (s.seconds_per_step) out += concat(" ", number(*s.seconds_per_step), " s a step");
    if (s.throughput)
      out += concat(s.seconds_per_step ? ", " : " ", number(*s.throughput), " ", s.throughput_unit);
    if (s.eta_seconds) out += concat("; ETA ", duration(*s.eta_seconds));
    out += "\n";
  }
  if (s.world_size > 0) {
    out += concat("  ranks: ", s.world_size, " (", s.layout, ", ", s.strategy, ")");
    if (s.replicas) out += concat(", replicas present in the last step: ", *s.replicas);
    out += "\n";
  }
  out += concat("  last record ", duration(s.seconds_since_record), " ago");
  if (s.state == "silent") out += " (nothing since: failed, killed or hung? see its log)";
  out += "\n";
  if (s.checkpoint_step >= 0) {
    out += concat("  last checkpoint: step ", s.checkpoint_step, ", ",
                  duration(s.seconds_since_checkpoint), " ago (", s.checkpoint_path, ")\n");
  } else {
    out += "  no checkpoint\n";
  }
  return out;
}

std::string to_json(const RunStatus& s) {
  nlohmann::json json{{"run_dir", s.run_dir},
                      {"state", s.state},
                      {"step", s.step},
                      {"total_steps", s.total_steps},
                      {"start_step", s.start_step},
                      {"world_size", s.world_size},
                      {"layout", s.layout},
                      {"strategy", s.strategy},
                      {"seconds_since_record", s.seconds_since_record},
                      {"checkpoint_step", s.checkpoint_step},
                      {"checkpoint_path", s.checkpoint_path}};
  const auto optional = [&](const char* key, const std::optional<double>& value) {
    json[key] = value ? nlohmann::json(*value) : nlohmann::json(nullptr);
  };
  optional("loss", s.loss);
  optional("lr", s.lr);
  optional("val_loss", s.val_loss);
  optional("seconds_per_step", s.seconds_per_step);
  optional("eta_seconds", s.eta_seconds);
  optional("throughput", s.throughput);
  json["throughput_unit"] = s.throughput_unit;
  if (s.epoch >= 0) json["epoch"] = s.epoch;
  if (s.replicas) json["replicas"] = *s.replicas;
  if (s.stopped_by_signal) json["stopped_by_signal"] = s.stopped_by_signal;
  return json.dump();
}

}  // namespace dtrain::train
