// Host side of PowerSGD's CUDA module: checks, scratch sizes, launch tables
// (lowrank_cuda_plan.h). Built with and without CUDA.
#include "kernels/lowrank_cuda_plan.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/noise.h"

namespace lgreco::lowrank::cuda {
namespace plan {
namespace {

[[noreturn]] void fail(const char* what, const std::string& problem) {
  throw CodecError(std::string(what) + ": " + problem);
}

std::string name_of(size_t i, const Layer& l) {
  return "layer " + std::to_string(i) + " of the batch (bucket layer " + std::to_string(l.layer) + ", " +
         std::to_string(l.rows) + " x " + std::to_string(l.cols) + ", rank " + std::to_string(l.rank) + ")";
}

bool aligned(const void* p, uint64_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

// a + b without wrapping past 2^64.
bool fits(uint64_t a, uint64_t b) { return a <= std::numeric_limits<uint64_t>::max() - b; }

constexpr uint64_t kMaxDimension = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());

}  // namespace

uint32_t sum_blocks(uint64_t elements) {
  const uint64_t per_block = uint64_t{kSumThreads} * kSumPerThread;
  return static_cast<uint32_t>(std::clamp<uint64_t>((elements + per_block - 1) / per_block, 1, kSumBlocks));
}

uint64_t items_of(const Layer& l, Items kind) {
  switch (kind) {
    case Items::kLayers: return 1;
    case Items::kTiles: return ((l.rows + kTile - 1) / kTile) * ((l.cols + kTile - 1) / kTile);
    case Items::kColumns: return l.rank;
    case Items::kQ0Blocks: return (l.cols * l.rank + kQ0BlockElements - 1) / kQ0BlockElements;
  }
  return 0;
}

std::vector<Table> tables(std::span<const Layer> layers, Items kind) {
  std::vector<Table> out;
  uint64_t work_bytes = 0;
  for (const Layer& l : layers) {
    const uint64_t items = items_of(l, kind);
    if (out.empty() || out.back().count == kMaxLayersPerTable || out.back().items + items > kMaxItemsPerTable)
      out.emplace_back();
    Table& t = out.back();
    TableLayer& x = t.layers[t.count++];
    x.offset = l.offset;
    x.p_offset = l.p_offset;
    x.q_offset = l.q_offset;
    x.work_offset = work_bytes / 8;
    x.rows = static_cast<uint32_t>(l.rows);
    x.cols = static_cast<uint32_t>(l.cols);
    x.rank = l.rank;
    x.layer = l.layer;
    x.item_begin = t.items;
    x.tiles_x = static_cast<uint32_t>((l.cols + kTile - 1) / kTile);
    t.items += static_cast<uint32_t>(items);
    work_bytes += align_up(8 * l.rows * l.rank);
  }
  return out;
}

void check_layers(std::span<const Layer> layers, const char* what) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    if (l.rows == 0 || l.cols == 0 || l.rank == 0)
      fail(what, name_of(i, l) + ": rows, cols and rank must be at least 1");
    if (l.rank > PowersgdParams::kMaxRank)
      fail(what, name_of(i, l) + ": the rank is above " + std::to_string(PowersgdParams::kMaxRank));
    if (l.rows > kMaxDimension || l.cols > kMaxDimension)
      fail(what, name_of(i, l) + ": rows and cols must be below 2^31 (cuBLAS takes 32-bit dimensions)");
    const uint64_t n = l.rows * l.cols;  // no overflow: both below 2^31
    if (n > kMaxLayerElements) fail(what, name_of(i, l) + ": more than 2^34 elements");
    if (!fits(l.offset, n) || !fits(l.p_offset, l.rows * l.rank) || !fits(l.q_offset, l.cols * l.rank))
      fail(what, name_of(i, l) + ": an offset so large that the layer's end overflows 64 bits");
  }
}

void check_source(std::span<const Layer> layers, const Source& s, const char* what, bool flags_allowed) {
  if (!s.input) fail(what, "the input must not be null");
  if (!is_valid_dtype(static_cast<uint32_t>(s.input_dtype))) fail(what, "invalid input element type");
  if (!aligned(s.input, dtype_size(s.input_dtype))) fail(what, "the input is not aligned to its element size");
  if (!aligned(s.residual, 4)) fail(what, "the residual is not 4-byte aligned");
  if (s.flags && !flags_allowed)
    fail(what, "flags must be null (the statistics always include the residual, as the CPU backend's do)");
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    if (l.offset < s.input_first)
      fail(what, name_of(i, l) + ": it starts at call element " + std::to_string(l.offset) +
                     ", before the input's first element " + std::to_string(s.input_first));
    if (s.residual && l.offset < s.residual_first)
      fail(what, name_of(i, l) + ": it starts at call element " + std::to_string(l.offset) +
                     ", before the residual's first element " + std::to_string(s.residual_first));
  }
}

