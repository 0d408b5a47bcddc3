// lgreco-transport-bench: throughput of the TCP transport (plugin/transport/tcp_transport.h)
// between two processes over 127.0.0.1, one SendComm -> RecvComm, for several
// configurations of sockets per connection x helper threads per side, as a table in the
// style of nccl-tests.
//
// The parent is the receiver, a forked child the sender; a pipe carries the listen handle
// and one "go" byte per message. Each timed message: the receiver posts its irecv, writes
// "go", and waits for completion; the time is from "go" to completion, so it includes one
// pipe wake-up (tens of microseconds) and the transport's whole path. Without helper
// threads both sides poll() their comm's fd() and call test() (the socket fabric's way);
// with threads they call test() every 20 microseconds (the threads move the bytes; a
// caller that spins would take a core from them on a small machine). Each received
// message is checked against the sent bytes once per size, outside the timing.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "config/version.h"
#include "plugin/transport/tcp_transport.h"
#include "tools/bench_util.h"

namespace lgreco {
namespace {

using namespace std::chrono_literals;
using transport::Progress;

const char kUsage[] = R"(usage: lgreco-transport-bench [--quick] [--repeats N] [--max-mib M] [--configs LIST]

Sends messages of 1 MiB to M MiB (powers of 4; default 256) from a child process to this
one over 127.0.0.1 and reports GB/s (10^9 bytes per second) as the median of N timed
messages per size (default 9, after one warm-up), for each configuration in LIST
(sockets x helper threads per side, default 1x0,2x0,1x1,2x1,2x2,4x2). --quick: 5
repeats, up to 64 MiB (under 20 s). Every cell stops early after 3 s of messages.
)";

struct Config {
  int sockets = 1;
  int threads = 0;
};

bool parse_configs(const std::string& text, std::vector<Config>* out) {
  out->clear();
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    Config c;
    if (sscanf(text.substr(at, comma - at).c_str(), "%dx%d", &c.sockets, &c.threads) != 2) return false;
    if (!transport::check_options({c.sockets, c.threads, transport::kDefaultUserTimeout}, c.sockets).empty())
      return false;
    out->push_back(c);
    at = comma + 1;
  }
  return !out->empty();
}

void write_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n <= 0) {
      perror("lgreco-transport-bench: pipe write");
      _exit(2);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

bool read_all(int fd, void* data, size_t size) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Waits for `request` by polling the comm (no threads) or sleeping briefly (threads).
template <typename Comm>
bool wait(Comm& comm, transport::Request* request, uint64_t* sizes, std::chrono::seconds limit = 60s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool done = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (comm.test(request, &done, sizes) == Progress::kError) {
      fprintf(stderr, "lgreco-transport-bench: %s\n", comm.error().c_str());
      return false;
    }
    if (done) return true;
    if (comm.helper_threads() > 0) {
      std::this_thread::sleep_for(20us);
    } else {
      pollfd p{comm.fd(), comm.poll_events(), 0};
      ::poll(&p, 1, 10);
    }
  }
  fprintf(stderr, "lgreco-transport-bench: no progress for %lld s\n", static_cast<long long>(limit.count()));
  return false;
}

constexpr uint64_t kCommId = 0x6c67726563306265;

// The child: for each configuration, connects to the handle it is sent and sends one
// message of the size it is told for every "go".
int run_sender(int from_parent, const std::vector<Config>& configs, const std::vector<uint8_t>& data) {
  for (const Config& config : configs) {
    transport::ListenHandle handle;
    if (!read_all(from_parent, &handle, sizeof handle)) return 1;
    transport::ConnectionOptions options;
    options.helper_threads = config.threads;
    auto pending = transport::connect(handle, {kCommId, 0}, options, 10000ms);
    Progress p;
    while ((p = pending->step()) == Progress::kPending) {
      pollfd f{pending->fd(), pending->poll_events(), 0};
      ::poll(&f, 1, 10);
    }
    if (p != Progress::kDone) {
      fprintf(stderr, "lgreco-transport-bench: connect: %s\n", pending->error().c_str());
      return 1;
    }
    auto send = pending->take();
    for (;;) {
      uint64_t size = 0;
      if (!read_all(from_parent, &size, sizeof size)) return 1;
      if (size == 0) break;  // next configuration
      transport::Request* r = send->isend(data.data(), size, 1);
      if (!r || !wait(*send, r, nullptr)) return 1;
    }
  }
  return 0;
}

