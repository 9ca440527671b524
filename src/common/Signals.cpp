// Exit codes and names of the signals that stop a run (dtrain/common/Signals.h).
#include "dtrain/common/Signals.h"

#include <csignal>

namespace dtrain {

bool is_stopped_exit_code(int code) {
  return code == stopped_exit_code(SIGINT) || code == stopped_exit_code(SIGTERM) ||
         code == stopped_exit_code(SIGUSR1) || code == stopped_exit_code(SIGUSR2);
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGUSR2:
      return "SIGUSR2";
    default:
      return "signal " + std::to_string(signal);
  }
}

}  // namespace dtrain
