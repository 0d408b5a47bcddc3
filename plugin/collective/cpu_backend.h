// The CPU backend: the reference codecs of kernels/ on the calling thread, host memory.
// Each operation completes before it returns (kernels/codec.h does the arithmetic, so
// its bytes are the reference every other backend must reproduce).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "kernels/codec.h"
#include "plugin/collective/backend.h"

namespace lgreco::collective {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  std::string unsupported(const CodecSpec&) const override { return ""; }  // every family

  std::unique_ptr<Buffer> allocate(uint64_t bytes) override;
  std::unique_ptr<Buffer> allocate_host(uint64_t bytes) override { return allocate(bytes); }
  void fill_zero(void* data, uint64_t bytes) override;
  void copy(void* dst, const void* src, uint64_t bytes) override;
  void upload(void* dst, const void* host_src, uint64_t bytes) override;
  std::unique_ptr<Event> read_back(void* host_dst, const void* src, uint64_t bytes) override;

  void find_nonfinite(const Plan& plan, std::span<const Segment> segments, ElementSpan input,
                      uint8_t* flags) override;
  void encode(const Plan& plan, std::span<const Segment> segments, ElementSpan input, float* residual_data,
              uint64_t residual_first, const uint8_t* flags, const NoiseBase& noise, uint8_t* out,
              uint64_t byte_offset_base) override;
  void decode(const Plan& plan, std::span<const Segment> segments, const uint8_t* in, uint64_t byte_offset_base,
              ElementSpan out) override;
  void decode_accumulate(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                         uint64_t byte_offset_base, ElementSpan acc) override;
  void accumulate_exact(const Plan& plan, std::span<const Segment> segments, ElementSpan input, float* residual_data,
                        uint64_t residual_first, const uint8_t* flags, ElementSpan acc) override;
  void divide(float* acc, uint64_t n, float divisor) override;
  void narrow(const float* acc, uint64_t n, ElementSpan out) override;
  void gather(std::span<const Run> runs, ElementSpan src, uint64_t src_end, float scale, bool accumulate,
              float* dst) override;
  void distance(std::span<const Segment> segments, ElementSpan a, const float* b, int power, double weight, double* out,
                uint8_t* nonfinite) override;
  void sketch(std::span<const SketchRun> runs, const float* src, float* dst) override;
  void measure(const Plan& plan, std::span<const Segment> segments, ElementSpan input, const float* residual,
               uint64_t residual_first, const Measure& m) override;
  void lowrank_project(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                       const uint8_t* flags, const float* q, float* p) override;
  void lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) override;
  void lowrank_back_project(std::span<const LowRankLayer> layers, ElementSpan input, float* residual,
                            const uint8_t* flags, const float* p, float* q) override;
  void lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                           ElementSpan out) override;
  void lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) override;
  void measure_lowrank(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                       const NoiseBase& key, const Measure& m) override;

  // Marks are the steady clock in nanoseconds: passed as soon as they exist.
  uint64_t mark() override;
  bool mark_ready(uint64_t) override { return true; }
  void wait_mark(uint64_t) override {}
  double seconds_between(uint64_t first_mark, uint64_t second_mark) override;
  void release_mark(uint64_t) override {}

 private:
  // Codecs are created once per (spec, element type) and kept.
  const Codec& codec(const CodecSpec& spec, DType dtype);
  std::map<std::pair<std::string, DType>, std::unique_ptr<Codec>> codecs_;
};

}  // namespace lgreco::collective
