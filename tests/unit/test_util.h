// Shared helpers for the unit suites: fresh random inputs of several distributions,
// poisoning, and running the built command-line tools.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "config/log.h"
#include "kernels/dtype.h"

namespace lgreco::test {

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline size_t count_of(const std::string& s, const std::string& part) {
  size_t n = 0;
  for (size_t at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) ++n;
  return n;
}

// A whole text file ("" if it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A seed that differs between runs (inputs are drawn fresh every time) and is printed on
// failure through BOOST_TEST_CONTEXT by the callers, so a failing draw can be replayed
// with LGRECO_TEST_SEED.
inline uint64_t run_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* s = getenv("LGRECO_TEST_SEED")) return std::strtoull(s, nullptr, 0);
    return static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}();
  }();
  return seed;
}

enum class Dist { kNormal, kHeavyTailed, kConstantBuckets, kMixedScales, kPositiveOffset };
constexpr Dist kAllDists[] = {Dist::kNormal, Dist::kHeavyTailed, Dist::kConstantBuckets, Dist::kMixedScales,
                              Dist::kPositiveOffset};

inline const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kNormal: return "normal";
    case Dist::kHeavyTailed: return "heavy-tailed";
    case Dist::kConstantBuckets: return "constant-buckets";
    case Dist::kMixedScales: return "mixed-scales";
    case Dist::kPositiveOffset: return "positive-offset";
  }
  return "?";
}

// n values of distribution d. `block` is the run length of the constant and mixed-scale
// patterns (use the codec's bucket size to make whole buckets constant).
inline std::vector<float> draw(Dist d, size_t n, std::mt19937_64& rng, size_t block = 1024) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::student_t_distribution<double> student(2.0);  // infinite variance: heavy tails
  std::uniform_real_distribution<double> uniform(-12.0, 12.0);
  std::vector<float> x(n);
  double block_value = 0, block_scale = 1;
  for (size_t i = 0; i < n; ++i) {
    if (i % block == 0) {
      block_value = normal(rng);
      block_scale = std::pow(10.0, uniform(rng));
    }
    switch (d) {
      case Dist::kNormal: x[i] = static_cast<float>(normal(rng)); break;
      case Dist::kHeavyTailed: x[i] = static_cast<float>(1e-3 * student(rng)); break;
      case Dist::kConstantBuckets:  // every other block constant, the rest normal
        x[i] = (i / block) % 2 == 0 ? static_cast<float>(block_value) : static_cast<float>(normal(rng));
        break;
      case Dist::kMixedScales: x[i] = static_cast<float>(block_scale * normal(rng)); break;
      case Dist::kPositiveOffset: x[i] = static_cast<float>(1000.0 + 0.01 * normal(rng)); break;
    }
  }
  return x;
}

inline void poison(std::vector<float>& v) { std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN()); }
inline void poison(std::vector<uint8_t>& v) { std::fill(v.begin(), v.end(), uint8_t{0xA5}); }

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = getenv(name);
  return v && *v ? v : fallback;
}

inline std::string bin_dir() { return env_or("LGRECO_TEST_BIN_DIR", "build/bin"); }

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, capturing its output and exit status.
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Calls `step` until it returns true, for at most `timeout` (a suite never hangs on a
// condition that does not come), sleeping 200 us between calls.
template <typename Step>
bool eventually(Step step, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (step()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

// A fresh directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lgreco-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Logs into a temp file for the test's duration; restores the defaults afterwards.
struct LogToFile {
  TempDir dir;
  std::string path = dir.file("log.txt");
  explicit LogToFile(log::Level level = log::Level::kInfo, uint32_t mask = ~0u) {
    log::reset_for_testing();
    log::configure(level, path, mask);
  }
  ~LogToFile() {
    unsetenv("NCCL_DEBUG");
    log::reset_for_testing();
  }
  std::string text() const { return read_text(path); }
};

inline void write_bytes(const std::string& path, const void* data, size_t n) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  if (n) fwrite(data, 1, n, f);
  fclose(f);
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::vector<uint8_t> out;
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) return out;
  uint8_t buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  fclose(f);
  return out;
}

}  // namespace lgreco::test
