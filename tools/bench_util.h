// What the benchmarks share: median timing and the lines that make a table reproducible
// (machine, date, version), so a table pasted into docs/PERF.md says where it came from.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "tools/cli.h"

namespace lgreco::bench {

// Median wall time in seconds of `reps` calls of fn, after one warm-up call.
inline double median_seconds(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double start = cli::seconds_now();
    fn();
    t.push_back(cli::seconds_now() - start);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The "model name" line of /proc/cpuinfo.
inline std::string cpu_model() {
  FILE* f = fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "model name", 10)) {
      const char* colon = strchr(line, ':');
      if (colon) model = std::string(colon + 2, strcspn(colon + 2, "\n"));
      break;
    }
  }
  fclose(f);
  return model;
}

// "2026-11-30 12:00 UTC"
inline std::string utc_now() {
  char date[64];
  const time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
  return date;
}

}  // namespace lgreco::bench
