#include "config/params.h"

#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "config/text_file.h"

extern char** environ;

namespace lgreco::config {

namespace {

// ---------------------------------------------------------------------------------------
// Value parsers. Each returns "" or what is wrong with the text.

std::string parse_unsigned(const std::string& text, uint64_t min, uint64_t max, uint64_t* out,
                           bool byte_suffixes = false) {
  const char* s = text.c_str();
  if (!(*s >= '0' && *s <= '9')) return "not a whole number";
  errno = 0;
  char* end = nullptr;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno == ERANGE) return "too large";
  if (byte_suffixes && *end) {
    const uint64_t scale = *end == 'K' || *end == 'k' ? 1ull << 10
                           : *end == 'M' || *end == 'm' ? 1ull << 20
                           : *end == 'G' || *end == 'g' ? 1ull << 30
                                                        : 0;
    if (scale == 0 || end[1] != '\0') return "not a whole number of bytes (optionally with K, M or G)";
    if (v > max / scale) return "too large";
    v *= scale;
    ++end;
  }
  if (*end) return "not a whole number";
  if (v < min || v > max) return "out of range";
  *out = v;
  return "";
}

std::string parse_real(const std::string& text, double min, double max, bool min_inclusive, double* out) {
  const char* s = text.c_str();
  errno = 0;
  char* end = nullptr;
  const double v = strtod(s, &end);
  if (end == s || *end || !std::isfinite(v) || errno == ERANGE) return "not a finite number";
  if (v > max || v < min || (!min_inclusive && v == min)) return "out of range";
  *out = v;
  return "";
}

template <typename T>
std::string parse_choice(const std::string& text, std::initializer_list<std::pair<const char*, T>> choices, T* out) {
  for (const auto& [name, value] : choices)
    if (strcasecmp(text.c_str(), name) == 0) {
      *out = value;
      return "";
    }
  return "not one of the accepted values";
}

std::string apply_pattern(const std::string& text, const char* allowed, std::string* out) {
  std::string expanded, error;
  if (!expand_path_pattern(text, allowed, -1, &expanded, &error)) return error;
  *out = text;
  return "";
}

std::string trim(std::string s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// The candidate list as written; resolved against LGRECO_CODEC after all values are read.
constexpr size_t kMaxCandidates = 32;
constexpr size_t kMaxConfBytes = size_t{1} << 20;

std::string apply_candidates(Params& p, const std::string& text) {
  p.candidates.clear();
  if (strcasecmp(text.c_str(), "auto") == 0) return "";  // resolved later
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(';', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = trim(text.substr(begin, end - begin));
    if (item.empty()) return "an empty item in the list";
    try {
      const CodecSpec spec = CodecSpec::parse(item);
      if (std::string problem = training_spec_problem(spec); !problem.empty()) return problem;
      if (std::find(p.candidates.begin(), p.candidates.end(), spec) != p.candidates.end())
        return "\"" + item + "\" is listed twice";
      p.candidates.push_back(spec);
    } catch (const CodecError& e) {
      return e.what();
    }
    if (p.candidates.size() > kMaxCandidates) return "more than 32 candidates";
    begin = end + 1;
  }
  return "";
}

// The default candidate set, around the default codec of its family. Quantization:
// every width from 2 to 8 bits (the paper's set), with the default codec's bucket and
// rounding. TopK: the default density times 0.1, 0.25, 0.5, 1, 2 and 5 (0.1% to 5%
// around 1%, as the paper's reference spans), those within (0, 1].
std::vector<CodecSpec> auto_candidates(const CodecSpec& codec) {
  if (codec.family() == CodecFamily::kTopk) {
    std::vector<CodecSpec> out;
    const uint64_t d = codec.topk_params().density_ppb;
    // A product below one part per billion or above 1 is left out.
    constexpr std::pair<uint64_t, uint64_t> kFactors[] = {{1, 10}, {1, 4}, {1, 2}, {1, 1}, {2, 1}, {5, 1}};
    for (const auto& [num, den] : kFactors) {
      const uint64_t ppb = d * num / den;
      if (ppb == 0 || ppb > TopkParams::kPartsPerUnit) continue;
      const CodecSpec c = CodecSpec::topk(TopkParams{static_cast<uint32_t>(ppb)});
      if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
    }
    return out;
  }
  if (codec.family() == CodecFamily::kPowersgd) {
    // Every rank in [floor(r0 / 2), ceil(2 r0)], as the L-GreCo reference's search.
    std::vector<CodecSpec> out;
    PowersgdParams p = codec.powersgd_params();
    const uint32_t r0 = p.rank;
    for (uint32_t r = std::max(1u, r0 / 2); r <= std::min(PowersgdParams::kMaxRank, 2 * r0); ++r) {
      p.rank = r;
      out.push_back(CodecSpec::powersgd(p));
    }
    return out;
  }
  if (codec.family() != CodecFamily::kQuant) return {codec};
  std::vector<CodecSpec> out;
  QuantParams q = codec.quant_params();
  for (int bits = std::min(2, q.bits); bits <= QuantParams::kMaxBits; ++bits) {
    QuantParams c = q;
    c.bits = bits;
    out.push_back(CodecSpec::quant(c));
  }
  return out;
}

#define U64(field, min, max) \
  [](Params& p, const std::string& v) { return parse_unsigned(v, min, max, &p.field); }
#define BYTES(field, min, max) \
  [](Params& p, const std::string& v) { return parse_unsigned(v, min, max, &p.field, true); }

constexpr uint64_t kMaxSteps = uint64_t{1} << 40;

const ParamInfo kParamTable[] = {
    {"LGRECO_MODE", "adaptive", "`adaptive`, `uniform`, `off`",
     "`adaptive`: L-GreCo chooses each layer's codec among the candidates. `uniform`: every compressible layer "
     "uses `LGRECO_CODEC`. `off`: every call goes to NCCL untouched.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"adaptive", Mode::kAdaptive}, {"uniform", Mode::kUniform}, {"off", Mode::kOff}},
                           &p.mode);
     }},
    {"LGRECO_REGISTRATION", "", "a path",
     "The registration file naming the layers of each gradient bucket (docs/REGISTRATION.md). Unset: auto mode.",
     [](Params& p, const std::string& v) {
       p.registration = v;
       return std::string();
     }},
    {"LGRECO_AUTO", "1", "`0`, `1`",
     "Without a registration file: `1` splits recurring buffers of at least `LGRECO_MIN_BYTES` into "
     "`LGRECO_SEGMENT_BYTES` segments that act as layers; `0` passes every call through.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"0", false}, {"1", true}}, &p.auto_mode);
     }},
    {"LGRECO_CODEC", "quant:bits=4,bucket=1024,rounding=stochastic", "a codec spec (docs/FORMAT.md)",
     "The default codec. Its total error, with alpha, is L-GreCo's error budget; `uniform` mode uses it "
     "everywhere.",
     [](Params& p, const std::string& v) {
       try {
         p.codec = CodecSpec::parse(v);
         if (std::string problem = training_spec_problem(p.codec); !problem.empty()) return problem;
         return std::string();
       } catch (const CodecError& e) {
         return std::string(e.what());
       }
     }},
    {"LGRECO_CANDIDATES", "auto", "`auto`, or codec specs separated by `;` (at most 32)",
     "The codecs L-GreCo chooses from, of one family or several (each layer then gets the family and parameter "
     "that cost least within the budget). `auto`: for a `quant` default, 2 to 8 bits with its bucket and "
     "rounding; for a `topk` default, its density times 0.1, 0.25, 0.5, 1, 2 and 5 (up to 1); for a `powersgd` "
     "default of rank r, every rank from r/2 to 2r. The default codec is always a candidate. A `powersgd` "
     "candidate applies only to layers registered with a shape of two or more dimensions whose factors are smaller "
     "than the layer; elsewhere the layer's default becomes `none`.",
     apply_candidates},
    {"LGRECO_ALPHA", "1", "a number > 0 and <= 1000",
     "The error budget: total error <= alpha x the total error of the default codec on every layer.",
     [](Params& p, const std::string& v) { return parse_real(v, 0, 1000, false, &p.alpha); }},
    {"LGRECO_OBJECTIVE", "size", "`size`, `time`",
     "What L-GreCo minimises: bytes sent, or estimated time (bytes over the measured bandwidth plus codec time).",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"size", std::string("size")}, {"time", std::string("time")}}, &p.objective);
     }},
    {"LGRECO_ERROR_METRIC", "normalized", "`normalized`, `squared`, `l2`",
     "How layers' compression errors add up in the budget: `normalized` each layer's squared error relative to "
     "its gradient's energy per value, times its values (what an Adam-family optimizer's per-coordinate "
     "normalisation sees; no layer above 4x the defaults' mean relative error); `squared` ||x - C(x)||^2 "
     "(the absolute error, for SGD); `l2` ||x - C(x)|| (the paper's).",
     [](Params& p, const std::string& v) {
       return parse_choice(v,
                           {std::pair{"normalized", std::string("normalized")},
                            {"squared", std::string("squared")},
                            {"l2", std::string("l2")}},
                           &p.error_metric);
     }},
    {"LGRECO_WARMUP", "100", "a whole number >= 2",
     "Steps at the default codec before the first measurement window ends (docs/CONTROLLER.md).",
     U64(warmup, 2, kMaxSteps)},
    {"LGRECO_PERIOD", "100", "a whole number >= 1", "Steps between re-solves.", U64(period, 1, kMaxSteps)},
    {"LGRECO_WINDOW", "10", "a whole number >= 1, at most the period",
     "Steps whose errors are measured before each solve.", U64(window, 1, kMaxSteps)},
    {"LGRECO_SWITCH_LAG", "4", "a whole number >= 1; window + lag <= period + 1",
     "Steps between the end of a window and the switch to its solution, on every rank. The window's sums are "
     "read a step after they are sent and the solution is agreed on a step before the switch, so the solver "
     "has at least lag - 3 whole steps (docs/ENGINE.md); a solve not done by the step before the switch is "
     "waited for there (one WARN).",
     U64(switch_lag, 1, kMaxSteps)},
    {"LGRECO_PROBE_LEAD", "10", "a whole number from 0 to 100000",
     "Steps before each measurement window in which the error probe already runs, so that every candidate's "
     "shadow error feedback has settled when the window measures it (docs/ENGINE.md).",
     U64(probe_lead, 0, 100000)},
    {"LGRECO_PROBE_FRACTION", "0.0625", "a number > 0 and <= 1",
     "The share of each adaptive layer's codec buckets (at least 8 of them, or all of a smaller layer) on which "
     "the error probe simulates every candidate under its own error feedback and measures the realized error. "
     "Its exchange sends 8 bytes per sampled value at each probe step.",
     [](Params& p, const std::string& v) { return parse_real(v, 0, 1, false, &p.probe_fraction); }},
    {"LGRECO_BUDGET_LOOP", "1", "`0`, `1`",
     "`1`: after each window the controller compares the error the assignment in effect realized with what it "
     "predicted, and solves the next with alpha divided by that bias (at once when the realized error was higher, "
     "halfway back when lower, never above alpha or below alpha / 4; docs/CONTROLLER.md). `0`: every solve uses "
     "`LGRECO_ALPHA`.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"0", false}, {"1", true}}, &p.budget_loop);
     }},
    {"LGRECO_SOLVER_TOLERANCE", "0.001", "a number > 0 and < 1",
     "The relative optimality gap at which the solver may stop (it reports the gap it proved).",
     [](Params& p, const std::string& v) { return parse_real(v, 0, 0.999999, false, &p.solver_tolerance); }},
    {"LGRECO_MIN_BYTES", "262144", "bytes (K, M, G suffixes allowed)",
     "Calls smaller than this go to NCCL untouched: they are latency-bound and gain nothing from compression.",
     BYTES(min_bytes, 0, uint64_t{1} << 50)},
    {"LGRECO_SEGMENT_BYTES", "1048576", "bytes >= 4096 (K, M, G suffixes allowed)",
     "Auto mode: the size of the segments a buffer is split into (in the buffer's dtype; rounded down to whole "
     "1024-element groups).",
     BYTES(segment_bytes, 4096, uint64_t{1} << 40)},
    {"LGRECO_MAX_MEMORY", "0", "bytes (K, M, G suffixes allowed); `0`: no cap",
     "The most memory lgreco may hold per communicator: device memory for the error-feedback residuals (a "
     "float32 copy of every compressed gradient), staging and statistics, plus pinned host memory for "
     "read-backs. A communicator that would need more passes through on every rank, with one WARN.",
     BYTES(max_memory, 0, uint64_t{1} << 50)},
    {"LGRECO_ERROR_FEEDBACK", "1", "`0`, `1`",
     "`1`: each rank keeps what compression lost (a float32 residual per compressed element) and adds it to the "
     "next step's gradient, so errors do not accumulate. `0`: one-shot compression, no residual memory.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"0", false}, {"1", true}}, &p.error_feedback);
     }},
    {"LGRECO_ALGORITHM", "auto", "`auto`, `sra`, `allgather`",
     "How compressed buckets are reduced: `sra` (scatter-reduce-allgather: each rank reduces one partition and "
     "re-encodes it), `allgather` (every rank decodes and sums every rank's encoding; one quantization, more "
     "bytes from 3 ranks on). `auto`: allgather for 2 ranks or small buckets, else sra.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"auto", std::string("auto")}, {"sra", std::string("sra")},
                               {"allgather", std::string("allgather")}}, &p.algorithm);
     }},
    {"LGRECO_RENDEZVOUS_PORT", "", "a port, 1 to 65535",
     "The socket fabric (`lgreco-bench --fabric socket`): the port of rank 0's rendezvous on MASTER_ADDR. Unset: "
     "MASTER_PORT, or MASTER_PORT + 1 under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True), which "
     "holds MASTER_PORT.",
     [](Params& p, const std::string& v) {
       return v.empty() ? (p.rendezvous_port = 0, std::string()) : parse_unsigned(v, 1, 65535, &p.rendezvous_port);
     }},
    {"LGRECO_NET", "auto", "`auto`, `socket`, `off`",
     "The net plugin (`NCCL_NET_PLUGIN=lgreco`): which transport NCCL gets from lgreco. `socket`: lgreco's TCP "
     "transport (several sockets and helper threads per connection, per-peer telemetry). `auto`: the same, but only "
     "where the host has no RDMA device, so that InfiniBand and RoCE clusters keep NCCL's own IB transport. `off`: "
     "no devices (NCCL uses its own transports). Compression (the collective shim) is installed in every case.",
     [](Params& p, const std::string& v) {
       return parse_choice(v, {std::pair{"auto", std::string("auto")}, {"socket", std::string("socket")},
                               {"off", std::string("off")}}, &p.net);
     }},
    {"LGRECO_SOCKET_IFNAME", "",
     "interface names in `NCCL_SOCKET_IFNAME`'s syntax: prefixes separated by `,`; a "
     "leading `^` excludes them, a leading `=` asks for exact names",
     "The net plugin: which network interfaces become NCCL devices. Unset: as NCCL chooses (interfaces named `ib*` "
     "first, else every interface except `docker*`, `lo` and `virbr*`, else `lo`).",
     [](Params& p, const std::string& v) {
       if (v.size() > 255) return std::string("longer than 255 characters");
       p.socket_ifname = v;
       return std::string();
     }},
    {"LGRECO_SOCKET_NTHREADS", "2", "a whole number from 0 to 16; threads x sockets per thread <= 64",
     "The net plugin: helper threads per connection that move a large message's bytes in parallel (as "
     "`NCCL_SOCKET_NTHREADS`). `0`: NCCL's proxy thread moves them when it tests a request.",
     U64(socket_nthreads, 0, 16)},
    {"LGRECO_NSOCKS_PERTHREAD", "2", "a whole number from 1 to 64; threads x sockets per thread <= 64",
     "The net plugin: TCP connections per helper thread (as `NCCL_NSOCKS_PERTHREAD`); with 0 threads, the "
     "connections per NCCL connection. Large messages are split across them.",
     U64(nsocks_perthread, 1, 64)},
    {"LGRECO_TELEMETRY_FILE", "", "a path; `%h` host, `%p` pid, `%%` a percent sign",
     "The net plugin: every `LGRECO_TELEMETRY_INTERVAL` seconds, write bytes, messages and busy time per peer in "
     "Prometheus text format to this file (replaced atomically; for node_exporter's textfile collector, name it "
     "`*.prom`). Unset: no export.",
     [](Params& p, const std::string& v) { return apply_pattern(v, "hp", &p.telemetry_file); }},
    {"LGRECO_TELEMETRY_INTERVAL", "10", "seconds, a whole number from 1 to 3600",
     "The net plugin: seconds between telemetry exports.", U64(telemetry_interval, 1, 3600)},
    {"LGRECO_TIMEOUT", "300", "seconds, a whole number from 1 to 86400",
     "The longest lgreco waits for a peer rank during a compressed exchange over its own sockets before it "
     "reports an error naming the rank (a dead or stalled process must not hang the others forever). Through "
     "NCCL (the shim), waiting is NCCL's and the framework's; lgreco then WARNs at this interval while its "
     "configuration exchange waits for ranks.",
     U64(timeout_seconds, 1, 86400)},
    {"LGRECO_DECISION_LOG", "", "a path; `%h` host, `%p` pid, `%r` rank, `%%` a percent sign",
     "Appends one JSON line per solved assignment (docs/CONTROLLER.md). Unset: no log.",
     [](Params& p, const std::string& v) { return apply_pattern(v, "hpr", &p.decision_log); }},
    {"LGRECO_DEBUG", "WARN", "`NONE`, `WARN`, `VERSION`, `INFO`, `TRACE` (any case)",
     "What the library logs. `WARN`: problems, including every fallback to uncompressed NCCL. `VERSION`: also "
     "one line at load with lgreco's, NCCL's and CUDA's versions. `INFO`, `TRACE`: more detail.",
     [](Params& p, const std::string& v) {
       return log::parse_level(v.c_str(), &p.debug_level) ? std::string() : std::string("not a level");
     }},
    {"LGRECO_DEBUG_FILE", "", "a path; `%h` host, `%p` pid, `%%` a percent sign",
     "Where log lines go, appended (LD_PRELOAD reaches every child process: use `%p` for one file per process). Unset: "
     "stderr.",
     [](Params& p, const std::string& v) { return apply_pattern(v, "hp", &p.debug_file); }},
    {"LGRECO_DEBUG_SUBSYS", "ALL",
     "`ALL`, or a comma-separated list of `INIT`, `CONFIG`, `CTRL`, `CODEC`, `ENGINE`, `SHIM`, `NET`; a leading "
     "`^` excludes them",
     "Which subsystems' INFO and TRACE lines are logged (WARN lines always are).",
     [](Params& p, const std::string& v) {
       std::string error;
       return log::parse_subsystems(v, &p.debug_subsys, &error) ? std::string() : error;
     }},
    {"LGRECO_CONF_FILE", "", "a path (environment only)",
     "The parameter file to read instead of `~/.lgreco.conf` or `/etc/lgreco.conf`.",
     [](Params&, const std::string&) { return std::string(); }},  // read before the others
};

