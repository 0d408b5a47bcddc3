// Host side of the TopK CUDA kernels (topk_cuda.h): checks a batch, splits its jobs into
// launch tables (passed to the kernels by value) and lays out the caller's scratch. Pure
// C++, no CUDA: what it decides is unit-tested on any machine
// (tests/unit/topk_cuda_host_test.cc), and topk_cuda.cu only launches what it produces.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/topk_cuda.h"

namespace lgreco::topk::cuda::plan {

// A tile: the elements one thread block of a full pass handles at once (256 threads x 16).
constexpr uint32_t kTileElements = 4096;
// Jobs of one launch table (its size, 16 + 64 x 56 bytes, stays under 4 KB of parameters).
constexpr uint32_t kMaxJobsPerTable = 64;
// Selections measured side by side in one pass of the statistics (one histogram each).
constexpr uint32_t kMaxTargetsPerPass = 8;

// The radix select's digits of a 31-bit key (bit 31 of a magnitude key is always 0):
// bits 30..19 (4096 bins), then 18..9 (1024), then 8..0 (512).
constexpr uint32_t kShift1 = 19, kBins1 = 4096;
constexpr uint32_t kShift2 = 9, kBins2 = 1024;
constexpr uint32_t kBins3 = 512;

// An encode's candidate list (the keys in the first digit's boundary bin) holds up to
// ceil(count / kListFraction) entries, at least min(count, kMinListEntries). Real
// gradients put well under 1% of their values there; a job whose bin holds more
// (e.g. many equal magnitudes, mostly zeros) selects from its full data instead.
constexpr uint64_t kListFraction = 32;
constexpr uint64_t kMinListEntries = 4096;
uint32_t list_capacity(uint64_t count);

// One job as the kernels see it. Element e of the job is input[element_offset + e -
// input_first] (likewise residual, output).
struct TableJob {
  uint64_t element_offset;
  uint64_t byte_offset;  // its payload
  uint64_t list_begin;   // encode: first entry of its candidate list in the scratch
  uint32_t count;        // elements, >= 1
  uint32_t k;            // values kept: params.k(count)
  uint32_t tile_begin;   // first tile (kTileElements elements) in the table's tile numbering
  uint32_t entry_tile_begin;  // decode: first tile of its k payload entries
  uint32_t layer;
  uint32_t list_capacity;
  uint32_t density_ppb;
  uint32_t pad;
};
static_assert(sizeof(TableJob) == 56);

struct Table {
  uint32_t count = 0;        // jobs
  uint32_t tiles = 0;        // element tiles of all jobs
  uint32_t entry_tiles = 0;  // decode: payload-entry tiles of all jobs
  uint32_t pad = 0;
  TableJob jobs[kMaxJobsPerTable];
};
static_assert(sizeof(Table) <= 4096);

// Jobs in order, empty ones dropped, at most kMaxJobsPerTable a table. Throws CodecError
// ("<what>: job <i>: ...") on an invalid density, a count of 2^32 or more, or a payload
// offset that is not a multiple of 4.
std::vector<Table> tables(std::span<const Job> jobs, const char* what);
// Throws CodecError naming the first non-empty job that lies before an array's first
// element (`first`, the batch's *_first).
void check_first(std::span<const Job> jobs, uint64_t first, const char* array, const char* what);

// Per-job and per-selection state the kernels keep in the scratch.
struct JobState {
  uint32_t list_count;  // entries offered to the candidate list (> capacity: it overflowed)
  uint32_t nonfinite;   // statistics: 1 when the job has a non-finite value
  uint32_t pad[2];
};
struct SelState {
  uint32_t need;    // after a round: how many of the keys matching `prefix` are still to keep
  uint32_t prefix;  // the key bits of the k-th largest key found so far (all of them after round 3)
  uint32_t pad[2];
};

// Byte offsets into the scratch of one table's launches. [0, zero_end) is zeroed before the
// first pass; for the statistics [group_begin, zero_end) again before each group of
// candidates. Every region starts on a 256-byte boundary.
struct Layout {
  uint32_t targets = 1;  // selections per job: 1 for encode, a group's for statistics
  uint64_t job_state = 0;   // JobState[jobs]
  uint64_t hist1 = 0;       // u32[jobs][kBins1]
  // Encode only, u32[tiles]: values above the threshold key, values equal to it, and 1
  // where the residual was left as it was (a tile with a non-finite x) rather than
  // replaced by x.
  uint64_t tile_above = 0;
  uint64_t tile_equal = 0;
  uint64_t tile_raw = 0;
  uint64_t group_begin = 0;
  uint64_t sel = 0;      // SelState[jobs][targets]
  uint64_t hist2 = 0;    // u32[jobs][targets][kBins2]
  uint64_t hist3 = 0;    // u32[jobs][targets][kBins3]
  uint64_t zero_end = 0;
  uint64_t off_above = 0;  // u32[tiles], exclusive sums per job (written by the scan)
  uint64_t off_equal = 0;  // u32[tiles]
  uint64_t list = 0;       // encode: {key, index} u32 pairs, sum of the jobs' capacities
  uint64_t tile_sums = 0;  // statistics: double[tiles][targets]
  uint64_t total = 0;
};
Layout encode_layout(const Table& t);
Layout stats_layout(const Table& t, size_t candidates);

// The scratch a batch needs: the largest layout of its tables (they run one after another).
uint64_t encode_scratch(const std::vector<Table>& tables);
uint64_t stats_scratch(const std::vector<Table>& tables, size_t candidates);

// The checks of a batch's pointers and sizes that need no device: null arrays, alignment,
// element types, the scratch; each throws CodecError prefixed with `what`.
void check_encode(const EncodeBatch& b, const std::vector<Table>& tables, const char* what);
void check_decode(const DecodeBatch& b, bool accumulate, const char* what);
void check_stats(const StatsBatch& b, const std::vector<Table>& tables, const char* what);
// The candidates of a statistics call: at most kMaxStatsCandidates, valid densities, and
// (check_candidates) one distinct column below the row stride each; throws CodecError.
void check_candidate_params(std::span<const TopkParams> candidates, const char* what);
void check_candidates(const StatsBatch& b, const char* what);

}  // namespace lgreco::topk::cuda::plan
