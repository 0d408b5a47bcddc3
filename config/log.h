// Logging in the manner of NCCL_DEBUG.
//
//   LGRECO_DEBUG=NONE|WARN|VERSION|INFO|TRACE   (default WARN)
//
// WARN is on by default because lgreco runs inside other people's training jobs: a
// fallback to uncompressed NCCL that nobody can see would be a silent change of
// behaviour. Unlike NCCL, VERSION ranks above WARN: LD_PRELOAD reaches every child
// process of a job (shells, data-loader workers), and a default that printed the version
// line would print it in all of them. Lines go to stderr as
//   host:pid:tid lgreco LEVEL SUBSYS message
// A disabled level costs one relaxed atomic load; arguments are not evaluated.
// (The registration/parameters issue adds LGRECO_DEBUG_FILE and subsystem masks.)
#pragma once

#include <atomic>

namespace lgreco::log {

enum class Level : int { kNone = 0, kWarn = 1, kVersion = 2, kInfo = 3, kTrace = 4 };

namespace detail {
extern std::atomic<int> g_level;  // -1 until the environment has been read
int init_level();
}  // namespace detail

inline bool enabled(Level level) {
  int current = detail::g_level.load(std::memory_order_relaxed);
  if (current < 0) current = detail::init_level();
  return static_cast<int>(level) <= current;
}

// Parses a level name (case-insensitive). Returns false for an unknown name.
bool parse_level(const char* text, Level* level);

// Writes one line. Use the macros below, which skip disabled levels cheaply.
void emit(Level level, const char* subsystem, const char* format, ...) __attribute__((format(printf, 3, 4)));

// For tests: re-read LGRECO_DEBUG on the next check.
void reset_for_testing();

}  // namespace lgreco::log

#define LGRECO_LOG(level, subsystem, ...)                                                  \
  do {                                                                                     \
    if (::lgreco::log::enabled(level)) ::lgreco::log::emit(level, subsystem, __VA_ARGS__); \
  } while (0)
#define LGRECO_VERSION_LOG(subsystem, ...) LGRECO_LOG(::lgreco::log::Level::kVersion, subsystem, __VA_ARGS__)
#define LGRECO_WARN(subsystem, ...) LGRECO_LOG(::lgreco::log::Level::kWarn, subsystem, __VA_ARGS__)
#define LGRECO_INFO(subsystem, ...) LGRECO_LOG(::lgreco::log::Level::kInfo, subsystem, __VA_ARGS__)
#define LGRECO_TRACE(subsystem, ...) LGRECO_LOG(::lgreco::log::Level::kTrace, subsystem, __VA_ARGS__)