#undef U64
#undef BYTES

bool reserved_name(const std::string& name) { return name.rfind("LGRECO_TEST_", 0) == 0; }

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string unknown_name_text(const std::string& name) {
  std::string text = name + " is not an lgreco parameter";
  const ParamInfo* best = nullptr;
  size_t best_distance = 4;  // suggest only near misses
  for (const ParamInfo& info : kParamTable) {
    const size_t d = edit_distance(name, info.name);
    if (d < best_distance) best_distance = d, best = &info;
  }
  if (best) text += std::string(" (did you mean ") + best->name + "?)";
  return text + "; ignored";
}

struct Value {
  std::string text;
  Origin origin;
};

// Reads KEY=VALUE lines into `values`.
void read_conf_text(const std::string& text, const std::string& file, std::map<std::string, Value>* values,
                    Params* params) {
  int line_number = 0;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = trim(text.substr(begin, end - begin));
    begin = end + 1;
    ++line_number;
    const std::string where = file + ":" + std::to_string(line_number);
    if (line.empty() || line[0] == '#') continue;
    if (std::any_of(line.begin(), line.end(), [](char c) { return (c >= 0 && c < 0x20 && c != '\t') || c == 0x7f; })) {
      params->warnings.push_back(where + ": holds a control character (a binary file?); line ignored");
      continue;
    }
    const size_t equals = line.find('=');
    if (equals == std::string::npos || equals == 0) {
      params->warnings.push_back(where + ": not a KEY=VALUE line; ignored");
      continue;
    }
    const std::string key = trim(line.substr(0, equals));
    const std::string value = trim(line.substr(equals + 1));
    if (key == "LGRECO_CONF_FILE") {
      params->warnings.push_back(where + ": LGRECO_CONF_FILE is read only from the environment; ignored");
      continue;
    }
    if (!find_param(key)) {
      params->warnings.push_back(where + ": " + unknown_name_text(key));
      continue;
    }
    if (value.empty()) continue;  // empty counts as unset
    if (const auto it = values->find(key); it != values->end())
      params->warnings.push_back(where + ": " + key + " is also set at line " + std::to_string(it->second.origin.line) +
                                 "; this line wins");
    (*values)[key] = Value{value, Origin{Origin::Kind::kFile, file, line_number}};
  }
}

