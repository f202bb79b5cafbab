#include "test_hooks.h"

#include "config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt >= 11 keeps it here)

#include <fsdp/distributed_checkpoint.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>

namespace fsdp_train {

HookSpec read_hook(const char* variable, const std::vector<std::string>& points) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return {};
  const std::string text = env;
  HookSpec spec;
  const auto at = text.find('@');
  spec.point = text.substr(0, at);
  bool ok = std::find(points.begin(), points.end(), spec.point) != points.end();
  if (ok && at != std::string::npos) {
    try {
      size_t used = 0;
      spec.step = std::stoll(text.substr(at + 1), &used);
      ok = used == text.size() - at - 1 && spec.step >= 0;
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok) {
    throw ConfigError(fmt::format("{}={} (a test hook): expected <point>[@<step>] with a point of {}",
                                  variable, text, fmt::join(points, ", ")));
  }
  return spec;
}

void install_save_crash(const char* variable) {
  const HookSpec spec = read_hook(variable, {"written", "index", "renamed", "pruned"});
  if (spec.point.empty()) return;
  const std::string text = spec.point + (spec.step >= 0 ? "@" + std::to_string(spec.step) : "");
  fsdp::dcp::testing::set_publish_observer([spec, text, variable](const char* phase, int64_t step) {
    if (!spec.matches(phase, step)) return;
    std::cerr << fmt::format("fsdp-train: {}={}: rank 0 kills itself after '{}' of the save of step {}\n",
                             variable, text, phase, step)
              << std::flush;
    std::raise(SIGKILL);
  });
}

std::chrono::milliseconds read_min_step(const char* variable) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return std::chrono::milliseconds(0);
  const std::string text = env;
  long long ms = -1;
  try {
    size_t used = 0;
    ms = std::stoll(text, &used);
    if (used != text.size()) ms = -1;
  } catch (const std::exception&) {
    ms = -1;
  }
  if (ms < 0 || ms > 600000) {
    throw ConfigError(fmt::format("{}={} (a test hook): expected milliseconds in [0, 600000]",
                                  variable, text));
  }
  return std::chrono::milliseconds(ms);
}

}  // namespace fsdp_train
