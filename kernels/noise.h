// The rounding noise of stochastic quantization: which random word each element gets.
//
// Element e (counted from the first element of its layer) of a layer takes word (e mod 4)
// of the Philox-4x32-10 block with
//   counter = (e / 4 [low 32 bits], layer, step [low 32 bits], rank)
//   key     = (seed [low 32 bits], seed [high 32 bits]).
// Different ranks, steps and layers therefore draw from disjoint counters, and any slice
// of a layer can be encoded alone (by a CPU loop or a CUDA block) with the same noise.
#pragma once

#include <cstdint>

#include "kernels/hd.h"
#include "kernels/philox.h"

namespace lgreco {

struct NoiseKey {
  uint64_t seed = 0;
  uint32_t rank = 0;
  uint64_t step = 0;  // only the low 32 bits take part
  uint32_t layer = 0;
};

// Element indices within one layer must stay below this (4 words per 32-bit counter).
constexpr uint64_t kMaxLayerElements = uint64_t{1} << 34;

LGRECO_HD PhiloxBlock noise_block(const NoiseKey& key, uint64_t block_index) {
  return philox4x32_10(static_cast<uint32_t>(block_index), key.layer, static_cast<uint32_t>(key.step), key.rank,
                       static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
}

// A uniform value in [0, 1) with 24 random bits; exact in float32.
LGRECO_HD float uniform24(uint32_t word) { return static_cast<float>(word >> 8) * 0x1p-24f; }

}  // namespace lgreco