// Finds and reads the parameter file into `values`.
void read_conf_file(const ParamSources& sources, const std::string& named, std::map<std::string, Value>* values,
                    Params* params) {
  std::vector<std::string> paths;
  if (!named.empty()) {
    paths = {named};
  } else {
    if (!sources.home.empty()) paths.push_back(sources.home + "/.lgreco.conf");
    paths.push_back("/etc/lgreco.conf");
  }
  for (const std::string& path : paths) {
    bool missing = false;
    std::string error;
    const std::optional<std::string> text = sources.read_file ? sources.read_file(path, &missing, &error)
                                                              : std::nullopt;
    if (text) {
      params->conf_file = path;
      read_conf_text(*text, path, values, params);
      return;
    }
    if (!named.empty()) {  // asked for by name: not finding it is an error
      params->errors.push_back("LGRECO_CONF_FILE=" + named + ": cannot read: " +
                               (missing ? std::string("no such file") : error));
      return;
    }
    if (!missing) params->warnings.push_back(path + ": cannot read: " + error + "; not used");
  }
}

}  // namespace

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kAdaptive: return "adaptive";
    case Mode::kUniform: return "uniform";
    case Mode::kOff: return "off";
  }
  return "?";
}

std::string Origin::str() const {
  switch (kind) {
    case Kind::kDefault: return "default";
    case Kind::kEnvironment: return "environment";
    case Kind::kFile: return file + ":" + std::to_string(line);
  }
  return "?";
}

