// The family-neutral face of the CPU reference codecs.
//
// A Codec is one spec applied to layers of one element type. Every family offers the same
// four operations: its encoded size (a pure function of the count, known on the host
// before any data exists), encode with optional error feedback, decode, and
// decode-accumulate into float32. measure_candidates() gives the controller the error and
// size of many candidate specs for one layer, fusing the work within each family.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"
#include "kernels/slice.h"

namespace lgreco {

class Codec {
 public:
  // Throws CodecError if the spec is invalid.
  static std::unique_ptr<Codec> create(const CodecSpec& spec, DType dtype);
  virtual ~Codec() = default;

  const CodecSpec& spec() const { return spec_; }
  DType dtype() const { return dtype_; }

  virtual uint64_t encoded_bytes(uint64_t count) const = 0;

  // Encodes input (+ residual when not null) into out (at least encoded_bytes(count)).
  // With a residual, error feedback: residual <- (input + residual) - decode(encoded).
  virtual EncodeReport encode(const NoiseKey& noise, const Slice& input, float* residual,
                              std::span<uint8_t> out) const = 0;
  // Decodes count values into out, of element type out_dtype.
  virtual void decode(std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) const = 0;
  // acc[i] += decoded value i, in float32.
  virtual void decode_accumulate(std::span<const uint8_t> in, uint64_t count, float* acc) const = 0;

 protected:
  Codec(const CodecSpec& spec, DType dtype) : spec_(spec), dtype_(dtype) {}

 private:
  CodecSpec spec_;
  DType dtype_;
};

// What one candidate would cost on one layer.
struct CandidateError {
  uint64_t bytes = 0;
  // Squared L2 norm of (x - C(x)) with x = input + residual. For stochastic rounding the
  // expectation over the rounding noise (closed form), otherwise the actual error. +inf
  // when the input holds a NaN or an infinity.
  double squared_error = 0.0;
};

struct CandidateReport {
  std::vector<CandidateError> candidates;  // in the order of the specs
  uint64_t nonfinite_buckets = 0;          // > 0: the errors are +inf, skip this sample
};

// Error and size of every spec on one layer slice, in one read of the input per family
// (per bucket size for quantization). `key` seeds PowerSGD's starting matrix (its seed,
// layer and step), so that its error is the one-shot codec's with that key; the other families'
// errors do not depend on it. Throws CodecError on an invalid spec or input (PowerSGD
// without rows=N in its spec).
CandidateReport measure_candidates(std::span<const CodecSpec> specs, DType dtype, const Slice& input,
                                   const float* residual, const NoiseKey& key = {});

}  // namespace lgreco
