// Philox-4x32-10, the counter-based generator of Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3" (SC'11). The same function runs on the host and the device, so a
// CUDA kernel reproduces the CPU reference's rounding noise bit for bit.
//
// A counter-based generator has no state: the output is a pure function of (counter, key),
// so any element's noise can be computed where that element is processed, in any order.
// How lgreco maps (seed, rank, step, layer, element index) onto counter and key is defined
// in noise.h and docs/FORMAT.md.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace lgreco {

struct PhiloxBlock {
  uint32_t v[4];
};

namespace philox_detail {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kRounds = 10;
}  // namespace philox_detail

// One Philox-4x32-10 block: four independent uniform 32-bit words.
LGRECO_HD PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  using namespace philox_detail;
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kWeyl0;  // the bump after the last round is unused and harmless
    k1 += kWeyl1;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

}  // namespace lgreco
