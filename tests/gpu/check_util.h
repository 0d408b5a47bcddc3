// Helpers shared by the GPU check programs (quant_cuda_check.cc, topk_cuda_check.cc,
// lowrank_cuda_check.cc, backend_check.cc, net_check.cc): formatting, random draws, CUDA
// runtime calls that throw with the call's text, device memory and streams, and the parts
// of the command line and exit convention the programs have in common.
#pragma once

#include <cuda_runtime.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "tools/cli.h"

namespace lgreco::gpu_check {

[[gnu::format(printf, 1, 2)]] inline std::string strf(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) vsnprintf(s.data(), s.size() + 1, format, again);
  va_end(again);
  return s;
}

using ull = unsigned long long;
using Rng = std::mt19937_64;

inline uint64_t below(Rng& rng, uint64_t n) { return n == 0 ? 0 : rng() % n; }
inline bool chance(Rng& rng, double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p; }
template <class T>
T pick(Rng& rng, std::initializer_list<T> items) {
  return items.begin()[below(rng, items.size())];
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// The exit statuses of the check programs but net_check.cc (each program's header comment
// states them); 0 is success and 2 also a usage error (cli::guarded_main).
constexpr int kExitFailed = 1;
constexpr int kExitNoDevice = 2;
constexpr int kExitTimeLimit = 3;

// The bytes of v, for comparing with what came back from the device.
template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) memcpy(b.data(), v.data(), b.size());
  return b;
}

// A CUDA runtime call of the harness failed (not one of lgreco's: those throw their own).
class CudaFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void cuda_failed(cudaError_t e, const char* call, const char* file, int line) {
  throw CudaFailure(strf("%s failed (%s:%d): %s: %s", call, file, line, cudaGetErrorName(e), cudaGetErrorString(e)));
}

}  // namespace lgreco::gpu_check

