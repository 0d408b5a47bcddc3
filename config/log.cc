#include "config/log.h"

#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "config/params.h"

namespace lgreco::log {
namespace detail {
std::atomic<int> g_level{-1};
}  // namespace detail

namespace {

constexpr const char* kSubsystems[] = {"INIT", "CONFIG", "CTRL", "CODEC", "ENGINE", "SHIM", "NET"};
constexpr uint32_t kAllSubsystems = (1u << std::size(kSubsystems)) - 1;
// Distinct causes remembered by warn_once; past this, new causes are not logged either.
constexpr size_t kMaxCauses = 4096;

// Guards the sink, the causes and the rank. Lines are written whole under it.
std::mutex g_mutex;
FILE* g_sink = nullptr;  // null: stderr
bool g_sink_owned = false;
uint32_t g_subsystems = kAllSubsystems;
std::set<std::string> g_causes;
bool g_causes_full = false;
std::atomic<int> g_rank{-1};
std::atomic<NcclLogger> g_nccl_logger{nullptr};

int subsystem_index(const char* name) {
  for (size_t i = 0; i < std::size(kSubsystems); ++i)
    if (strcmp(kSubsystems[i], name) == 0) return static_cast<int>(i);
  return -1;
}

// NCCL's ncclDebugLogLevel and ncclDebugLogSubSys values (nccl_common.h).
int nccl_level(Level level) {
  switch (level) {
    case Level::kNone: return 0;
    case Level::kVersion: return 1;
    case Level::kWarn: return 2;
    case Level::kInfo: return 3;
    case Level::kTrace: return 5;
  }
  return 3;
}
unsigned long nccl_flags(Level level, const char* subsystem) {
  constexpr unsigned long kInit = 0x1, kColl = 0x2, kNet = 0x10, kAll = ~0ul;
  // NCCL drops lines whose flags miss NCCL_DEBUG_SUBSYS (INIT,BOOTSTRAP,ENV by default);
  // its own WARN lines carry NCCL_ALL, and so do ours.
  if (level == Level::kWarn) return kAll;
  if (!strcmp(subsystem, "INIT") || !strcmp(subsystem, "CONFIG")) return kInit;
  if (!strcmp(subsystem, "NET")) return kNet;
  return kColl;
}

// Whether NCCL's logger prints WARN lines: NCCL_DEBUG is WARN or more.
bool nccl_prints_warnings() {
  const char* v = getenv("NCCL_DEBUG");
  if (!v) return false;
  for (const char* level : {"WARN", "INFO", "ABORT", "TRACE"})
    if (strcasecmp(v, level) == 0) return true;
  return false;
}

void write_line(Level level, const char* subsystem, const char* message) {
  static const std::string host = [] {
    char name[64] = "?";
    gethostname(name, sizeof name - 1);
    name[sizeof name - 1] = '\0';
    return std::string(name);
  }();
  char rank[16] = "-";
  if (const int r = g_rank.load(std::memory_order_relaxed); r >= 0) snprintf(rank, sizeof rank, "%d", r);
  const NcclLogger nccl = g_nccl_logger.load(std::memory_order_acquire);
  if (nccl) nccl(nccl_level(level), nccl_flags(level, subsystem), "lgreco", 0, "LGRECO %s %s", subsystem, message);
  const bool nccl_shows_it = nccl && !(level == Level::kWarn && !nccl_prints_warnings());
  std::lock_guard<std::mutex> lock(g_mutex);
  // A file named by LGRECO_DEBUG_FILE gets every line: who set it reads it. stderr gets
  // only what NCCL's logger would not print, so that nothing shows twice.
  if (nccl_shows_it && !g_sink) return;
  FILE* out = g_sink ? g_sink : stderr;
  fprintf(out, "%s:%d:%ld [%s] LGRECO %s %s %s\n", host.c_str(), static_cast<int>(getpid()),
          static_cast<long>(syscall(SYS_gettid)), rank, level_name(level), subsystem, message);
  fflush(out);
}

void vemit(Level level, const char* subsystem, const char* format, va_list args) {
  if ((level == Level::kInfo || level == Level::kTrace)) {
    const int index = subsystem_index(subsystem);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (index >= 0 && !(g_subsystems & (1u << index))) return;
  }
  char message[1024];
  vsnprintf(message, sizeof message, format, args);  // longer messages are cut, not lost
  write_line(level, subsystem, message);
}

}  // namespace

const char* level_name(Level level) {
  switch (level) {
    case Level::kNone: return "NONE";
    case Level::kVersion: return "VERSION";
    case Level::kWarn: return "WARN";
    case Level::kInfo: return "INFO";
    case Level::kTrace: return "TRACE";
  }
  return "?";
}

bool parse_level(const char* text, Level* level) {
  for (Level l : {Level::kNone, Level::kWarn, Level::kVersion, Level::kInfo, Level::kTrace}) {
    if (strcasecmp(text, level_name(l)) == 0) {
      *level = l;
      return true;
    }
  }
  return false;
}

std::span<const char* const> subsystem_names() { return kSubsystems; }

bool parse_subsystems(const std::string& text, uint32_t* mask, std::string* error) {
  const bool invert = !text.empty() && text[0] == '^';
  uint32_t selected = 0;
  size_t begin = invert ? 1 : 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    std::string name = text.substr(begin, end - begin);
    while (!name.empty() && name.back() == ' ') name.pop_back();
    while (!name.empty() && name.front() == ' ') name.erase(0, 1);
    int index = -1;
    for (size_t i = 0; i < std::size(kSubsystems); ++i)
      if (strcasecmp(name.c_str(), kSubsystems[i]) == 0) index = static_cast<int>(i);
    if (strcasecmp(name.c_str(), "ALL") == 0) {
      selected = kAllSubsystems;
    } else if (index < 0) {
      *error = "\"" + name + "\" is not a subsystem";
      return false;
    } else {
      selected |= 1u << index;
    }
    begin = end + 1;
  }
  *mask = invert ? kAllSubsystems & ~selected : selected;
  return true;
}

