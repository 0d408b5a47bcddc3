// Net plugin telemetry: per-peer totals across comms that open and close, the cap on
// retained peers, snapshots while other threads count and churn comms (exact totals at
// the end, never decreasing on the way), the Prometheus text format checked line by line,
// and the exporter: the file it writes, replaced atomically under a polling reader, an
// unwritable path (one WARN, no crash), and a prompt stop.
#include "plugin/net/telemetry.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/test/unit_test.hpp>
#include <chrono>
#include <filesystem>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "config/log.h"
#include "tests/unit/test_util.h"

namespace lgreco::net {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::contains;
using test::count_of;
using test::eventually;
using transport::CommCounters;

// A comm's counters as the transport keeps them: atomics any thread may read.
struct FakeComm {
  std::atomic<uint64_t> payload{0}, wire{0}, messages{0}, busy_ns{0};
  std::atomic<int> reads{0};
  void move(uint64_t bytes, uint64_t ns) {
    payload += bytes;
    wire += bytes + 16;
    messages += 1;
    busy_ns += ns;
  }
  Registry::Source source() {
    return [this] {
      reads += 1;
      return CommCounters{payload.load(), wire.load(), messages.load(), busy_ns.load()};
    };
  }
};

const PeerTraffic* find(const std::vector<PeerTraffic>& traffic, const PeerKey& key) {
  for (const auto& t : traffic)
    if (t.key == key) return &t;
  return nullptr;
}

uint64_t total_payload(const std::vector<PeerTraffic>& traffic) {
  uint64_t sum = 0;
  for (const auto& t : traffic) sum += t.totals.payload_bytes;
  return sum;
}


// Checks a whole exposition-format text: every line is a HELP, a TYPE or a sample; each
// metric's HELP and TYPE come once, before its samples; its samples are contiguous; label
// values are escaped; the text ends with a newline. Returns "" or what is wrong.
std::string exposition_problem(const std::string& text) {
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) [^\n]*)");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|untyped|histogram|summary))");
  static const std::regex sample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")*\} [0-9]+(\.[0-9]+)?)");
  if (!text.empty() && text.back() != '\n') return "no newline at the end";
  std::istringstream in(text);
  std::string line, current;  // the metric whose samples may follow now
  std::vector<std::string> typed, helped;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    std::smatch m;
    const std::string where = "line " + std::to_string(number) + " '" + line + "': ";
    if (std::regex_match(line, m, help)) {
      if (std::find(helped.begin(), helped.end(), m[1].str()) != helped.end()) return where + "second HELP";
      helped.push_back(m[1]);
    } else if (std::regex_match(line, m, type)) {
      if (std::find(typed.begin(), typed.end(), m[1].str()) != typed.end()) return where + "second TYPE";
      typed.push_back(m[1]);
      current = m[1];
    } else if (std::regex_match(line, m, sample)) {
      if (m[1].str() != current) return where + "sample outside its metric's block";
    } else {
      return where + "not HELP, TYPE or a sample";
    }
  }
  return "";
}

