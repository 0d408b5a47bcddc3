// Helpers shared by the GPU check programs (quant_cuda_check.cc, backend_check.cc):
// formatting, random draws, and CUDA runtime calls that throw with the call's text.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/dtype.h"

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

}  // namespace lgreco::gpu_check