const Params::Entry* Params::entry(std::string_view name) const {
  for (const Entry& e : entries)
    if (name == e.name) return &e;
  return nullptr;
}

std::span<const ParamInfo> param_table() { return kParamTable; }

const ParamInfo* find_param(std::string_view name) {
  for (const ParamInfo& info : kParamTable)
    if (name == info.name) return &info;
  return nullptr;
}

ParamSources ParamSources::from_process() {
  ParamSources sources;
  for (char** e = environ; e && *e; ++e) {
    const char* entry = *e;
    if (strncmp(entry, "LGRECO_", 7) != 0) continue;
    const char* equals = strchr(entry, '=');
    if (!equals) continue;
    sources.environment.emplace_back(std::string(entry, equals), std::string(equals + 1));
  }
  if (const char* home = getenv("HOME")) sources.home = home;
  sources.read_file = [](const std::string& path, bool* missing, std::string* error) -> std::optional<std::string> {
    TextFile file = read_text_file(path, kMaxConfBytes);  // a parameter file is a few lines
    *missing = file.missing;
    *error = file.status == TextFile::Status::kTooLarge ? "larger than 1 MiB; not a parameter file" : file.error;
    if (file.status != TextFile::Status::kOk) return std::nullopt;
    return std::move(file.text);
  };
  return sources;
}