int detail::init_level() {
  config::params();  // loads the parameters once and calls configure()
  const int level = g_level.load(std::memory_order_relaxed);
  return level < 0 ? static_cast<int>(Level::kWarn) : level;
}

void configure(Level level, const std::string& file_pattern, uint32_t subsystem_mask) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_subsystems = subsystem_mask;
    if (g_sink_owned) fclose(g_sink);
    g_sink = nullptr;
    g_sink_owned = false;
    if (!file_pattern.empty()) {
      std::string path, error;
      if (!config::expand_path_pattern(file_pattern, "hp", -1, &path, &error)) {
        failure = "LGRECO_DEBUG_FILE=" + file_pattern + ": " + error + "; logging to stderr";
      } else if (FILE* f = fopen(path.c_str(), "a")) {  // append: child processes share a name without %p
        g_sink = f;
        g_sink_owned = true;
      } else {
        failure = "LGRECO_DEBUG_FILE: cannot open " + path + ": " + strerror(errno) + "; logging to stderr";
      }
    }
  }
  detail::g_level.store(static_cast<int>(level), std::memory_order_relaxed);
  if (!failure.empty() && level >= Level::kWarn) emit(Level::kWarn, "CONFIG", "%s", failure.c_str());
}

void emit(Level level, const char* subsystem, const char* format, ...) {
  va_list args;
  va_start(args, format);
  vemit(level, subsystem, format, args);
  va_end(args);
}

bool warn_once(const char* subsystem, std::string_view cause, const char* format, ...) {
  bool filled = false;  // this call took the last place: say that later ones are dropped
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_causes_full) return false;
    if (!g_causes.emplace(std::string(subsystem) + '\0' + std::string(cause)).second) return false;
    filled = g_causes_full = g_causes.size() >= kMaxCauses;
  }
  va_list args;
  va_start(args, format);
  vemit(Level::kWarn, subsystem, format, args);
  va_end(args);
  if (filled) emit(Level::kWarn, subsystem, "%zu distinct warnings so far; further new ones are not logged", kMaxCauses);
  return true;
}

void set_rank(int rank) { g_rank.store(rank < 0 ? -1 : rank, std::memory_order_relaxed); }

void set_nccl_logger(NcclLogger logger) { g_nccl_logger.store(logger, std::memory_order_release); }

void reset_for_testing() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_sink_owned) fclose(g_sink);
    g_sink = nullptr;
    g_sink_owned = false;
    g_subsystems = kAllSubsystems;
    g_causes.clear();
    g_causes_full = false;
  }
  g_rank.store(-1);
  g_nccl_logger.store(nullptr);
  config::reload_params_for_testing();
  detail::g_level.store(-1, std::memory_order_relaxed);
}

}  // namespace lgreco::log