void check_scratch(const Scratch& scratch, uint64_t need, const char* what) {
  if (need == 0) return;
  if (!scratch.data) fail(what, "the scratch is null; it needs " + std::to_string(need) + " bytes");
  if (scratch.bytes < need)
    fail(what, "a scratch of " + std::to_string(scratch.bytes) + " bytes, needs " + std::to_string(need));
  if (!aligned(scratch.data, kAlign)) fail(what, "the scratch is not 256-byte aligned");
}

void check_handle(const Handle& handle, const char* what) {
  if (!handle.valid()) fail(what, "an empty Handle (make one with Handle::create)");
}

void check_workspace(const void* workspace, uint64_t bytes, const char* what) {
  if (!workspace || bytes == 0)
    fail(what, "cuBLAS needs a workspace of the caller's (lowrank::cuda::kWorkspaceBytes), or it allocates its own "
               "on each new stream");
  if (!aligned(workspace, kAlign)) fail(what, "the cuBLAS workspace is not 256-byte aligned");
}

void check_factor(const void* p, const char* name, const char* what) {
  if (!p) fail(what, std::string(name) + " must not be null");
  if (!aligned(p, 4)) fail(what, std::string(name) + " is not 4-byte aligned");
}

void check_output(const Output& out, std::span<const Layer> layers, const char* what) {
  if (!out.data) fail(what, "the output must not be null");
  if (!is_valid_dtype(static_cast<uint32_t>(out.dtype))) fail(what, "invalid output element type");
  if (!aligned(out.data, dtype_size(out.dtype))) fail(what, "the output is not aligned to its element size");
  for (size_t i = 0; i < layers.size(); ++i)
    if (layers[i].offset < out.first)
      fail(what, name_of(i, layers[i]) + ": it starts at call element " + std::to_string(layers[i].offset) +
                     ", before the output's first element " + std::to_string(out.first));
}

uint32_t check_measure(const Measure& m, std::span<const Layer> layers, const char* what) {
  if (m.ranks.empty() || m.ranks.size() > kMaxMeasureRanks)
    fail(what, std::to_string(m.ranks.size()) + " ranks; 1 to " + std::to_string(kMaxMeasureRanks) + " are measured");
  if (m.columns.size() != m.ranks.size())
    fail(what, std::to_string(m.ranks.size()) + " ranks but " + std::to_string(m.columns.size()) + " columns");
  uint32_t max_rank = 0;
  for (size_t k = 0; k < m.ranks.size(); ++k) {
    if (m.ranks[k] < PowersgdParams::kMinRank || m.ranks[k] > PowersgdParams::kMaxRank)
      fail(what, "rank " + std::to_string(m.ranks[k]) + " is outside 1.." + std::to_string(PowersgdParams::kMaxRank));
    if (m.columns[k] >= m.row_stride)
      fail(what, "column " + std::to_string(m.columns[k]) + " is not below the row stride " +
                     std::to_string(m.row_stride));
    max_rank = std::max(max_rank, m.ranks[k]);
  }
  if (!m.squared) fail(what, "squared must not be null");
  if (!aligned(m.squared, 8)) fail(what, "squared is not 8-byte aligned");
  if (!m.nonfinite) fail(what, "nonfinite must not be null");
  if (!m.measured.empty())
    for (size_t i = 0; i < layers.size(); ++i)
      if (layers[i].layer >= m.measured.size())
        fail(what, name_of(i, layers[i]) + ": its index is beyond the " + std::to_string(m.measured.size()) +
                       " entries of `measured`");
  return max_rank;
}

std::vector<Layer> measured_layers(std::span<const Layer> layers, const Measure& m) {
  std::vector<Layer> out;
  for (const Layer& l : layers)
    if (m.measured.empty() || m.measured[l.layer]) out.push_back(l);
  return out;
}

bool check_project(const Handle& handle, std::span<const Layer> layers, const Source& source, const float* q,
                   const float* p, const Scratch& scratch) {
  const char* what = "powersgd cuda project";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_source(layers, source, what, true);
  check_factor(q, "q", what);
  check_factor(p, "p", what);
  check_scratch(scratch, scratch_bytes(layers, source.input_dtype, source.residual != nullptr), what);
  check_handle(handle, what);
  return true;
}

bool check_orthonormalize(std::span<const Layer> layers, const float* p, const Scratch& scratch) {
  const char* what = "powersgd cuda orthonormalize";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_factor(p, "p", what);
  check_scratch(scratch, scratch_bytes(layers, DType::kFloat32, false), what);
  return true;
}