#define LGRECO_CUDA_CHECK(call)                                                                   \
  do {                                                                                            \
    const cudaError_t lgreco_cuda_status_ = (call);                                               \
    if (lgreco_cuda_status_ != cudaSuccess)                                                       \
      ::lgreco::gpu_check::cuda_failed(lgreco_cuda_status_, #call, __FILE__, __LINE__);           \
  } while (0)

namespace lgreco::gpu_check {

// Device memory of a check program (not lgreco's), freed by its owner.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Never a null pointer, even for 0 bytes: a null argument means "absent" to the kernels.
  explicit DeviceBuffer(uint64_t bytes) : bytes_(bytes) {
    LGRECO_CUDA_CHECK(cudaMalloc(&ptr_, std::max<uint64_t>(bytes, 256)));
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);  // an error here (a faulted context) has been reported already
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

// A non-blocking stream of a check program. cudaStream_t is lgreco's Stream type
// (CUstream_st*), so get() serves both.
class CudaStream {
 public:
  CudaStream() { LGRECO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CudaStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }
  void sync() const { LGRECO_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() { LGRECO_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~CudaEvent() {
    if (event_) cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Copies between the host and a DeviceBuffer on a check program's stream, refusing to
// overrun the buffer (the kernel checks', which own their buffers and streams).
inline void upload(const DeviceBuffer& d, const void* h, uint64_t bytes, const CudaStream& s) {
  if (bytes > d.size()) throw std::logic_error("upload of " + std::to_string(bytes) + " bytes into a smaller buffer");
  if (bytes > 0) LGRECO_CUDA_CHECK(cudaMemcpyAsync(d.get(), h, bytes, cudaMemcpyHostToDevice, s.get()));
}
template <class T>
void upload(const DeviceBuffer& d, const std::vector<T>& h, const CudaStream& s) {
  upload(d, h.data(), h.size() * sizeof(T), s);
}
// The first `count` T of d, after everything queued on s has run.
template <class T>
std::vector<T> download(const DeviceBuffer& d, uint64_t count, const CudaStream& s) {
  std::vector<T> h(count);
  if (count * sizeof(T) > d.size()) throw std::logic_error("download beyond the end of a buffer");
  if (count > 0)
    LGRECO_CUDA_CHECK(cudaMemcpyAsync(h.data(), d.get(), count * sizeof(T), cudaMemcpyDeviceToHost, s.get()));
  s.sync();
  return h;
}

// The device made current, and what the programs print about it: its properties and the
// CUDA runtime's and driver's versions.
struct DeviceFacts {
  cudaDeviceProp prop{};
  int runtime_version = 0;
  int driver_version = 0;
  // "CUDA runtime 12.8, driver 13.0"
  std::string versions() const {
    return strf("CUDA runtime %d.%d, driver %d.%d", runtime_version / 1000, (runtime_version % 1000) / 10,
                driver_version / 1000, (driver_version % 1000) / 10);
  }
};
inline DeviceFacts use_device(int device) {
  DeviceFacts f;
  LGRECO_CUDA_CHECK(cudaSetDevice(device));
  LGRECO_CUDA_CHECK(cudaGetDeviceProperties(&f.prop, device));
  LGRECO_CUDA_CHECK(cudaRuntimeGetVersion(&f.runtime_version));
  LGRECO_CUDA_CHECK(cudaDriverGetVersion(&f.driver_version));
  return f;
}

// ---------------------------------------------------------------------------------------
// The command line

// --check, --bench and --info of the kernel checks, which exclude each other: false when
// `arg` is none of them, else `mode` (an enum with kNone, kCheck, kBench, kInfo) set to it.
template <class Mode>
bool parse_mode(const std::string& arg, Mode& mode) {
  if (arg != "--check" && arg != "--bench" && arg != "--info") return false;
  const Mode m = arg == "--check" ? Mode::kCheck : arg == "--bench" ? Mode::kBench : Mode::kInfo;
  if (mode != Mode::kNone && mode != m) throw cli::UsageError("--check, --bench and --info exclude each other");
  mode = m;
  return true;
}
// After the options: one of the modes was given, and --quick only with --check.
template <class Mode>
void require_mode(Mode mode, bool quick) {
  if (mode == Mode::kNone) throw cli::UsageError("say what to do: --check, --bench or --info");
  if (quick && mode != Mode::kCheck) throw cli::UsageError("--quick goes with --check");
}

// --check's seed: --seed's, or one drawn now; printed with the command line that replays
// the run.
inline uint64_t check_seed(const std::optional<uint64_t>& given, const char* program, bool quick) {
  const uint64_t seed = given ? *given
                              : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}() ^
                                    static_cast<uint64_t>(cli::seconds_now() * 1e9);
  printf("# --check%s, seed 0x%016llx (replay: %s --check%s --seed 0x%016llx)\n", quick ? " --quick" : "",
         static_cast<ull>(seed), program, quick ? " --quick" : "", static_cast<ull>(seed));
  return seed;
}

// --time-limit: a kernel that never ends would hold the GPU script until its timeout;
// after `seconds` (0: never) SIGALRM ends the process with kExitTimeLimit and a line on
// stderr instead (with stdout line-buffered, every result printed so far is in the log).
// The line is formatted here, so that the handler only calls write(2) and _exit, which
// are async-signal-safe.
namespace time_limit_detail {
inline char message[256];
inline size_t message_size = 0;
inline void on_alarm(int) {
  const ssize_t ignored = write(STDERR_FILENO, message, message_size);
  (void)ignored;
  _exit(kExitTimeLimit);
}
}  // namespace time_limit_detail

inline void arm_time_limit(const char* program, unsigned seconds) {
  if (seconds == 0) return;
  const int n = snprintf(time_limit_detail::message, sizeof time_limit_detail::message,
                         "%s: the --time-limit ran out; exiting with status %d\n", program, kExitTimeLimit);
  time_limit_detail::message_size = n < 0 ? 0 : std::min<size_t>(n, sizeof time_limit_detail::message - 1);
  signal(SIGALRM, time_limit_detail::on_alarm);
  alarm(seconds);
}

}  // namespace lgreco::gpu_check
