#include "kernels/codec.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/lowrank.h"
#include "kernels/quant.h"
#include "kernels/quant_math.h"
#include "kernels/topk.h"

namespace lgreco {
namespace {

void check_buffer(uint64_t have, uint64_t need, const char* what) {
  if (have < need)
    throw CodecError(std::string(what) + ": buffer of " + std::to_string(have) + " bytes, needs " +
                     std::to_string(need));
}

// `none`: the values themselves, in the layer's element type (little-endian). With a
// residual the sent value is input + residual rounded to that type, and the residual
// keeps the rounding error (zero for float32).
class NoneCodec final : public Codec {
 public:
  NoneCodec(const CodecSpec& spec, DType dtype) : Codec(spec, dtype) {}

  uint64_t encoded_bytes(uint64_t count) const override { return count * dtype_size(dtype()); }

  EncodeReport encode(const NoiseKey&, const Slice& in, float* residual, std::span<uint8_t> out) const override {
    check_buffer(out.size(), encoded_bytes(in.count), "none encode");
    EncodeReport report;
    for (uint64_t i = 0; i < in.count; ++i) {
      const float x = load_as_float(in.data, dtype(), i);
      const float v = residual ? quant::canonical_nan(x + residual[i]) : x;
      store_from_float(out.data(), dtype(), i, v);
      // A value that is finite in float32 but overflows the element type (above 65504 in
      // float16) is sent as an infinity like any overflow; its residual stays as it was,
      // or it would hold -inf for good.
      const float sent = round_to_dtype(v, dtype());
      if (!quant::is_finite_value(sent)) {
        ++report.nonfinite_buckets;  // each value is its own "bucket"
        continue;
      }
      if (residual) residual[i] = v - sent;
    }
    return report;
  }

  void decode(std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) const override {
    check_buffer(in.size(), encoded_bytes(count), "none decode");
    for (uint64_t i = 0; i < count; ++i) store_from_float(out, out_dtype, i, load_as_float(in.data(), dtype(), i));
  }

  void decode_accumulate(std::span<const uint8_t> in, uint64_t count, float* acc) const override {
    check_buffer(in.size(), encoded_bytes(count), "none decode_accumulate");
    for (uint64_t i = 0; i < count; ++i) acc[i] = quant::canonical_nan(acc[i] + load_as_float(in.data(), dtype(), i));
  }
};

class QuantCodec final : public Codec {
 public:
  QuantCodec(const CodecSpec& spec, DType dtype) : Codec(spec, dtype), p_(spec.quant_params()) { p_.validate(); }

  uint64_t encoded_bytes(uint64_t count) const override { return quant::encoded_bytes(p_, count); }

  EncodeReport encode(const NoiseKey& noise, const Slice& in, float* residual, std::span<uint8_t> out) const override {
    return quant::encode(p_, noise, dtype(), in, residual, out);
  }
  void decode(std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) const override {
    quant::decode(p_, in, count, out_dtype, out);
  }
  void decode_accumulate(std::span<const uint8_t> in, uint64_t count, float* acc) const override {
    quant::decode_accumulate(p_, in, count, acc);
  }

 private:
  QuantParams p_;
};

class TopkCodec final : public Codec {
 public:
  TopkCodec(const CodecSpec& spec, DType dtype) : Codec(spec, dtype), p_(spec.topk_params()) { p_.validate(); }

  uint64_t encoded_bytes(uint64_t count) const override { return topk::encoded_bytes(p_, count); }

  // TopK draws no rounding noise: the key is unused.
  EncodeReport encode(const NoiseKey&, const Slice& in, float* residual, std::span<uint8_t> out) const override {
    return topk::encode(p_, dtype(), in, residual, out);
  }
  void decode(std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) const override {
    topk::decode(p_, in, count, out_dtype, out);
  }
  void decode_accumulate(std::span<const uint8_t> in, uint64_t count, float* acc) const override {
    topk::decode_accumulate(p_, in, count, acc);
  }

 private:
  TopkParams p_;
};

// One-shot PowerSGD (kernels/lowrank.h): needs rows in the spec, since a Codec has no
// layer shape. The engine exchanges PowerSGD layers its own way (two allreduces with a
// warm-started Q), not through this class.
class PowersgdCodec final : public Codec {
 public:
  PowersgdCodec(const CodecSpec& spec, DType dtype) : Codec(spec, dtype), p_(spec.powersgd_params()) {
    p_.validate();
  }

  uint64_t encoded_bytes(uint64_t count) const override {
    if (p_.rows == 0) throw CodecError("powersgd: the encoded size needs the matrix shape (rows=N in the spec)");
    return lowrank::encoded_bytes(lowrank::shape_of(count, p_.rows, "powersgd"), p_.rank);
  }
  EncodeReport encode(const NoiseKey& key, const Slice& in, float* residual, std::span<uint8_t> out) const override {
    return lowrank::encode(p_, key, dtype(), in, residual, out);
  }
  void decode(std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) const override {
    lowrank::decode(p_, in, count, out_dtype, out);
  }
  void decode_accumulate(std::span<const uint8_t> in, uint64_t count, float* acc) const override {
    lowrank::decode_accumulate(p_, in, count, acc);
  }

