#include "kernels/topk_cuda_plan.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/stats_columns.h"

namespace lgreco::topk::cuda::plan {
namespace {

std::string job_name(const char* what, size_t index) { return std::string(what) + ": job " + std::to_string(index); }

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Appends `bytes` at the next 256-byte boundary; returns where it starts.
uint64_t take(uint64_t& at, uint64_t bytes) {
  at = (at + 255) / 256 * 256;
  const uint64_t begin = at;
  at += bytes;
  return begin;
}

bool aligned(const void* p, size_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment == 0; }

void require(bool ok, const char* what, const std::string& message) {
  if (!ok) throw CodecError(std::string(what) + ": " + message);
}

void check_scratch(const void* scratch, uint64_t have, uint64_t need, const char* what, const char* query) {
  require(aligned(scratch, 256), what, "the scratch is not 256-byte aligned");
  if (scratch == nullptr || have < need)
    throw CodecError(std::string(what) + ": scratch of " + std::to_string(scratch ? have : 0) +
                     " bytes is too small (needs " + std::to_string(need) + ", see " + query + ")");
}

Layout layout(const Table& t, uint32_t targets, bool encode) {
  Layout l;
  l.targets = targets;
  uint64_t at = 0;
  l.job_state = take(at, uint64_t{t.count} * sizeof(JobState));
  l.hist1 = take(at, uint64_t{t.count} * kBins1 * 4);
  const uint64_t tile_words = encode ? uint64_t{t.tiles} * 4 : 0;
  l.tile_above = take(at, tile_words);
  l.tile_equal = take(at, tile_words);
  l.tile_raw = take(at, tile_words);
  l.group_begin = take(at, 0);
  l.sel = take(at, uint64_t{t.count} * targets * sizeof(SelState));
  l.hist2 = take(at, uint64_t{t.count} * targets * kBins2 * 4);
  l.hist3 = take(at, uint64_t{t.count} * targets * kBins3 * 4);
  l.zero_end = take(at, 0);
  l.off_above = take(at, tile_words);
  l.off_equal = take(at, tile_words);
  uint64_t entries = 0;
  if (encode)
    for (uint32_t j = 0; j < t.count; ++j) entries += t.jobs[j].list_capacity;
  l.list = take(at, entries * 8);
  l.tile_sums = take(at, encode ? 0 : uint64_t{t.tiles} * targets * sizeof(double));
  l.total = take(at, 0);
  return l;
}

}  // namespace

uint32_t list_capacity(uint64_t count) {
  const uint64_t c = std::max(ceil_div(count, kListFraction), std::min(count, kMinListEntries));
  return static_cast<uint32_t>(std::min<uint64_t>(c, count));
}

std::vector<Table> tables(std::span<const Job> jobs, const char* what) {
  std::vector<Table> out;
  uint64_t list_entries = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    try {
      job.params.validate();
    } catch (const CodecError& e) {
      throw CodecError(job_name(what, i) + ": " + e.what());
    }
    if (job.count > std::numeric_limits<uint32_t>::max())
      throw CodecError(job_name(what, i) + ": " + std::to_string(job.count) +
                       " values; topk indexes a slice with u32, so at most 4294967295");
    if (job.byte_offset % 4 != 0)
      throw CodecError(job_name(what, i) + ": payload offset " + std::to_string(job.byte_offset) +
                       " is not a multiple of 4 (indices and values are 32-bit words)");
    if (job.count == 0) continue;
    const uint64_t tiles = ceil_div(job.count, kTileElements);
    const uint64_t k = job.params.k(job.count);
    const uint64_t entry_tiles = ceil_div(k, kTileElements);
    // Tile numbers are 32-bit: a table holds fewer than 2^31 tiles (one job has at most 2^20).
    constexpr uint64_t kMaxTiles = (uint64_t{1} << 31) - 1;
    if (out.empty() || out.back().count == kMaxJobsPerTable || out.back().tiles + tiles > kMaxTiles) {
      out.emplace_back();
      list_entries = 0;
    }
    Table& t = out.back();
    TableJob& tj = t.jobs[t.count++];
    tj = TableJob{};
    tj.element_offset = job.element_offset;
    tj.byte_offset = job.byte_offset;
    tj.list_begin = list_entries;
    tj.count = static_cast<uint32_t>(job.count);
    tj.k = static_cast<uint32_t>(k);
    tj.tile_begin = t.tiles;
    tj.entry_tile_begin = t.entry_tiles;
    tj.layer = job.layer;
    tj.list_capacity = list_capacity(job.count);
    tj.density_ppb = job.params.density_ppb;
    t.tiles += static_cast<uint32_t>(tiles);
    t.entry_tiles += static_cast<uint32_t>(entry_tiles);
    list_entries += tj.list_capacity;
  }
  return out;
}

