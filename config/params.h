// Every LGRECO_* parameter, in one table (kParamTable in params.cc), read from the
// environment and from a KEY=VALUE file, as NCCL reads NCCL_* and /etc/nccl.conf:
//
//   LGRECO_CONF_FILE if set (only from the environment), else ~/.lgreco.conf if it
//   exists, else /etc/lgreco.conf if it exists. The environment wins over the file.
//
// An empty value counts as unset. An invalid value is an error that names the parameter,
// where the value came from and what is accepted; a process with any error runs with
// compression off (effective_mode() is kOff), and because ranks compare configurations
// before compressing anything, every rank then passes through together. Unknown LGRECO_*
// names and malformed file lines are warnings: reported, not fatal. Names beginning
// LGRECO_TEST_ are reserved for lgreco's own test harness and ignored.
//
// docs/CONFIG.md's table is params_markdown_table(), checked by a test.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "config/log.h"
#include "kernels/codec_spec.h"

namespace lgreco::config {

enum class Mode : uint8_t { kAdaptive, kUniform, kOff };
const char* mode_name(Mode mode);

// Where a value came from.
struct Origin {
  enum class Kind : uint8_t { kDefault, kEnvironment, kFile };
  Kind kind = Kind::kDefault;
  std::string file;
  int line = 0;
  std::string str() const;  // "default", "environment", "/etc/lgreco.conf:3"
};

struct Params {
  Mode mode = Mode::kAdaptive;
  std::string registration;  // path; empty: none
  bool auto_mode = true;
  CodecSpec codec;                     // the default codec (L-GreCo's error budget)
  std::vector<CodecSpec> candidates;   // resolved; always holds `codec`
  double alpha = 1.0;
  std::string objective = "size";      // size | time
  std::string error_metric = "normalized";  // normalized | squared | l2 (controller/stats.h)
  uint64_t warmup = 100, period = 100, window = 10, switch_lag = 4;
  double solver_tolerance = 1e-3;
  uint64_t probe_lead = 10;
  double probe_fraction = 0.0625;
  bool budget_loop = true;
  uint64_t min_bytes = 256 * 1024;
  uint64_t segment_bytes = 1024 * 1024;
  uint64_t max_memory = 0;             // bytes per communicator; 0: no cap
  bool error_feedback = true;
  std::string algorithm = "auto";      // auto | sra | allgather (plugin/collective/engine.h)
  uint64_t timeout_seconds = 300;
  uint64_t rendezvous_port = 0;        // 0: unset (socket fabric: MASTER_PORT or the next)
  std::string net = "auto";            // auto | socket | off (plugin/net: which transport NCCL gets)
  std::string socket_ifname;           // NCCL_SOCKET_IFNAME syntax; empty: automatic choice
  uint64_t socket_nthreads = 2;        // helper threads per connection (0: the caller of test() moves bytes)
  uint64_t nsocks_perthread = 2;       // sockets per helper thread (per connection with 0 threads)
  std::string telemetry_file;          // Prometheus text file; pattern: %h, %p, %%; empty: no export
  uint64_t telemetry_interval = 10;    // seconds between exports
  std::string decision_log;            // pattern: %h host, %p pid, %r rank, %% a percent sign
  log::Level debug_level = log::Level::kWarn;
  std::string debug_file;              // pattern: %h, %p, %%; empty: stderr
  uint32_t debug_subsys = ~0u;         // mask over log::subsystem_names()

  // One entry per table row, in table order: the text in effect and where it came from.
  struct Entry {
    const char* name;
    std::string value;
    Origin origin;
  };
  std::vector<Entry> entries;
  std::string conf_file;              // the file that was read; empty if none
  std::vector<std::string> errors;    // invalid values: compression is off
  std::vector<std::string> warnings;  // reported, not fatal

  bool valid() const { return errors.empty(); }
  Mode effective_mode() const { return valid() ? mode : Mode::kOff; }
  const Entry* entry(std::string_view name) const;
};

// One row of the table.
struct ParamInfo {
  const char* name;
  const char* default_value;  // as text; "" for none
  const char* accepted;       // what values are accepted, for messages and docs
  const char* meaning;
  // Parses `value` into `params`; returns an error text ("not a number", ...) or "".
  std::string (*apply)(Params& params, const std::string& value);
};
std::span<const ParamInfo> param_table();
const ParamInfo* find_param(std::string_view name);

// What load_params reads. The process's environment and file system by default; tests
// fill it in by hand.
struct ParamSources {
  std::vector<std::pair<std::string, std::string>> environment;  // LGRECO_* variables
  std::string home;                                              // $HOME; empty: none
  // Returns the file's text, std::nullopt with *error set when it cannot be read, and
  // *missing = true (error unset) when it does not exist.
  std::function<std::optional<std::string>(const std::string& path, bool* missing, std::string* error)> read_file;

  static ParamSources from_process();
};

Params load_params(const ParamSources& sources);

// The process's parameters, loaded once (thread-safe), errors and warnings logged once.
const Params& params();
// For tests: the next params() reloads from the environment (not thread-safe).
void reload_params_for_testing();

// The rules of the controller's schedule (controller/schedule.h says why each holds):
// "" if they hold, else what is wrong ("window 200: must be between 1 and the period").
// Kept here so that an invalid schedule is a configuration error like any other.
std::string schedule_rule_violation(uint64_t warmup, uint64_t period, uint64_t window, uint64_t switch_lag);
// The same for the LGRECO_* schedule parameters, naming them; "" if the rules hold.
std::string schedule_error(const Params& params);

// docs/CONFIG.md's parameter table.
std::string params_markdown_table();

// Expands %h (host), %p (pid), %r (rank; -1 if unknown), %% in a path pattern. Returns
// false with *error naming the sequence on anything else.
bool expand_path_pattern(const std::string& pattern, const char* allowed, int rank, std::string* path,
                         std::string* error);

}  // namespace lgreco::config