 private:
  PowersgdParams p_;
};

// Error of `none`: what rounding x + residual to the layer's type loses.
double none_squared_error(DType dtype, const Slice& in, const float* residual, uint64_t* nonfinite) {
  double sum = 0.0;
  for (uint64_t i = 0; i < in.count; ++i) {
    const float x = load_as_float(in.data, dtype, i);
    const float v = residual ? x + residual[i] : x;
    if (!quant::is_finite_value(v)) {
      ++*nonfinite;
      continue;
    }
    const double d = double(v) - double(round_to_dtype(v, dtype));
    sum += d * d;
  }
  return *nonfinite ? std::numeric_limits<double>::infinity() : sum;
}

}  // namespace

std::unique_ptr<Codec> Codec::create(const CodecSpec& spec, DType dtype) {
  if (!is_valid_dtype(static_cast<uint32_t>(dtype))) throw CodecError("codec: invalid element type");
  switch (spec.family()) {
    case CodecFamily::kNone: return std::make_unique<NoneCodec>(spec, dtype);
    case CodecFamily::kQuant: return std::make_unique<QuantCodec>(spec, dtype);
    case CodecFamily::kTopk: return std::make_unique<TopkCodec>(spec, dtype);
    case CodecFamily::kPowersgd: return std::make_unique<PowersgdCodec>(spec, dtype);
  }
  throw CodecError("codec: unknown family in spec " + spec.str());
}

namespace {

// PowerSGD candidates of one row count: one seeded basis of the largest rank serves them
// all (lowrank::squared_errors), exactly as the one-shot codec would do at each rank.
uint64_t powersgd_errors(std::span<const CodecSpec> specs, std::span<const size_t> indices, DType dtype,
                         const Slice& input, const float* residual, const NoiseKey& key, CandidateReport* report) {
  std::vector<float> x(input.count);
  for (uint64_t i = 0; i < input.count; ++i) {
    const float v = load_as_float(input.data, dtype, i);
    x[i] = residual ? v + residual[i] : v;
  }
  uint64_t nonfinite = 0;
  std::vector<size_t> left(indices.begin(), indices.end());
  while (!left.empty()) {
    const uint64_t rows = specs[left.front()].powersgd_params().rows;
    const lowrank::Shape shape = lowrank::shape_of(input.count, rows, "powersgd statistics");
    std::vector<uint32_t> ranks;
    std::vector<size_t> these, rest;
    for (size_t i : left)
      (specs[i].powersgd_params().rows == rows ? these : rest).push_back(i);
    uint32_t basis_rank = 0;
    for (size_t i : these) {
      ranks.push_back(specs[i].powersgd_params().rank);
      basis_rank = std::max(basis_rank, ranks.back());
    }
    std::vector<float> basis(shape.cols * basis_rank);
    lowrank::initial_q(key, shape.cols, basis_rank, basis.data());
    std::vector<double> errors(ranks.size());
    if (!lowrank::squared_errors(x.data(), shape, basis.data(), basis_rank, ranks, errors)) nonfinite = 1;
    for (size_t k = 0; k < these.size(); ++k) report->candidates[these[k]].squared_error = errors[k];
    left = std::move(rest);
  }
  return nonfinite;
}

}  // namespace

CandidateReport measure_candidates(std::span<const CodecSpec> specs, DType dtype, const Slice& input,
                                   const float* residual, const NoiseKey& key) {
  CandidateReport report;
  report.candidates.resize(specs.size());
  std::vector<QuantParams> quant;
  std::vector<TopkParams> topk;
  std::vector<size_t> quant_index, topk_index, powersgd_index;
  bool has_none = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    report.candidates[i].bytes = Codec::create(specs[i], dtype)->encoded_bytes(input.count);
    switch (specs[i].family()) {
      case CodecFamily::kQuant:
        quant.push_back(specs[i].quant_params());
        quant_index.push_back(i);
        break;
      case CodecFamily::kTopk:
        topk.push_back(specs[i].topk_params());
        topk_index.push_back(i);
        break;
      case CodecFamily::kPowersgd: powersgd_index.push_back(i); break;
      case CodecFamily::kNone: has_none = true; break;
    }
  }
  // Each family reads the input once for all its candidates. The count reported is the
  // first family's in this order: quantization counts buckets, the others values.
  if (!quant.empty()) {
    std::vector<double> errors(quant.size());
    report.nonfinite_buckets = quant::squared_errors(quant, dtype, input, residual, errors).nonfinite_buckets;
    for (size_t k = 0; k < quant.size(); ++k) report.candidates[quant_index[k]].squared_error = errors[k];
  }
  if (!topk.empty()) {
    std::vector<double> errors(topk.size());
    const uint64_t nonfinite = topk::squared_errors(topk, dtype, input, residual, errors);
    if (quant.empty()) report.nonfinite_buckets = nonfinite;
    for (size_t k = 0; k < topk.size(); ++k) report.candidates[topk_index[k]].squared_error = errors[k];
  }
  if (!powersgd_index.empty()) {
    const uint64_t nonfinite = powersgd_errors(specs, powersgd_index, dtype, input, residual, key, &report);
    if (quant.empty() && topk.empty()) report.nonfinite_buckets = nonfinite;
  }
  if (has_none) {
    uint64_t nonfinite = 0;
    const double error = none_squared_error(dtype, input, residual, &nonfinite);
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].family() == CodecFamily::kNone) report.candidates[i].squared_error = error;
    if (quant.empty() && topk.empty() && powersgd_index.empty()) report.nonfinite_buckets = nonfinite;
  }
  return report;
}

}  // namespace lgreco
