// Logging in the manner of NCCL_DEBUG.
//
//   LGRECO_DEBUG=NONE|WARN|VERSION|INFO|TRACE   (default WARN)
//   LGRECO_DEBUG_FILE=/tmp/lgreco.%h.%p.log     (default: stderr)
//   LGRECO_DEBUG_SUBSYS=ALL | CTRL,SHIM | ^CODEC  (INFO and TRACE lines only)
//
// The values come from the parameters (config/params.h: environment or lgreco.conf),
// read at the first check of a level. WARN is on by default because lgreco runs inside
// other people's training jobs: a fallback to uncompressed NCCL that nobody can see would
// be a silent change of behaviour. Unlike NCCL, VERSION ranks above WARN: LD_PRELOAD
// reaches every child process of a job (shells, data-loader workers), and a default that
// printed the version line would print it in all of them.
//
// Lines read
//   host:pid:tid [rank] LGRECO LEVEL SUBSYS message
// with `[-]` until the shim learns the process's rank. A disabled level costs one relaxed
// atomic load; arguments are not evaluated. When NCCL hands the library its logger (net
// plugin init), lines go to NCCL's logger, tagged with NCCL's subsystem (NET for NET,
// INIT for INIT and CONFIG, COLL for the others: NCCL_DEBUG_SUBSYS must name COLL to show
// the shim's INFO lines); a WARN carries NCCL_ALL and also goes to stderr unless
// NCCL_DEBUG would print it, so that a warning is never lost; a file named by
// LGRECO_DEBUG_FILE gets every line as well.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace lgreco::log {

enum class Level : int { kNone = 0, kWarn = 1, kVersion = 2, kInfo = 3, kTrace = 4 };

namespace detail {
extern std::atomic<int> g_level;  // -1 until the parameters have been read
int init_level();
}  // namespace detail

inline bool enabled(Level level) {
  int current = detail::g_level.load(std::memory_order_relaxed);
  if (current < 0) current = detail::init_level();
  return static_cast<int>(level) <= current;
}

// Parses a level name (case-insensitive). Returns false for an unknown name.
bool parse_level(const char* text, Level* level);
const char* level_name(Level level);

// The subsystems a line may name; LGRECO_DEBUG_SUBSYS selects among them.
std::span<const char* const> subsystem_names();
// NCCL_DEBUG_SUBSYS's syntax: a comma-separated list of names (any case), ALL, or the
// list preceded by ^ to mean all but those. Returns false with *error naming the part.
bool parse_subsystems(const std::string& text, uint32_t* mask, std::string* error);

// Applies the logging parameters; called when the parameters are loaded. Opens the file
// pattern (%h host, %p pid) or, if that fails, logs to stderr and says so.
void configure(Level level, const std::string& file_pattern, uint32_t subsystem_mask);

// Writes one line. Use the macros below, which skip disabled levels cheaply.
void emit(Level level, const char* subsystem, const char* format, ...) __attribute__((format(printf, 3, 4)));

// One WARN per distinct cause: the first call with a given (subsystem, cause) logs, later
// ones are silent. Returns whether it logged. Past 4096 causes, one line says so and new
// causes are silent too (memory stays bounded). Use LGRECO_WARN_ONCE.
bool warn_once(const char* subsystem, std::string_view cause, const char* format, ...)
    __attribute__((format(printf, 3, 4)));

// The rank shown in each line (-1: unknown, shown as "-").
void set_rank(int rank);

// NCCL's ncclDebugLogger_t (ncclDebugLogLevel is an int-sized enum). nullptr: lgreco's
// own sink again.
using NcclLogger = void (*)(int level, unsigned long flags, const char* file, int line, const char* format, ...);
void set_nccl_logger(NcclLogger logger);

// For tests: re-read the parameters on the next check; forget warned causes and the rank.
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
// `cause` identifies the problem (not the call): the same cause logs once per process.
#define LGRECO_WARN_ONCE(subsystem, cause, ...)                      \
  do {                                                               \
    if (::lgreco::log::enabled(::lgreco::log::Level::kWarn))         \
      ::lgreco::log::warn_once(subsystem, cause, __VA_ARGS__);       \
  } while (0)