Params load_params(const ParamSources& sources) {
  Params params;
  std::map<std::string, Value> values;
  std::string named_file;
  std::map<std::string, Value> environment;
  for (const auto& [name, text] : sources.environment) {
    if (reserved_name(name)) continue;
    if (!find_param(name)) {
      params.warnings.push_back("environment: " + unknown_name_text(name));
      continue;
    }
    if (trim(text).empty()) continue;  // empty counts as unset: the file's value applies
    environment[name] = Value{text, Origin{Origin::Kind::kEnvironment, "", 0}};
    if (name == "LGRECO_CONF_FILE") named_file = trim(text);
  }
  read_conf_file(sources, named_file, &values, &params);
  for (auto& [name, value] : environment) values[name] = value;  // the environment wins

  for (const ParamInfo& info : kParamTable) {
    Params::Entry entry{info.name, info.default_value, Origin{}};
    if (const auto it = values.find(info.name); it != values.end() && !trim(it->second.text).empty()) {
      entry.value = trim(it->second.text);
      entry.origin = it->second.origin;
    }
    const std::string error = info.apply(params, entry.value);
    if (!error.empty()) {
      const std::string where = entry.origin.kind == Origin::Kind::kDefault ? "" : " (" + entry.origin.str() + ")";
      std::string accepted = info.accepted;  // Markdown for the docs; plain in a message
      std::erase(accepted, '`');
      params.errors.push_back(std::string(info.name) + "=" + entry.value + where + ": " + error + "; accepted: " +
                              accepted);
      info.apply(params, info.default_value);  // keep a consistent value for display
    }
    params.entries.push_back(std::move(entry));
  }

  // Rules across parameters.
  if (std::string e = schedule_error(params); !e.empty()) params.errors.push_back(std::move(e));
  if (params.socket_nthreads * params.nsocks_perthread > 64)
    params.errors.push_back("LGRECO_SOCKET_NTHREADS=" + std::to_string(params.socket_nthreads) +
                            " x LGRECO_NSOCKS_PERTHREAD=" + std::to_string(params.nsocks_perthread) +
                            ": more than 64 sockets per connection; accepted: a product of at most 64");
  if (params.candidates.empty()) {  // `auto`
    params.candidates = auto_candidates(params.codec);
  } else if (std::find(params.candidates.begin(), params.candidates.end(), params.codec) == params.candidates.end()) {
    params.candidates.push_back(params.codec);  // the budget is defined by it: always feasible
    if (params.candidates.size() > kMaxCandidates)
      params.errors.push_back("LGRECO_CANDIDATES: 32 candidates and the default codec (" + params.codec.str() +
                              ") make 33; accepted: at most 32 with the default codec among them");
  }
  return params;
}