void check_first(std::span<const Job> jobs, uint64_t first, const char* array, const char* what) {
  for (size_t i = 0; i < jobs.size(); ++i)
    if (jobs[i].count > 0 && jobs[i].element_offset < first)
      throw CodecError(job_name(what, i) + ": element offset " + std::to_string(jobs[i].element_offset) +
                       " is before " + array + "'s first element " + std::to_string(first));
}

Layout encode_layout(const Table& t) { return layout(t, 1, true); }

Layout stats_layout(const Table& t, size_t candidates) {
  const uint32_t targets = static_cast<uint32_t>(std::clamp<size_t>(candidates, 1, kMaxTargetsPerPass));
  return layout(t, targets, false);
}

uint64_t encode_scratch(const std::vector<Table>& tables) {
  uint64_t bytes = 0;
  for (const Table& t : tables) bytes = std::max(bytes, encode_layout(t).total);
  return bytes;
}

uint64_t stats_scratch(const std::vector<Table>& tables, size_t candidates) {
  if (candidates == 0) return 0;
  uint64_t bytes = 0;
  for (const Table& t : tables) bytes = std::max(bytes, stats_layout(t, candidates).total);
  return bytes;
}

void check_encode(const EncodeBatch& b, const std::vector<Table>& tables, const char* what) {
  check_first(b.jobs, b.input_first, "input", what);
  if (b.residual) check_first(b.jobs, b.residual_first, "residual", what);
  require(b.input && b.payload, what, "input and payload must not be null");
  require(aligned(b.payload, 4), what, "the payload must be 4-byte aligned");
  require(is_valid_dtype(static_cast<uint32_t>(b.input_dtype)), what, "invalid input element type");
  require(aligned(b.input, dtype_size(b.input_dtype)), what, "the input is not aligned to its element size");
  require(aligned(b.residual, 4), what, "the residual is not 4-byte aligned");
  require(aligned(b.nonfinite_values, 8), what, "the non-finite counter is not 8-byte aligned");
  check_scratch(b.scratch, b.scratch_bytes, encode_scratch(tables), what, "encode_scratch_bytes");
}

void check_decode(const DecodeBatch& b, bool accumulate, const char* what) {
  check_first(b.jobs, b.output_first, "output", what);
  require(b.payload && b.output, what, "payload and output must not be null");
  require(aligned(b.payload, 4), what, "the payload must be 4-byte aligned");
  require(is_valid_dtype(static_cast<uint32_t>(b.output_dtype)), what, "invalid output element type");
  require(!accumulate || b.output_dtype == DType::kFloat32, what, "accumulators must be float32");
  require(aligned(b.output, dtype_size(b.output_dtype)), what, "the output is not aligned to its element size");
}

void check_candidate_params(std::span<const TopkParams> candidates, const char* what) {
  if (candidates.size() > kMaxStatsCandidates)
    throw CodecError(std::string(what) + ": " + std::to_string(candidates.size()) + " candidates, at most " +
                     std::to_string(kMaxStatsCandidates) + " per call");
  for (size_t c = 0; c < candidates.size(); ++c) {
    try {
      candidates[c].validate();
    } catch (const CodecError& e) {
      throw CodecError(std::string(what) + ": candidate " + std::to_string(c) + ": " + e.what());
    }
  }
}

void check_candidates(const StatsBatch& b, const char* what) {
  check_candidate_params(b.candidates, what);
  check_stats_columns(b.columns, b.candidates.size(), b.row_stride, what);
}

void check_stats(const StatsBatch& b, const std::vector<Table>& tables, const char* what) {
  check_first(b.jobs, b.input_first, "input", what);
  if (b.residual) check_first(b.jobs, b.residual_first, "residual", what);
  require(b.input && b.squared && b.nonfinite, what, "input, squared and nonfinite must not be null");
  require(is_valid_dtype(static_cast<uint32_t>(b.input_dtype)), what, "invalid input element type");
  require(aligned(b.input, dtype_size(b.input_dtype)), what, "the input is not aligned to its element size");
  require(aligned(b.residual, 4), what, "the residual is not 4-byte aligned");
  require(aligned(b.squared, 8), what, "squared is not 8-byte aligned");
  check_scratch(b.scratch, b.scratch_bytes, stats_scratch(tables, b.candidates.size()), what, "stats_scratch_bytes");
}

}  // namespace lgreco::topk::cuda::plan

namespace lgreco::topk::cuda {

// Declared in topk_cuda.h; host arithmetic, the same in builds with and without CUDA.
uint64_t encode_scratch_bytes(std::span<const Job> jobs) {
  return plan::encode_scratch(plan::tables(jobs, "topk cuda encode_scratch_bytes"));
}

uint64_t stats_scratch_bytes(std::span<const Job> jobs, std::span<const TopkParams> candidates) {
  const char* what = "topk cuda stats_scratch_bytes";
  plan::check_candidate_params(candidates, what);
  return plan::stats_scratch(plan::tables(jobs, what), candidates.size());
}

}  // namespace lgreco::topk::cuda