struct LogToFile {
  test::TempDir dir;
  std::string path = dir.file("log.txt");
  LogToFile() {
    log::reset_for_testing();
    log::configure(log::Level::kWarn, path, ~0u);
  }
  ~LogToFile() { log::reset_for_testing(); }
  std::string text() const { return test::read_text(path); }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(telemetry)

BOOST_AUTO_TEST_CASE(totals_survive_closed_comms) {
  Registry registry;
  const PeerKey a_send{"10.0.0.2", Direction::kSend, "eth0"};
  const PeerKey a_recv{"10.0.0.2", Direction::kRecv, "eth0"};
  auto c1 = std::make_unique<FakeComm>(), c2 = std::make_unique<FakeComm>(), c3 = std::make_unique<FakeComm>();
  const auto t1 = registry.register_source(a_send, c1->source());
  const auto t2 = registry.register_source(a_send, c2->source());
  const auto t3 = registry.register_source(a_recv, c3->source());
  BOOST_TEST(t1 != 0u);
  BOOST_TEST(t1 != t2);
  BOOST_TEST(registry.live_sources() == 3u);
  c1->move(1000, 1'000'000);  // 1 ms
  c2->move(3000, 1'000'000);
  c3->move(500, 0);

  auto s = registry.snapshot();
  BOOST_REQUIRE(s.size() == 2u);
  BOOST_TEST((s[0].key == a_send));  // sorted: send before recv
  BOOST_TEST(s[0].totals.payload_bytes == 4000u);
  BOOST_TEST(s[0].totals.wire_bytes == 4032u);
  BOOST_TEST(s[0].totals.messages == 2u);
  BOOST_TEST(s[0].busy_seconds() == 0.002, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s[0].bandwidth() == 2e6, boost::test_tools::tolerance(1e-9));
  BOOST_TEST(s[1].bandwidth() == 0.0);  // no busy time: no bandwidth, not infinity

  // Closing c1 keeps its bytes; after unregister its source is never read again (the comm
  // may be gone).
  registry.unregister(t1);
  const int reads = c1->reads;
  c1.reset();
  s = registry.snapshot();
  BOOST_TEST(find(s, a_send)->totals.payload_bytes == 4000u);
  BOOST_TEST(registry.live_sources() == 2u);
  registry.unregister(t1);  // twice: ignored
  registry.unregister(0);   // never registered: ignored
  registry.unregister(12345);

  // A new comm to the same peer adds on top; closing everything keeps everything.
  auto c4 = std::make_unique<FakeComm>();
  const auto t4 = registry.register_source(a_send, c4->source());
  c4->move(6000, 2'000'000);
  c2->move(1000, 1'000'000);
  BOOST_TEST(find(registry.snapshot(), a_send)->totals.payload_bytes == 11000u);
  registry.unregister(t2);
  registry.unregister(t3);
  registry.unregister(t4);
  BOOST_TEST(registry.live_sources() == 0u);
  s = registry.snapshot();
  BOOST_TEST(find(s, a_send)->totals.payload_bytes == 11000u);
  BOOST_TEST(find(s, a_send)->totals.messages == 4u);
  BOOST_TEST(find(s, a_send)->totals.busy_ns == 5'000'000u);
  BOOST_TEST(find(s, a_recv)->totals.payload_bytes == 500u);
  BOOST_TEST(reads > 0);

  BOOST_TEST(registry.aggregate_bandwidth(Direction::kSend) == 11000 / 0.005, boost::test_tools::tolerance(1e-9));
  BOOST_TEST(registry.aggregate_bandwidth(Direction::kRecv) == 0.0);
  BOOST_CHECK_THROW(registry.register_source(a_send, nullptr), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(aggregate_bandwidth_spans_peers_and_devices) {
  Registry registry;
  FakeComm a, b, c;
  registry.register_source({"p1", Direction::kRecv, "eth0"}, a.source());
  registry.register_source({"p2", Direction::kRecv, "eth1"}, b.source());
  registry.register_source({"p2", Direction::kSend, "eth1"}, c.source());
  a.move(1'000'000, 1'000'000'000);  // 1 MB/s
  b.move(3'000'000, 1'000'000'000);  // 3 MB/s
  c.move(7, 1);
  // Total bytes over total busy time, not the mean of the rates (that would be 2 MB/s too
  // here; weighted differently below).
  BOOST_TEST(registry.aggregate_bandwidth(Direction::kRecv) == 2e6, boost::test_tools::tolerance(1e-9));
  b.move(0, 2'000'000'000);
  BOOST_TEST(registry.aggregate_bandwidth(Direction::kRecv) == 1e6, boost::test_tools::tolerance(1e-9));
  BOOST_TEST(registry.aggregate_bandwidth(Direction::kSend) == 7e9, boost::test_tools::tolerance(1e-9));
}

BOOST_AUTO_TEST_CASE(retained_peers_are_capped_without_losing_bytes) {
  Registry registry(3);
  uint64_t expected = 0;
  for (int i = 0; i < 10; ++i) {
    FakeComm comm;
    const auto token = registry.register_source({"peer" + std::to_string(i), Direction::kSend, "eth0"}, comm.source());
    comm.move(100 + i, 1000);
    expected += 100 + i;
    registry.unregister(token);
  }
  // A retained peer keeps counting even at the cap.
  FakeComm again;
  const auto token = registry.register_source({"peer0", Direction::kSend, "eth0"}, again.source());
  again.move(1, 1);
  registry.unregister(token);
  expected += 1;

  const auto s = registry.snapshot();
  BOOST_TEST(s.size() == 4u);  // three peers and the catch-all
  BOOST_TEST(total_payload(s) == expected);
  const PeerTraffic* other = find(s, {Registry::kOtherPeer, Direction::kSend, ""});
  BOOST_REQUIRE(other);
  BOOST_TEST(other->totals.payload_bytes == uint64_t{103 + 104 + 105 + 106 + 107 + 108 + 109});
  BOOST_TEST(other->totals.messages == 7u);
  BOOST_TEST(find(s, {"peer0", Direction::kSend, "eth0"})->totals.payload_bytes == 101u);
}

BOOST_AUTO_TEST_CASE(snapshots_while_threads_count_and_churn) {
  Registry registry;
  constexpr int kThreads = 4, kComms = 40, kMoves = 200;
  std::atomic<bool> reading{false}, workers_done{false};
  // Snapshots meanwhile: the sum over everything never goes down (a closing comm's bytes
  // move from live to retained under one lock).
  uint64_t last = 0, snapshots = 0;
  bool monotonic = true;
  std::thread reader([&] {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!workers_done && std::chrono::steady_clock::now() < deadline) {
      const uint64_t now = total_payload(registry.snapshot());
      monotonic = monotonic && now >= last;
      last = now;
      ++snapshots;
      (void)registry.aggregate_bandwidth(Direction::kSend);
      reading = true;
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < kThreads; ++w) {
    workers.emplace_back([&registry, &reading, w] {
      // Start once the reader runs, so that the two overlap (bounded: a stuck reader
      // shows up as snapshots == 0 below, not as a hang).
      const auto deadline = std::chrono::steady_clock::now() + 5s;
      while (!reading && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      for (int c = 0; c < kComms; ++c) {
        auto comm = std::make_unique<FakeComm>();
        const auto token = registry.register_source(
            {"peer" + std::to_string((w + c) % 3), c % 2 ? Direction::kSend : Direction::kRecv, "eth0"},
            comm->source());
        for (int m = 0; m < kMoves; ++m) comm->move(1, 1);
        std::this_thread::yield();
        registry.unregister(token);
      }
    });
  }
  for (auto& t : workers) t.join();
  workers_done = true;
  reader.join();
  BOOST_TEST(monotonic);
  BOOST_TEST(snapshots > 0u);
  const auto s = registry.snapshot();
  BOOST_TEST(total_payload(s) == uint64_t{kThreads * kComms * kMoves});
  BOOST_TEST(s.size() == 6u);  // 3 peers x 2 directions
  BOOST_TEST(registry.live_sources() == 0u);
}

BOOST_AUTO_TEST_CASE(prometheus_text_format_and_escaping) {
  std::vector<PeerTraffic> traffic = {
      {{"10.0.0.2", Direction::kSend, "eth0"}, {1234, 1250, 3, 1'500'000'000}},
      {{"we\"ird\\peer\nname", Direction::kRecv, "eth\"1"}, {0, 0, 0, 7}},
  };
  const Labels common = {{"host", "node\\1"}, {"pid", "42"}};
  const std::string text = prometheus_text(traffic, common);
  BOOST_TEST(exposition_problem(text) == "", text);
  BOOST_TEST(contains(text, "# TYPE lgreco_net_payload_bytes_total counter\n"));
  BOOST_TEST(contains(text,
                      "lgreco_net_payload_bytes_total{peer=\"10.0.0.2\",direction=\"send\",device=\"eth0\","
                      "host=\"node\\\\1\",pid=\"42\"} 1234\n"),
             text);
  BOOST_TEST(contains(text,
                      "lgreco_net_wire_bytes_total{peer=\"10.0.0.2\",direction=\"send\",device=\"eth0\","
                      "host=\"node\\\\1\",pid=\"42\"} 1250\n"));
  BOOST_TEST(contains(text,
                      "lgreco_net_messages_total{peer=\"10.0.0.2\",direction=\"send\",device=\"eth0\","
                      "host=\"node\\\\1\",pid=\"42\"} 3\n"));
  BOOST_TEST(contains(text,
                      "lgreco_net_busy_seconds_total{peer=\"10.0.0.2\",direction=\"send\",device=\"eth0\","
                      "host=\"node\\\\1\",pid=\"42\"} 1.500000000\n"));
  // Escaped: backslash, double quote and newline; nothing else breaks the line.
  BOOST_TEST(contains(text, "{peer=\"we\\\"ird\\\\peer\\nname\",direction=\"recv\",device=\"eth\\\"1\","), text);
  BOOST_TEST(contains(text, "} 0.000000007\n"));
  BOOST_TEST(count_of(text, "\n") == 4u * (2 + traffic.size()));
  // Deterministic: the same input, the same bytes.
  BOOST_TEST(prometheus_text(traffic, common) == text);
  // An empty registry is still a valid file (HELP and TYPE only).
  const std::string empty = prometheus_text({}, common);
  BOOST_TEST(exposition_problem(empty) == "");
  BOOST_TEST(count_of(empty, "# TYPE ") == 4u);

  // The registry's order is sorted, whatever the registration order.
  Registry registry;
  FakeComm a, b, c;
  registry.register_source({"z", Direction::kSend, "eth0"}, a.source());
  registry.register_source({"a", Direction::kRecv, "eth0"}, b.source());
  registry.register_source({"a", Direction::kSend, "eth0"}, c.source());
  const std::string sorted = prometheus_text(registry.snapshot(), {});
  BOOST_TEST(exposition_problem(sorted) == "");
  const size_t a_send = sorted.find("{peer=\"a\",direction=\"send\""),
               a_recv = sorted.find("{peer=\"a\",direction=\"recv\""),
               z_send = sorted.find("{peer=\"z\",direction=\"send\"");
  BOOST_TEST((a_send < a_recv && a_recv < z_send));
}

BOOST_AUTO_TEST_CASE(bad_common_labels_are_refused) {
  for (const Labels& labels : {Labels{{"1host", "x"}}, Labels{{"__name__", "x"}}, Labels{{"ho-st", "x"}},
                               Labels{{"", "x"}}, Labels{{"peer", "x"}}, Labels{{"host", "a"}, {"host", "b"}}}) {
    BOOST_TEST_INFO("label " << labels.back().first);
    BOOST_CHECK_THROW(prometheus_text({}, labels), std::invalid_argument);
  }
  const Labels process = process_labels();
  BOOST_REQUIRE(process.size() == 2u);
  BOOST_TEST(process[0].first == "host");
  BOOST_TEST(process[1].second == std::to_string(getpid()));
  BOOST_TEST(exposition_problem(prometheus_text({{{"p", Direction::kSend, "d"}, {}}}, process)) == "");
}

BOOST_AUTO_TEST_CASE(exporter_writes_updates_and_writes_last_on_stop) {
  test::TempDir dir;
  const std::string path = dir.file("lgreco.prom");
  Registry registry;
  FakeComm comm;
  registry.register_source({"10.0.0.2", Direction::kSend, "eth0"}, comm.source());
  comm.move(111, 5);
  Exporter exporter(registry, path, 20ms, process_labels());
  BOOST_TEST(exporter.path() == path);
  // The first write happens at once, not after an interval.
  BOOST_REQUIRE(eventually([&] { return exporter.writes() >= 1; }));
  std::string text = test::read_text(path);
  BOOST_TEST(exposition_problem(text) == "", text);
  BOOST_TEST(contains(text, "device=\"eth0\",host=\""));
  BOOST_TEST(contains(text, "} 111\n"));
  comm.move(222, 5);
  BOOST_TEST(eventually([&] { return contains(test::read_text(path), "} 333\n"); }));
  comm.move(1000, 5);
  exporter.stop();
  BOOST_TEST(contains(test::read_text(path), "} 1333\n"));  // the last write saw the final totals
  const uint64_t writes = exporter.writes();
  std::this_thread::sleep_for(60ms);
  BOOST_TEST(exporter.writes() == writes);  // stopped means stopped
  exporter.stop();                          // idempotent
  BOOST_TEST(exporter.failures() == 0u);
  // No temporary files left behind.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path())) {
    ++files;
    BOOST_TEST(entry.path().filename() == "lgreco.prom");
  }
  BOOST_TEST(files == 1);
}

BOOST_AUTO_TEST_CASE(readers_never_see_a_partial_file) {
  test::TempDir dir;
  const std::string path = dir.file("lgreco.prom");
  Registry registry;
  // About 1 MB of text, so that a non-atomic write would be caught half-way.
  std::vector<std::unique_ptr<FakeComm>> comms;
  for (int i = 0; i < 2000; ++i) {
    comms.push_back(std::make_unique<FakeComm>());
    registry.register_source({"peer-with-a-long-name-" + std::to_string(i), Direction::kRecv, "eth0"},
                             comms.back()->source());
  }
  const size_t expected_lines = 4 * (2 + comms.size());
  std::atomic<bool> stop{false};
  std::atomic<int> complete{0}, partial{0};
  std::string bad;
  std::thread reader([&] {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!stop && std::chrono::steady_clock::now() < deadline) {
      if (!fs::exists(path)) continue;  // before the first write
      const std::string text = test::read_text(path);
      if (!text.empty() && count_of(text, "\n") == expected_lines && text.back() == '\n') {
        ++complete;
      } else {
        ++partial;
        if (bad.empty()) bad = text.substr(text.size() > 200 ? text.size() - 200 : 0);
      }
    }
  });
  {
    Exporter exporter(registry, path, 1ms, {});
    // 20 writes take about 50 ms here, seconds under ThreadSanitizer.
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while ((exporter.writes() < 20 || complete < 20) && std::chrono::steady_clock::now() < deadline) {
      for (auto& c : comms) c->move(1, 1);
      std::this_thread::sleep_for(1ms);
    }
    BOOST_TEST(exporter.writes() >= 3u);
  }
  stop = true;
  reader.join();
  BOOST_TEST(complete >= 3);
  BOOST_TEST(partial == 0, "a partial file ended: " << bad);
  BOOST_TEST(exposition_problem(test::read_text(path)) == "");
}

BOOST_AUTO_TEST_CASE(unwritable_path_warns_once_and_keeps_running) {
  LogToFile log;
  test::TempDir dir;
  Registry registry;
  FakeComm comm;
  registry.register_source({"p", Direction::kSend, "eth0"}, comm.source());
  const std::string path = dir.file("missing-dir/lgreco.prom");
  {
    Exporter exporter(registry, path, 5ms, {});
    BOOST_TEST(eventually([&] { return exporter.failures() >= 3; }));
    // The directory appears: the exporter recovers without being restarted.
    fs::create_directories(dir.file("missing-dir"));
    BOOST_TEST(eventually([&] { return exporter.writes() >= 1; }));
  }
  const std::string text = log.text();
  BOOST_TEST(count_of(text, "LGRECO WARN NET telemetry: cannot create " + path + ".tmp.") == 1u, text);
  BOOST_TEST(contains(text, "No such file or directory"), text);
  BOOST_TEST(exposition_problem(test::read_text(path)) == "");

  // A path that is a directory: rename fails; warned once for that path too.
  const std::string directory = dir.file("a-directory");
  fs::create_directories(directory + "/inside");
  {
    Exporter exporter(registry, directory, 5ms, {});
    BOOST_TEST(eventually([&] { return exporter.failures() >= 2; }));
  }
  BOOST_TEST(count_of(log.text(), "cannot rename " + directory + ".tmp.") == 1u, log.text());
  BOOST_TEST(!fs::exists(directory + ".tmp." + std::to_string(getpid())));  // cleaned up
}

BOOST_AUTO_TEST_CASE(stop_is_prompt_and_bad_arguments_are_refused) {
  test::TempDir dir;
  Registry registry;
  Exporter exporter(registry, dir.file("x.prom"), std::chrono::hours(1), {});
  BOOST_REQUIRE(eventually([&] { return exporter.writes() >= 1; }));
  const auto start = std::chrono::steady_clock::now();
  exporter.stop();
  const auto took = std::chrono::steady_clock::now() - start;
  BOOST_TEST(took < std::chrono::milliseconds(500), std::chrono::duration<double>(took).count() << " s");
  BOOST_TEST(exporter.writes() == 2u);  // the first, and the last on stop

  // stop() from several threads at once (the destructor's too) joins once.
  Exporter shared(registry, dir.file("y.prom"), 10ms, {});
  std::thread a([&] { shared.stop(); }), b([&] { shared.stop(); });
  a.join();
  b.join();

  BOOST_CHECK_THROW(Exporter(registry, "", 1s, {}), std::invalid_argument);
  BOOST_CHECK_THROW(Exporter(registry, dir.file("z.prom"), 0ms, {}), std::invalid_argument);
  BOOST_CHECK_THROW(Exporter(registry, dir.file("z.prom"), 1s, {{"bad-name", "x"}}), std::invalid_argument);
  BOOST_TEST(!fs::exists(dir.file("z.prom")));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace lgreco::net