namespace {
std::mutex g_params_mutex;
std::atomic<const Params*> g_params{nullptr};
}  // namespace

const Params& params() {
  if (const Params* p = g_params.load(std::memory_order_acquire)) return *p;
  const Params* loaded = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_params_mutex);
    if (const Params* p = g_params.load(std::memory_order_acquire)) return *p;
    // Never freed: log lines from static destructors at exit may still read it.
    loaded = new Params(load_params(ParamSources::from_process()));
    log::configure(loaded->debug_level, loaded->debug_file, loaded->debug_subsys);
    g_params.store(loaded, std::memory_order_release);
  }
  if (!loaded->conf_file.empty()) LGRECO_INFO("CONFIG", "read parameters from %s", loaded->conf_file.c_str());
  for (const std::string& w : loaded->warnings) LGRECO_WARN("CONFIG", "%s", w.c_str());
  for (const std::string& e : loaded->errors) LGRECO_WARN("CONFIG", "%s", e.c_str());
  if (!loaded->valid())
    LGRECO_WARN("CONFIG", "invalid configuration (%zu error%s above): compression is off in this process",
                loaded->errors.size(), loaded->errors.size() == 1 ? "" : "s");
  return *loaded;
}

void reload_params_for_testing() { g_params.store(nullptr, std::memory_order_release); }