int run(int argc, char** argv) {
  int repeats = 9;
  int max_mib = 256;
  std::string config_text = "1x0,2x0,1x1,2x1,2x2,4x2";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      repeats = 5;
      max_mib = 64;
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = atoi(argv[++i]);
    } else if (a == "--max-mib" && i + 1 < argc) {
      max_mib = atoi(argv[++i]);
    } else if (a == "--configs" && i + 1 < argc) {
      config_text = argv[++i];
    } else {
      fputs(kUsage, a == "--help" || a == "-h" ? stdout : stderr);
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  std::vector<Config> configs;
  if (repeats < 1 || max_mib < 1 || max_mib > 4096 || !parse_configs(config_text, &configs)) {
    fputs(kUsage, stderr);
    return 2;
  }
  std::vector<uint64_t> sizes;
  for (uint64_t s = uint64_t{1} << 20; s <= (uint64_t{static_cast<unsigned>(max_mib)} << 20); s *= 4) sizes.push_back(s);
  const uint64_t largest = sizes.back();

  std::vector<uint8_t> data(largest);
  std::mt19937_64 rng(12345);
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    const uint64_t v = rng();
    memcpy(&data[i], &v, 8);
  }

  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) {
    perror("pipe");
    return 1;
  }
  const pid_t child = fork();
  if (child < 0) {
    perror("fork");
    return 1;
  }
  if (child == 0) {
    close(pipe_fds[1]);
    _exit(run_sender(pipe_fds[0], configs, data));
  }
  close(pipe_fds[0]);
  const int to_child = pipe_fds[1];

  printf("# lgreco-transport-bench %s: one SendComm -> RecvComm, two processes over 127.0.0.1\n",
         version_string());
  printf("# %s, %u hardware threads, %s\n", bench::cpu_model().c_str(), std::thread::hardware_concurrency(),
         bench::utc_now().c_str());
  printf("# median of %d messages per size after one warm-up%s; GB/s = 10^9 bytes/s; config = sockets x threads\n",
         repeats, quick ? " (--quick)" : "");
  printf("#\n# %12s  %6s  %12s  %8s\n", "size(B)", "config", "time(us)", "GB/s");

  std::vector<std::vector<double>> table(configs.size(), std::vector<double>(sizes.size(), 0));
  std::vector<uint8_t> in(largest);
  int status = 0;
  for (size_t c = 0; c < configs.size() && status == 0; ++c) {
    const Config& config = configs[c];
    transport::ConnectionOptions options;
    options.sockets = config.sockets;
    options.helper_threads = config.threads;
    auto listener = transport::listen(transport::SocketAddress::resolve("127.0.0.1", 0), {kCommId, 1}, options);
    write_all(to_child, &listener->handle(), sizeof(transport::ListenHandle));
    auto pending = listener->accept(options, 10000ms);
    Progress p;
    while ((p = pending->step()) == Progress::kPending) {
      pollfd f{pending->fd(), pending->poll_events(), 0};
      ::poll(&f, 1, 10);
    }
    if (p != Progress::kDone) {
      fprintf(stderr, "lgreco-transport-bench: accept: %s\n", pending->error().c_str());
      status = 1;
      break;
    }
    auto recv = pending->take();
    for (size_t s = 0; s < sizes.size() && status == 0; ++s) {
      const uint64_t size = sizes[s];
      std::vector<double> times;
      const auto cell_end = std::chrono::steady_clock::now() + 3s;
      for (int r = -1; r < repeats && status == 0; ++r) {
        void* buffer = in.data();
        const int tag = 1;
        transport::Request* request = recv->irecv(1, &buffer, &size, &tag);
        const auto start = std::chrono::steady_clock::now();
        write_all(to_child, &size, sizeof size);
        uint64_t got = 0;
        if (!request || !wait(*recv, request, &got) || got != size) {
          status = 1;
          break;
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (r == -1 && memcmp(in.data(), data.data(), size) != 0) {
          fprintf(stderr, "lgreco-transport-bench: %llu bytes arrived corrupted\n", static_cast<unsigned long long>(size));
          status = 1;
        }
        if (r >= 0) times.push_back(seconds);
        if (r >= 2 && std::chrono::steady_clock::now() > cell_end) break;
      }
      if (status != 0) break;
      std::sort(times.begin(), times.end());
      const double median = times[times.size() / 2];
      table[c][s] = static_cast<double>(size) / median / 1e9;
      printf("  %12llu  %3dx%-2d  %12.1f  %8.3f\n", static_cast<unsigned long long>(size), config.sockets,
             config.threads, median * 1e6, table[c][s]);
      fflush(stdout);
    }
    const uint64_t end = 0;
    write_all(to_child, &end, sizeof end);
  }
  close(to_child);
  int child_status = 0;
  waitpid(child, &child_status, 0);
  if (status == 0 && !(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0)) status = 1;
  if (status != 0) {
    fprintf(stderr, "lgreco-transport-bench: FAILED\n");
    return 1;
  }

  // The same numbers as one matrix, GB/s, ready for docs/PERF.md.
  printf("#\n# GB/s, sockets x threads per side:\n| size |");
  for (const Config& config : configs) printf(" %dx%d |", config.sockets, config.threads);
  printf("\n| ---: |");
  for (size_t c = 0; c < configs.size(); ++c) printf(" ---: |");
  printf("\n");
  for (size_t s = 0; s < sizes.size(); ++s) {
    printf("| %llu MiB |", static_cast<unsigned long long>(sizes[s] >> 20));
    for (size_t c = 0; c < configs.size(); ++c) printf(" %.2f |", table[c][s]);
    printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) { return lgreco::run(argc, argv); }
