// Synthetic L-GreCo problems shaped like real ones, for lgreco-solve-bench and the tests.
//
// A "quantization" instance: layers with log-uniform element counts, each with the
// candidates quant bits 2..8 (bucket 1024, sizes from the wire format) and errors from
// the stochastic-rounding model  numel x sigma^2 / (2^b - 1)^2  with a per-layer gradient
// scale sigma spread over decades and +-5% measurement jitter per candidate; the default
// is 4 bits. A fraction of small layers (biases, norms) stay uncompressed: one "none"
// candidate with zero error.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>

#include "controller/problem.h"
#include "kernels/quant.h"

namespace lgreco::tools {

struct QuantInstanceShape {
  uint32_t layers = 1000;
  uint32_t min_bits = 2, max_bits = 8, default_bits = 4;
  double min_numel = 1e3, max_numel = 4e6;
  double uncompressed_fraction = 0.2;  // of the layers, one "none" candidate each
};

// The wire format's size (kernels/quant.h), with the bucket size defaulting as specs do.
inline uint64_t quant_encoded_bytes(uint64_t numel, uint32_t bits, uint32_t bucket = 1024) {
  QuantParams params;
  params.bits = static_cast<int>(bits);
  params.bucket = bucket;
  return quant::encoded_bytes(params, numel);
}

inline controller::Problem quant_instance(const QuantInstanceShape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  controller::Problem p;
  for (uint32_t l = 0; l < shape.layers; ++l) {
    controller::Layer layer;
    layer.name = "layer" + std::to_string(l);
    const bool uncompressed = unit(rng) < shape.uncompressed_fraction;
    layer.numel = uncompressed
                      ? 64 + static_cast<uint64_t>(unit(rng) * 4096)
                      : static_cast<uint64_t>(shape.min_numel * std::pow(shape.max_numel / shape.min_numel, unit(rng)));
    if (uncompressed) {
      layer.candidates.push_back({"none", 4 * layer.numel, 0.0});
    } else {
      const double sigma = std::pow(10.0, -4 + 3 * unit(rng));
      for (uint32_t b = shape.min_bits; b <= shape.max_bits; ++b) {
        const double levels = std::ldexp(1.0, static_cast<int>(b)) - 1;
        const double jitter = 0.95 + 0.1 * unit(rng);
        const double error = static_cast<double>(layer.numel) * sigma * sigma / (levels * levels) * jitter;
        layer.candidates.push_back({"quant:bits=" + std::to_string(b), quant_encoded_bytes(layer.numel, b), error});
        if (b == shape.default_bits) layer.default_index = b - shape.min_bits;
      }
    }
    p.layers.push_back(std::move(layer));
  }
  return p;
}

}  // namespace lgreco::tools