std::string params_markdown_table() {
  std::string out = "| parameter | default | accepted | meaning |\n| --- | --- | --- | --- |\n";
  for (const ParamInfo& info : kParamTable) {
    const std::string def = *info.default_value ? "`" + std::string(info.default_value) + "`" : "unset";
    out += std::string("| `") + info.name + "` | " + def + " | " + info.accepted + " | " + info.meaning + " |\n";
  }
  return out;
}

std::string schedule_rule_violation(uint64_t warmup, uint64_t period, uint64_t window, uint64_t switch_lag) {
  const auto n = [](uint64_t v) { return std::to_string(v); };
  if (warmup < 2) return "warmup " + n(warmup) + ": must be at least 2 (DDP rebuilds its buckets after its first step)";
  if (period < 1) return "period 0: must be at least 1";
  if (window < 1 || window > period)
    return "window " + n(window) + ": must be between 1 and the period (" + n(period) + ")";
  if (switch_lag < 1) return "switch lag 0: must be at least 1";
  if (window + switch_lag > period + 1)
    return "window " + n(window) + " + switch lag " + n(switch_lag) + ": must be at most period + 1 (" +
           n(period + 1) + "), so that each assignment is in effect before the next window measures";
  return "";
}

std::string schedule_error(const Params& p) {
  const std::string v = schedule_rule_violation(p.warmup, p.period, p.window, p.switch_lag);
  if (v.empty()) return v;
  return "LGRECO_WARMUP=" + std::to_string(p.warmup) + ", LGRECO_PERIOD=" + std::to_string(p.period) +
         ", LGRECO_WINDOW=" + std::to_string(p.window) + ", LGRECO_SWITCH_LAG=" + std::to_string(p.switch_lag) +
         ": " + v;
}

bool expand_path_pattern(const std::string& pattern, const char* allowed, int rank, std::string* path,
                         std::string* error) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%') {
      out += pattern[i];
      continue;
    }
    const char c = i + 1 < pattern.size() ? pattern[i + 1] : '\0';
    ++i;
    if (c == '%') {
      out += '%';
    } else if (c != '\0' && strchr(allowed, c)) {
      if (c == 'h') {
        char host[256] = "unknown";
        gethostname(host, sizeof host - 1);
        host[sizeof host - 1] = '\0';
        out += host;
      } else if (c == 'p') {
        out += std::to_string(getpid());
      } else if (c == 'r') {
        out += std::to_string(rank);
      }
    } else {
      std::string accepted;
      for (const char* a = allowed; *a; ++a) accepted += std::string(accepted.empty() ? "%" : ", %") + *a;
      *error = (c ? "%" + std::string(1, c) : std::string("a lone % at the end")) + " is not a pattern sequence (" +
               accepted + ", %% accepted)";
      return false;
    }
  }
  *path = out;
  return true;
}

}  // namespace lgreco::config