bool check_back_project(const Handle& handle, std::span<const Layer> layers, const Source& source, const float* p,
                        const float* q, const Scratch& scratch) {
  const char* what = "powersgd cuda back_project";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_source(layers, source, what, true);
  check_factor(p, "p", what);
  check_factor(q, "q", what);
  check_scratch(scratch, scratch_bytes(layers, source.input_dtype, source.residual != nullptr), what);
  check_handle(handle, what);
  return true;
}

bool check_reconstruct(std::span<const Layer> layers, const float* p, const float* q, const Output& out) {
  const char* what = "powersgd cuda reconstruct";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_factor(p, "p", what);
  check_factor(q, "q", what);
  check_output(out, layers, what);
  return true;
}

bool check_keep(std::span<const Layer> layers, const float* q_new, const float* q0, const float* q) {
  const char* what = "powersgd cuda keep";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_factor(q_new, "q_new", what);
  check_factor(q0, "q0", what);
  check_factor(q, "q", what);
  if (q == q_new || q == q0) fail(what, "q must not be q_new or q0");
  return true;
}

bool check_initial_q(std::span<const Layer> layers, const float* q0) {
  const char* what = "powersgd cuda initial_q";
  check_layers(layers, what);
  if (layers.empty()) return false;
  check_factor(q0, "q0", what);
  return true;
}

bool check_squared_errors(const Handle& handle, std::span<const Layer> layers, const Source& source,
                          const Measure& m, const Scratch& scratch, uint32_t* max_rank) {
  const char* what = "powersgd cuda squared_errors";
  check_layers(layers, what);
  if (layers.empty()) return false;
  *max_rank = check_measure(m, layers, what);
  const std::vector<Layer> measured = measured_layers(layers, m);
  if (measured.empty()) return false;
  check_source(layers, source, what, false);
  check_scratch(scratch, measure_scratch_bytes(measured, *max_rank, source.input_dtype, source.residual != nullptr),
                what);
  check_handle(handle, what);
  return true;
}

Gemm project_gemm(uint64_t rows, uint64_t cols, uint32_t rank) {
  const int r = static_cast<int>(rank), n = static_cast<int>(rows), k = static_cast<int>(cols);
  return Gemm{false, false, r, n, k, r, k, r};
}

Gemm back_project_gemm(uint64_t rows, uint64_t cols, uint32_t rank) {
  const int r = static_cast<int>(rank), k = static_cast<int>(rows), n = static_cast<int>(cols);
  return Gemm{false, true, r, n, k, r, n, r};
}

MeasureLayout measure_layout(const Layer& l, uint32_t max_rank, bool is_staged) {
  MeasureLayout x;
  const uint64_t r = max_rank;
  x.m = 0;
  x.basis = is_staged ? align_up(4 * l.rows * l.cols) : 0;
  x.p = x.basis + align_up(4 * l.cols * r);
  x.b = x.p + align_up(4 * l.rows * r);
  x.work = x.b + align_up(4 * l.cols * r);
  x.partial = x.work + align_up(8 * l.rows * r);
  x.flags = x.partial + align_up(8 * uint64_t{kSumBlocks});
  x.bytes = x.flags + align_up(4 * uint64_t{kSumBlocks});
  return x;
}

}  // namespace plan

uint64_t scratch_bytes(std::span<const Layer> layers, DType input_dtype, bool residual) {
  plan::check_layers(layers, "powersgd cuda scratch_bytes");
  uint64_t largest = 0, work = 0;
  for (const Layer& l : layers) {
    largest = std::max(largest, l.rows * l.cols);
    work += plan::align_up(8 * l.rows * l.rank);
  }
  const uint64_t staging = plan::staged(input_dtype, residual) ? plan::align_up(4 * largest) : 0;
  return std::max(staging, work);
}

uint64_t measure_scratch_bytes(std::span<const Layer> layers, uint32_t max_rank, DType input_dtype, bool residual) {
  const char* what = "powersgd cuda measure_scratch_bytes";
  plan::check_layers(layers, what);
  if (max_rank < PowersgdParams::kMinRank || max_rank > PowersgdParams::kMaxRank)
    throw CodecError(std::string(what) + ": rank " + std::to_string(max_rank) + " is outside 1.." +
                     std::to_string(PowersgdParams::kMaxRank));
  uint64_t bytes = 0;
  for (const Layer& l : layers)
    bytes = std::max(bytes, plan::measure_layout(l, max_rank, plan::staged(input_dtype, residual)).bytes);
  return bytes;
}

}  // namespace lgreco::lowrank::cuda
