// The signed sketch of a vector (Backend::sketch): what the low-rank probe allreduces to
// measure the norm of a sum that no rank holds (plugin/collective/lowrank_probe.h).
//
// Element i of a run goes to bucket i mod width with the sign sketch_sign(key, i); a
// bucket sums its elements. With signs drawn independently of the data, the sketch's
// squared norm is an unbiased estimate of the vector's, sum_j (sum_{i in j} s_i x_i)^2
// having expectation sum_i x_i^2 (the cross terms' signs cancel), and its relative spread
// is about sqrt(2 / width) where the energy is spread over many buckets. A run no longer
// than width is sketched exactly (one element per bucket). The sketch is linear, so the
// sketches of the ranks' vectors sum to the sketch of their sum (the same keys on every
// rank). Shared by the CPU backend and the CUDA kernel: the same signs on both.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace lgreco::sketch {

LGRECO_HD uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

LGRECO_HD double sign(uint64_t key, uint64_t i) { return (mix64(key ^ mix64(i)) & 1) ? -1.0 : 1.0; }

}  // namespace lgreco::sketch
