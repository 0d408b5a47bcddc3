// Host side of PowerSGD's CUDA module (lowrank_cuda.h): argument checks, scratch sizes
// and layouts, and the launch tables the kernels take by value. Pure C++, no CUDA, in both
// builds: what it decides is unit-tested on any machine (tests/unit/lowrank_cuda_host_test.cc),
// and lowrank_cuda.cu only launches what it produces.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/lowrank_cuda.h"

namespace lgreco::lowrank::cuda::plan {

constexpr uint64_t kAlign = 256;  // scratch pieces, and the scratch itself
constexpr uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Layers of one launch table; 16 + 64 x 56 bytes of kernel parameters, under 4 KB.
constexpr uint32_t kMaxLayersPerTable = 64;
// A table's work items stay below this (a 1-D grid's limit).
constexpr uint64_t kMaxItemsPerTable = (uint64_t{1} << 31) - 1;
// reconstruct / the residual: tiles of kTile x kTile elements, one thread block each.
constexpr uint32_t kTile = 32;
// initial_q: elements per thread block.
constexpr uint32_t kQ0BlockElements = 256;
// squared_errors: the sum of squares of M runs over at most this many blocks, each
// kSumThreads x kSumPerThread elements at least; their partial sums are added in block
// order (deterministic).
constexpr uint32_t kSumBlocks = 1024;
constexpr uint32_t kSumThreads = 256;
constexpr uint32_t kSumPerThread = 16;
uint32_t sum_blocks(uint64_t elements);

// One layer as the kernels see it.
struct TableLayer {
  uint64_t offset;       // call element of M[0][0]
  uint64_t p_offset;     // floats
  uint64_t q_offset;     // floats
  uint64_t work_offset;  // orthonormalize: doubles into the scratch (the layer's columns)
  uint32_t rows, cols, rank, layer;
  uint32_t item_begin;   // first work item of the layer in the table's numbering
  uint32_t tiles_x;      // tiles: column tiles of the layer
};
static_assert(sizeof(TableLayer) == 56);

struct Table {
  uint32_t count = 0;  // layers
  uint32_t items = 0;  // work items of all layers (blocks of the grid)
  uint32_t pad[2] = {0, 0};
  TableLayer layers[kMaxLayersPerTable];
};
static_assert(sizeof(Table) <= 4096);

// What a table's work items are.
enum class Items {
  kLayers,    // one per layer (orthonormalize)
  kTiles,     // ceil(rows / kTile) x ceil(cols / kTile) per layer (reconstruct, residual)
  kColumns,   // rank per layer (keep)
  kQ0Blocks,  // ceil(cols x rank / kQ0BlockElements) per layer (initial_q)
};
uint64_t items_of(const Layer& l, Items kind);

// The layers split into launch tables of up to kMaxLayersPerTable layers and
// kMaxItemsPerTable items, in order. work_offset numbers every layer's Gram-Schmidt columns
// across all tables (8 x rows x rank bytes each, rounded up to 256).
std::vector<Table> tables(std::span<const Layer> layers, Items kind);

// The checks of each operation's arguments, as lowrank_cuda.h describes them (both builds
// run them before anything else): each throws CodecError("powersgd cuda <operation>:
// <problem>"), naming a layer by its position in the batch and its bucket index, and
// returns false when there is nothing to do (no layers; for squared_errors, none
// measured). squared_errors also gives R, the largest rank measured.
bool check_project(const Handle& handle, std::span<const Layer> layers, const Source& source, const float* q,
                   const float* p, const Scratch& scratch);
bool check_orthonormalize(std::span<const Layer> layers, const float* p, const Scratch& scratch);
bool check_back_project(const Handle& handle, std::span<const Layer> layers, const Source& source, const float* p,
                        const float* q, const Scratch& scratch);
bool check_reconstruct(std::span<const Layer> layers, const float* p, const float* q, const Output& out);
bool check_keep(std::span<const Layer> layers, const float* q_new, const float* q0, const float* q);
bool check_initial_q(std::span<const Layer> layers, const float* q0);
bool check_squared_errors(const Handle& handle, std::span<const Layer> layers, const Source& source,
                          const Measure& m, const Scratch& scratch, uint32_t* max_rank);

// The pieces of those checks.
void check_layers(std::span<const Layer> layers, const char* what);
// The source: non-null, aligned, a valid type, every layer at or after input_first and
// residual_first. flags_allowed: false for squared_errors (flags must be null).
void check_source(std::span<const Layer> layers, const Source& source, const char* what, bool flags_allowed);
void check_scratch(const Scratch& scratch, uint64_t need, const char* what);
void check_handle(const Handle& handle, const char* what);
// Handle::create's workspace: non-null, at least one byte, 256-byte aligned.
void check_workspace(const void* workspace, uint64_t bytes, const char* what);
// A float array of the factors: non-null and 4-byte aligned.
void check_factor(const void* p, const char* name, const char* what);
void check_output(const Output& out, std::span<const Layer> layers, const char* what);
// The statistics' own arguments (not the layers or the source); returns R.
uint32_t check_measure(const Measure& m, std::span<const Layer> layers, const char* what);
// The layers squared_errors measures (all, or those `measured` marks).
std::vector<Layer> measured_layers(std::span<const Layer> layers, const Measure& m);

// Whether M of a layer is staged (copied to float32 in the scratch) for this source.
inline bool staged(DType input_dtype, bool residual) { return input_dtype != DType::kFloat32 || residual; }

// One cuBLAS SGEMM, column-major: C (m x n, ld ldc) = op(A) (m x k) op(B) (k x n), op = the
// matrix itself or its transpose. M row-major (rows x cols) is, read column-major, M^T
// (cols x rows, ld cols); the row-major factors P (rows x r) and Q (cols x r) are P^T and
// Q^T column-major (ld r).
struct Gemm {
  bool transpose_a = false, transpose_b = false;
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldc = 0;
};
// P = M Q as P^T = Q^T M^T: A = Q, B = M, C = P, no transposes, m = r, n = rows, k = cols.
Gemm project_gemm(uint64_t rows, uint64_t cols, uint32_t rank);
// Q = M^T P as Q^T = P^T M: A = P, B = M (transposed), C = Q, m = r, n = cols, k = rows.
Gemm back_project_gemm(uint64_t rows, uint64_t cols, uint32_t rank);

// squared_errors' scratch of one layer, byte offsets from the scratch's start.
struct MeasureLayout {
  uint64_t m = 0;         // staged M (if staged)
  uint64_t basis = 0;     // cols x R floats
  uint64_t p = 0;         // rows x R floats
  uint64_t b = 0;         // cols x R floats
  uint64_t work = 0;      // rows x R doubles
  uint64_t partial = 0;   // kSumBlocks doubles
  uint64_t flags = 0;     // kSumBlocks uint32
  uint64_t bytes = 0;     // total
};
MeasureLayout measure_layout(const Layer& l, uint32_t max_rank, bool is_staged);

}  // namespace lgreco::lowrank::cuda::plan
