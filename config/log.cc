#include "config/log.h"

#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace lgreco::log {
namespace detail {
std::atomic<int> g_level{-1};
}  // namespace detail

namespace {

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

std::mutex g_write_mutex;

}  // namespace

bool parse_level(const char* text, Level* level) {
  for (Level l : {Level::kNone, Level::kWarn, Level::kVersion, Level::kInfo, Level::kTrace}) {
    if (strcasecmp(text, level_name(l)) == 0) {
      *level = l;
      return true;
    }
  }
  return false;
}

int detail::init_level() {
  const char* env = getenv("LGRECO_DEBUG");
  Level level = Level::kWarn;
  const bool bad = env && *env && !parse_level(env, &level);
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
  if (bad)
    emit(Level::kWarn, "CONFIG", "LGRECO_DEBUG=%s is not a level (NONE, WARN, VERSION, INFO, TRACE); using WARN", env);
  return static_cast<int>(level);
}

void emit(Level level, const char* subsystem, const char* format, ...) {
  char host[64] = "?";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = '\0';
  char message[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);  // longer messages are cut, not lost
  va_end(args);
  std::lock_guard<std::mutex> lock(g_write_mutex);
  fprintf(stderr, "%s:%d:%ld lgreco %s %s %s\n", host, static_cast<int>(getpid()),
          static_cast<long>(syscall(SYS_gettid)), level_name(level), subsystem, message);
  fflush(stderr);
}

void reset_for_testing() { detail::g_level.store(-1, std::memory_order_relaxed); }

}  // namespace lgreco::log
