#include "plugin/net/telemetry.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <stdexcept>

#include "config/log.h"

namespace lgreco::net {
namespace {

void add(transport::CommCounters& total, const transport::CommCounters& more) {
  total.payload_bytes += more.payload_bytes;
  total.wire_bytes += more.wire_bytes;
  total.messages += more.messages;
  total.busy_ns += more.busy_ns;
}

double bytes_per_second(uint64_t bytes, uint64_t busy_ns) {
  return busy_ns == 0 ? 0.0 : static_cast<double>(bytes) / (static_cast<double>(busy_ns) * 1e-9);
}

// Label values may hold anything (peer names come from the network); the format escapes
// exactly these three.
void append_escaped(std::string& out, const std::string& value) {
  for (char c : value) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

bool valid_label_name(const std::string& name) {
  if (name.empty() || name.starts_with("__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

void check_labels(const Labels& common) {
  std::vector<std::string> seen = {"peer", "direction", "device"};
  for (const auto& [name, value] : common) {
    if (!valid_label_name(name))
      throw std::invalid_argument("telemetry label name '" + name +
                                  "' is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)");
    for (const std::string& other : seen)
      if (other == name) throw std::invalid_argument("telemetry label '" + name + "' appears twice");
    seen.push_back(name);
  }
}

struct Metric {
  const char* name;
  const char* help;
  void (*value)(std::string& out, const transport::CommCounters& c);
};

void append_u64(std::string& out, uint64_t v) { out += std::to_string(v); }

// Busy time as an exact decimal of its nanoseconds: no rounding, and the same text for the
// same counters on every run.
void append_seconds(std::string& out, uint64_t ns) {
  char text[48];
  snprintf(text, sizeof text, "%" PRIu64 ".%09" PRIu64, ns / 1000000000u, ns % 1000000000u);
  out += text;
}

constexpr Metric kMetrics[] = {
    {"lgreco_net_payload_bytes_total", "Message payload bytes moved by lgreco's TCP transport.",
     [](std::string& out, const transport::CommCounters& c) { append_u64(out, c.payload_bytes); }},
    {"lgreco_net_wire_bytes_total", "Bytes moved by lgreco's TCP transport including message headers.",
     [](std::string& out, const transport::CommCounters& c) { append_u64(out, c.wire_bytes); }},
    {"lgreco_net_messages_total", "Messages completed by lgreco's TCP transport.",
     [](std::string& out, const transport::CommCounters& c) { append_u64(out, c.messages); }},
    {"lgreco_net_busy_seconds_total",
     "Seconds lgreco's TCP transport spent moving payload; payload bytes over this is the achieved bandwidth.",
     [](std::string& out, const transport::CommCounters& c) { append_seconds(out, c.busy_ns); }},
};

}  // namespace

const char* direction_name(Direction direction) { return direction == Direction::kSend ? "send" : "recv"; }

double PeerTraffic::bandwidth() const { return bytes_per_second(totals.payload_bytes, totals.busy_ns); }

// ---------------------------------------------------------------------------------------
// Registry

Registry::Registry(size_t max_retained_peers) : max_retained_(max_retained_peers) {}

Registry::Token Registry::register_source(PeerKey key, Source source) {
  if (!source) throw std::invalid_argument("telemetry: register_source for peer '" + key.peer + "' without a source");
  std::lock_guard lock(mutex_);
  const Token token = next_token_++;
  live_.emplace(token, Live{std::move(key), std::move(source)});
  return token;
}

void Registry::unregister(Token token) {
  std::lock_guard lock(mutex_);
  const auto it = live_.find(token);
  if (it == live_.end()) return;
  retain(it->second.key, it->second.source());
  live_.erase(it);
}

void Registry::retain(const PeerKey& key, const transport::CommCounters& counters) {
  auto it = retained_.find(key);
  if (it == retained_.end()) {
    // At the cap, a new key's bytes go to the catch-all of its direction (at most two
    // entries beyond the cap), so totals stay right while memory stays bounded.
    const PeerKey& target = retained_.size() < max_retained_ ? key : PeerKey{kOtherPeer, key.direction, ""};
    it = retained_.try_emplace(target).first;
  }
  add(it->second, counters);
}

std::vector<PeerTraffic> Registry::snapshot() const {
  std::map<PeerKey, transport::CommCounters> totals;
  {
    std::lock_guard lock(mutex_);
    totals = retained_;
    for (const auto& [token, live] : live_) add(totals[live.key], live.source());
  }
  std::vector<PeerTraffic> out;
  out.reserve(totals.size());
  for (auto& [key, counters] : totals) out.push_back({key, counters});
  return out;
}

double Registry::aggregate_bandwidth(Direction direction) const {
  uint64_t bytes = 0, busy_ns = 0;
  for (const PeerTraffic& t : snapshot()) {
    if (t.key.direction != direction) continue;
    bytes += t.totals.payload_bytes;
    busy_ns += t.totals.busy_ns;
  }
  return bytes_per_second(bytes, busy_ns);
}

size_t Registry::live_sources() const {
  std::lock_guard lock(mutex_);
  return live_.size();
}

// ---------------------------------------------------------------------------------------
// Prometheus text

Labels process_labels() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
  return {{"host", host}, {"pid", std::to_string(getpid())}};
}

std::string prometheus_text(const std::vector<PeerTraffic>& traffic, const Labels& common) {
  check_labels(common);
  // The label set is the same for every metric: build it once per entry.
  std::vector<std::string> label_sets;
  label_sets.reserve(traffic.size());
  for (const PeerTraffic& t : traffic) {
    std::string s = "{peer=\"";
    append_escaped(s, t.key.peer);
    s += "\",direction=\"";
    s += direction_name(t.key.direction);
    s += "\",device=\"";
    append_escaped(s, t.key.device);
    s += '"';
    for (const auto& [name, value] : common) {
      s += ',' + name + "=\"";
      append_escaped(s, value);
      s += '"';
    }
    s += "} ";
    label_sets.push_back(std::move(s));
  }
  std::string out;
  for (const Metric& metric : kMetrics) {
    out += std::string("# HELP ") + metric.name + ' ' + metric.help + '\n';
    out += std::string("# TYPE ") + metric.name + " counter\n";
    for (size_t i = 0; i < traffic.size(); ++i) {
      out += metric.name;
      out += label_sets[i];
      metric.value(out, traffic[i].totals);
      out += '\n';
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Writing the file

std::string write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create " + tmp + ": " + transport::errno_text(errno);
  std::string error;
  size_t done = 0;
  // Each pass writes at least one byte or ends the loop, so it runs at most text.size()
  // times (EINTR aside, which a signal storm alone could repeat).
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = "cannot write " + tmp + ": " + (n < 0 ? transport::errno_text(errno) : std::string("no progress"));
      break;
    }
    done += static_cast<size_t>(n);
  }
  // No fsync: readers need the rename's atomicity, not durability across a crash of the
  // host, and an fsync every few seconds on a network file system would cost more than
  // the telemetry is worth.
  if (::close(fd) != 0 && error.empty()) error = "cannot write " + tmp + ": " + transport::errno_text(errno);
  if (error.empty() && ::rename(tmp.c_str(), path.c_str()) != 0)
    error = "cannot rename " + tmp + " to " + path + ": " + transport::errno_text(errno);
  if (!error.empty()) ::unlink(tmp.c_str());
  return error;
}

// ---------------------------------------------------------------------------------------
// Exporter

Exporter::Exporter(const Registry& registry, std::string path, std::chrono::milliseconds interval, Labels labels)
    : registry_(registry), path_(std::move(path)), interval_(interval), labels_(std::move(labels)) {
  if (path_.empty()) throw std::invalid_argument("telemetry exporter: empty file path");
  if (interval_ <= std::chrono::milliseconds::zero())
    throw std::invalid_argument("telemetry exporter: interval must be positive, not " +
                                std::to_string(interval_.count()) + " ms");
  check_labels(labels_);
  LGRECO_INFO("NET", "telemetry: writing %s every %lld ms", path_.c_str(), static_cast<long long>(interval_.count()));
  thread_ = std::thread([this] { run(); });
}

Exporter::~Exporter() { stop(); }

void Exporter::stop() {
  std::lock_guard join_lock(join_mutex_);
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t Exporter::writes() const {
  std::lock_guard lock(mutex_);
  return writes_;
}

uint64_t Exporter::failures() const {
  std::lock_guard lock(mutex_);
  return failures_;
}

void Exporter::run() {
  // Write at once, then after every interval, and once more after stop() (the stop is
  // seen before that write's snapshot, so the last file holds the final totals).
  bool first = true;
  for (;;) {
    bool stop = false;
    {
      std::unique_lock lock(mutex_);
      if (!first) wake_.wait_for(lock, interval_, [this] { return stopping_; });
      stop = stopping_;
    }
    first = false;
    write_once();
    if (stop) return;
  }
}

bool Exporter::write_once() {
  std::string error;
  try {
    error = write_file_atomically(path_, prometheus_text(registry_.snapshot(), labels_));
  } catch (const std::exception& e) {  // a source that threw, or no memory: next time may work
    error = std::string("cannot export: ") + e.what();
  }
  {
    std::lock_guard lock(mutex_);
    ++(error.empty() ? writes_ : failures_);
  }
  if (!error.empty())
    LGRECO_WARN_ONCE("NET", "telemetry-file:" + path_, "telemetry: %s; the export goes on and retries every %lld ms",
                     error.c_str(), static_cast<long long>(interval_.count()));
  return error.empty();
}

}  // namespace lgreco::net
