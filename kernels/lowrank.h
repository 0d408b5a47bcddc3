// PowerSGD low-rank compression, CPU reference (docs/FORMAT.md defines the arithmetic and
// the one-shot payload).
//
// A slice of n x m values is the row-major matrix M (element i*m + j is M[i][j]). Rank-r
// PowerSGD (Vogels et al., NeurIPS 2019) takes one step of power iteration from a matrix
// Q (m x r):
//     P = M Q,  P <- orthonormalize(P),  Q = M^T P,  M ~ P Q^T.
// P Q^T = P P^T M is the projection of M on the column space of P. Because P is linear in
// M, data-parallel ranks can sum their P (and then their Q) with a plain allreduce; the
// engine does that with a warm-started Q (plugin/collective/engine.h). The functions here
// are the building blocks, and a one-shot codec (a single iteration from a seeded Q) for
// lgreco-codec and the tests.
//
// Arithmetic: products summed in float64 and rounded once to float32, so results do not
// depend on the order of the sum beyond that rounding; Gram-Schmidt in float64. A GPU
// (cuBLAS) agrees within the tolerance docs/KERNELS.md states, not bit for bit.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "kernels/noise.h"
#include "kernels/slice.h"

namespace lgreco::lowrank {

struct Shape {
  uint64_t rows = 0, cols = 0;
};

// The n x m view of `count` values with `rows` rows; throws CodecError unless rows > 0
// divides count.
Shape shape_of(uint64_t count, uint64_t rows, const char* what);

// Floats in the two factors: (n + m) r.
constexpr uint64_t factor_floats(const Shape& s, uint32_t rank) { return (s.rows + s.cols) * rank; }
constexpr uint64_t encoded_bytes(const Shape& s, uint32_t rank) { return 4 * factor_floats(s, rank); }

// Q0 (cols x rank, row-major): the starting matrix every rank derives from the same key
// (seed, layer, step; the key's rank is not used). Element (j, c) is a uniform value in
// [-1, 1) from word e mod 4 of Philox block e / 4, e = j * 256 + c (docs/FORMAT.md): it
// depends on (j, c) and not on `rank`, so Q0 of rank r is the first r columns of Q0 of
// any larger rank, and one basis serves every smaller rank's statistics. A fresh Q0 per
// step is what lets error feedback work for the one-shot codec: with a fixed one, a
// residual whose rows are orthogonal to Q0's columns would never be sent.
void initial_q(const NoiseKey& key, uint64_t cols, uint32_t rank, float* q);

// p (rows x rank) = M q, with M the rows x cols matrix x.
void project(const float* x, const Shape& s, const float* q, uint32_t rank, float* p);
// Modified Gram-Schmidt on the columns of p (rows x rank), in order, in float64. A column
// that is (numerically) in the span of the ones before it, or zero, becomes zero: it
// contributes nothing, rather than amplified noise.
void orthonormalize(float* p, uint64_t rows, uint32_t rank);
// q (cols x rank) = M^T p.
void back_project(const float* x, const Shape& s, const float* p, uint32_t rank, float* q);
// out[i][j] = scale x sum_c p[i][c] q[j][c].
void reconstruct(const float* p, const float* q, const Shape& s, uint32_t rank, float scale, float* out);

// The one-shot codec: x = input (+ residual), Q0 from the key, one iteration; the payload is P (rows x rank) then Q (cols x rank), f32 row-major. With a
// residual: residual = x - P Q^T, unless x holds a NaN or an infinity (then the whole
// slice keeps its residual and counts as one non-finite bucket; P and Q are NaN).
EncodeReport encode(const PowersgdParams& p, const NoiseKey& key, DType dtype, const Slice& input, float* residual,
                    std::span<uint8_t> out);
void decode(const PowersgdParams& p, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out);
void decode_accumulate(const PowersgdParams& p, std::span<const uint8_t> in, uint64_t count, float* acc);

// ||M - P_r P_r^T M||^2 for each rank r of `ranks`, where P_r is the first r columns of
// orthonormalize(M basis) and basis (cols x basis_rank) holds at least max(ranks)
// columns: sum over M's squares minus the squares of P_r^T M, in float64. With the seeded
// basis of initial_q this is exactly the one-shot codec's error at every rank. Returns
// false (errors +inf) when x holds a non-finite value.
bool squared_errors(const float* x, const Shape& s, const float* basis, uint32_t basis_rank,
                    std::span<const uint32_t> ranks, std::span<double> out);

}  // namespace lgreco::lowrank
