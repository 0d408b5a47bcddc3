// The TopK codec's CUDA kernels and the order they are launched in (topk_cuda.h,
// docs/KERNELS.md "TopK"). Compiled by nvcc for the GPU (kernels/topk_cuda.cu), and by the
// host compiler over tests/unit/block_emulator.h, which emulates thread blocks on the CPU
// (tests/unit/topk_cuda_emulation_test.cc): the same code, compared with the CPU reference
// on machines without a GPU. Include <cuda_runtime.h> or the emulator first.
//
// Vocabulary. A tile is kTileElements (4096) consecutive elements of one job; a block of
// 256 threads handles a tile at a time, thread t holding its elements t, t + 256, ...,
// t + 15 x 256 (item q is element q x 256 + t: every load of a warp is contiguous). A
// full pass walks every tile of the table: block b takes a contiguous range of tiles
// (the grid is min(tiles, 4 x SMs) blocks: it depends on the sizes only), so a block
// meets the jobs in order and flushes its shared histogram when the job changes. A
// selection (a "target") is one k to find in one job: encode has one per job, the
// statistics one per candidate density.
//
// The one float32 operation, input + residual, is quant::f32_add (__fadd_rn on the
// device; the Makefile builds with --fmad=false), so x is the CPU reference's bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/hd.h"
#include "kernels/quant_math.h"
#include "kernels/topk.h"
#include "kernels/topk_cuda.h"
#include "kernels/topk_cuda_plan.h"

// The kernels' namespace: `kernels` under nvcc, `emulated_kernels` when the host compiler
// builds them over the block emulator, so that the two builds never share a symbol (a
// kernel's host-side launch stub and its emulated function would have one mangled name).
#if defined(__CUDACC__)
namespace lgreco::topk::cuda::kernels {
#else
namespace lgreco::topk::cuda::emulated_kernels {
#endif

using plan::JobState;
using plan::SelState;
using plan::Table;
using plan::TableJob;

constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;
constexpr uint32_t kItems = plan::kTileElements / kThreads;  // 16
constexpr uint32_t kFull = 0xffffffffu;
// Blocks of a full pass per multiprocessor: 4 x 256 threads x 16 loads in flight each
// (64 KB per SM for float32) is what the HBM's latency asks for; the 16 KB first-digit
// histogram of each fits 4 times in any sm_80+ shared memory.
constexpr uint32_t kBlocksPerSm = 4;
constexpr uint32_t kEncodeTargets = 1;
constexpr uint32_t kStatsTargets = plan::kMaxTargetsPerPass;
static_assert(kItems * kWarps == 4 * 32, "tile_scan scans 4 counts per lane of one warp");

// ---------------------------------------------------------------------------------------
// Kernel arguments

// Pointers into one table's scratch (plan::Layout).
struct Scratch {
  JobState* jobs;
  SelState* sel;  // [job][stride]
  uint32_t* hist1;
  uint32_t* hist2;
  uint32_t* hist3;
  uint32_t* tile_above;
  uint32_t* tile_equal;
  uint32_t* tile_raw;
  uint32_t* off_above;
  uint32_t* off_equal;
  uint2* list;  // {key, index within the job}
  double* tile_sums;  // [tile][stride]
  uint32_t stride;  // selections per job in sel and the histograms (plan::Layout::targets)
};

// The element arrays of a pass.
struct Arrays {
  const void* input;
  uint64_t input_first;
  const float* residual;  // null: no error feedback
  uint64_t residual_first;
  const uint8_t* skip_residual;
  // Encode after the first pass: a tile not marked raw holds x in the residual.
  bool materialized;
};

struct PassArgs {
  Arrays a;
  Scratch s;
  float* residual_out;  // encode: the residual, written
  unsigned long long* nonfinite_values;
  uint8_t* payload;
  bool materialize;  // first pass of an encode with error feedback: replace the residual by x
  bool stats;        // first pass of the statistics: mark jobs with a non-finite value
  uint32_t active;   // statistics: selections of this group (<= s.stride)
};

struct SelectArgs {
  Scratch s;
  uint32_t round;   // 1, 2 or 3
  uint32_t active;  // selections per job in this group
  bool stats;
  uint32_t density_ppb[plan::kMaxTargetsPerPass];  // statistics: the group's candidates
};

struct DecodeArgs {
  const uint8_t* payload;
  void* output;
  uint64_t output_first;
};

struct ReduceArgs {
  Scratch s;
  double* squared;
  uint8_t* nonfinite;
  double weight;
  uint32_t row_stride;
  uint32_t columns[plan::kMaxTargetsPerPass];
};

// A kernel's parameters stay within the 4 KB every CUDA version accepts.
static_assert(sizeof(Table) + sizeof(PassArgs) <= 4096 && sizeof(Table) + sizeof(SelectArgs) <= 4096 &&
              sizeof(Table) + sizeof(ReduceArgs) <= 4096 && sizeof(Table) + sizeof(DecodeArgs) <= 4096);

// ---------------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ uint32_t warp_id() { return threadIdx.x / 32; }
__device__ __forceinline__ uint32_t umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

// The largest j with jobs[j].*begin <= tile (every job has at least one tile).
template <uint32_t TableJob::*kBegin>
__device__ uint32_t job_of(const Table& t, uint32_t tile) {
  uint32_t lo = 0, hi = t.count;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (t.jobs[mid].*kBegin <= tile)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// This block's contiguous share [begin, end) of `total` tiles.
__device__ __forceinline__ void my_tiles(uint32_t total, uint32_t& begin, uint32_t& end) {
  begin = static_cast<uint32_t>(uint64_t{total} * blockIdx.x / gridDim.x);
  end = static_cast<uint32_t>(uint64_t{total} * (blockIdx.x + 1) / gridDim.x);
}

__device__ __forceinline__ bool uses_residual(const Arrays& a, const TableJob& job) {
  return a.residual != nullptr && !(a.skip_residual != nullptr && a.skip_residual[job.layer] != 0);
}

// Whether an encode job selects from its candidate list (it did not overflow).
__device__ __forceinline__ bool uses_list(const Scratch& s, const TableJob& job, uint32_t j) {
  return job.list_capacity > 0 && s.jobs[j].list_count <= job.list_capacity;
}

__device__ __forceinline__ uint32_t tile_count(const TableJob& job) {
  return (job.count + plan::kTileElements - 1) / plan::kTileElements;
}

// k of `count` values at `ppb` parts per billion: TopkParams::k, in the same integers.
__device__ __forceinline__ uint32_t k_of(uint32_t count, uint32_t ppb) {
  return static_cast<uint32_t>((uint64_t{count} * ppb + TopkParams::kPartsPerUnit - 1) / TopkParams::kPartsPerUnit);
}

// x = input (+ residual) of this thread's items of tile `local` of the job, NaN canonical,
// as topk_ref.cc's values_of; 0 past the job's end. `raw`: read input + residual even when
// the residual holds x (the first pass, and tiles whose residual was left as it was).
template <DType T>
__device__ __forceinline__ void load_tile(float (&x)[kItems], const Arrays& a, const TableJob& job, uint32_t local,
                                          bool residual, bool raw) {
  const uint32_t base = local * plan::kTileElements + threadIdx.x;
  const uint64_t in0 = job.element_offset - a.input_first;
  const uint64_t r0 = job.element_offset - a.residual_first;
  if (residual && a.materialized && !raw) {
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const uint32_t i = base + q * kThreads;
      x[q] = i < job.count ? a.residual[r0 + i] : 0.0f;
    }
    return;
  }
  LGRECO_UNROLL
  for (uint32_t q = 0; q < kItems; ++q) {
    const uint32_t i = base + q * kThreads;
    float v = 0.0f;
    if (i < job.count) {
      v = load_as_float<T>(a.input, in0 + i);
      if (residual) v = quant::f32_add(v, a.residual[r0 + i]);
    }
    x[q] = quant::canonical_nan(v);
  }
}

__device__ __forceinline__ bool item_valid(const TableJob& job, uint32_t local, uint32_t q) {
  return local * plan::kTileElements + q * kThreads + threadIdx.x < job.count;
}
__device__ __forceinline__ uint32_t item_index(uint32_t local, uint32_t q) {
  return local * plan::kTileElements + q * kThreads + threadIdx.x;
}

// Adds one to bin d of a shared histogram for each lane where `valid`. A warp whose lanes
// all fall in one bin (all-equal data: zero gradients) adds 32 with one atomic instead of
// 32 conflicting ones. Every lane of the warp must call it.
__device__ __forceinline__ void hist_add(uint32_t* hist, uint32_t d, bool valid) {
  const uint32_t d0 = __shfl_sync(kFull, d, 0);
  if (__all_sync(kFull, valid && d == d0)) {
    if (lane_id() == 0) atomicAdd(&hist[d0], 32u);
  } else if (valid) {
    atomicAdd(&hist[d], 1u);
  }
}

// Adds a block's shared histogram (bins words) to the global one and clears it.
__device__ void flush_hist(uint32_t* shared, uint32_t* global, uint32_t bins) {
  __syncthreads();
  for (uint32_t b = threadIdx.x; b < bins; b += kThreads) {
    const uint32_t v = shared[b];
    if (v != 0) {
      atomicAdd(&global[b], v);
      shared[b] = 0;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
  LGRECO_UNROLL
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  LGRECO_UNROLL
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// The block's sum, to every thread. `sh`: kWarps words of shared memory.
template <class V>
__device__ V block_sum(V v, V* sh) {
  v = warp_sum(v);
  if (lane_id() == 0) sh[warp_id()] = v;
  __syncthreads();
  V s = 0;
  LGRECO_UNROLL
  for (uint32_t w = 0; w < kWarps; ++w) s += sh[w];  // the same fixed order in every thread
  __syncthreads();
  return s;
}

// Inclusive prefix sum over the block's threads; `total` gets the block's sum.
__device__ uint32_t block_scan(uint32_t v, uint32_t* sh, uint32_t& total) {
  const uint32_t lane = lane_id(), warp = warp_id();
  LGRECO_UNROLL
  for (uint32_t o = 1; o < 32; o *= 2) {
    const uint32_t n = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += n;
  }
  if (lane == 31) sh[warp] = v;
  __syncthreads();
  uint32_t before = 0;
  total = 0;
  LGRECO_UNROLL
  for (uint32_t w = 0; w < kWarps; ++w) {
    const uint32_t s = sh[w];
    if (w < warp) before += s;
    total += s;
  }
  __syncthreads();
  return v + before;
}

// Compaction in element order, for the items of a tile whose bit q of `flags` is set
// (item q of thread t is element q x 256 + t, so the order is item row q, then warp, then
// lane). tile_scan leaves in sh[q x kWarps + w] the number of flagged items before warp
// w's items of row q and returns the tile's count; rank_of then gives each flagged item
// its place. Every thread of the block calls both (ballots); `sh` holds kItems x kWarps + 1
// words and is free again after a __syncthreads() that follows the last rank_of.
__device__ uint32_t tile_scan(uint32_t flags, uint32_t* sh) {
  const uint32_t lane = lane_id(), warp = warp_id();
  LGRECO_UNROLL
  for (uint32_t q = 0; q < kItems; ++q) {
    const uint32_t ballot = __ballot_sync(kFull, (flags >> q) & 1u);
    if (lane == 0) sh[q * kWarps + warp] = __popc(ballot);
  }
  __syncthreads();
  if (warp == 0) {
    uint32_t c[4], sum = 0;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < 4; ++q) {
      c[q] = sh[lane * 4 + q];
      sum += c[q];
    }
    uint32_t inclusive = sum;
    LGRECO_UNROLL
    for (uint32_t o = 1; o < 32; o *= 2) {
      const uint32_t n = __shfl_up_sync(kFull, inclusive, o);
      if (lane >= o) inclusive += n;
    }
    uint32_t run = inclusive - sum;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < 4; ++q) {
      sh[lane * 4 + q] = run;
      run += c[q];
    }
    if (lane == 31) sh[kItems * kWarps] = inclusive;
  }
  __syncthreads();
  return sh[kItems * kWarps];
}

__device__ __forceinline__ uint32_t rank_of(uint32_t flags, uint32_t q, const uint32_t* sh) {
  const uint32_t ballot = __ballot_sync(kFull, (flags >> q) & 1u);
  return sh[q * kWarps + warp_id()] + __popc(ballot & ((1u << lane_id()) - 1u));
}

// ---------------------------------------------------------------------------------------
// Pass 1 (full): x, the first digit's histogram per job, non-finite values; an encode with
// error feedback stores x in the residual of every tile whose x are all finite (a tile
// with a non-finite x keeps its residual, as the format requires, and is marked raw).

template <DType T, bool kResidual>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) first_pass_kernel(const __grid_constant__ Table t,
                                                              const __grid_constant__ PassArgs p) {
  __shared__ uint32_t hist[plan::kBins1];
  __shared__ uint32_t sums[kWarps];
  for (uint32_t b = threadIdx.x; b < plan::kBins1; b += kThreads) hist[b] = 0;
  __syncthreads();
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  uint32_t nonfinite = 0;
  uint32_t current = ~0u;
  for (uint32_t tile = begin; tile < end; ++tile) {
    const uint32_t j = job_of<&TableJob::tile_begin>(t, tile);
    if (j != current) {
      if (current != ~0u) flush_hist(hist, p.s.hist1 + uint64_t{current} * plan::kBins1, plan::kBins1);
      current = j;
    }
    const TableJob& job = t.jobs[j];
    const uint32_t local = tile - job.tile_begin;
    const bool residual = kResidual && uses_residual(p.a, job);
    float x[kItems];
    load_tile<T>(x, p.a, job, local, residual, true);
    uint32_t bad = 0;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) bad += item_valid(job, local, q) && !quant::is_finite_value(x[q]);
    nonfinite += bad;
    if (residual && p.materialize) {
      if (!__syncthreads_or(bad != 0)) {
        float* r = p.residual_out + (job.element_offset - p.a.residual_first);
        LGRECO_UNROLL
        for (uint32_t q = 0; q < kItems; ++q)
          if (item_valid(job, local, q)) r[item_index(local, q)] = x[q];
      } else if (threadIdx.x == 0) {
        p.s.tile_raw[tile] = 1;
      }
    }
    if (p.stats && bad != 0) p.s.jobs[j].nonfinite = 1;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q)
      hist_add(hist, magnitude_key(x[q]) >> plan::kShift1, item_valid(job, local, q));
  }
  if (current != ~0u) flush_hist(hist, p.s.hist1 + uint64_t{current} * plan::kBins1, plan::kBins1);
  const uint32_t total = block_sum(nonfinite, sums);
  if (threadIdx.x == 0 && total != 0 && p.nonfinite_values != nullptr)
    atomicAdd(p.nonfinite_values, static_cast<unsigned long long>(total));
}

// ---------------------------------------------------------------------------------------
// Select: one block per selection finds, in a round's histogram, the digit of the k-th
// largest key among the keys that match the prefix so far, and how many of that digit's
// keys are still to be kept.

__global__ void __launch_bounds__(kThreads) select_kernel(const __grid_constant__ Table t,
                                                          const __grid_constant__ SelectArgs a) {
  __shared__ uint32_t sh[kWarps];
  const uint32_t j = blockIdx.x / a.s.stride, target = blockIdx.x % a.s.stride;
  if (target >= a.active) return;
  if (a.stats && a.s.jobs[j].nonfinite != 0) return;
  const TableJob& job = t.jobs[j];
  SelState* st = a.s.sel + uint64_t{j} * a.s.stride + target;
  const uint64_t row = uint64_t{j} * a.s.stride + target;
  const uint32_t* hist;
  uint32_t bins, shift;
  uint32_t need;
  if (a.round == 1) {
    hist = a.s.hist1 + uint64_t{j} * plan::kBins1;
    bins = plan::kBins1;
    shift = plan::kShift1;
    need = a.stats ? k_of(job.count, a.density_ppb[target]) : job.k;
  } else if (a.round == 2) {
    hist = a.s.hist2 + row * plan::kBins2;
    bins = plan::kBins2;
    shift = plan::kShift2;
    need = st->need;
  } else {
    hist = a.s.hist3 + row * plan::kBins3;
    bins = plan::kBins3;
    shift = 0;
    need = st->need;
  }
  const uint32_t per = bins / kThreads;
  const uint32_t first = threadIdx.x * per;
  uint32_t mine = 0;
  for (uint32_t q = 0; q < per; ++q) mine += hist[first + q];
  uint32_t total;
  const uint32_t inclusive = block_scan(mine, sh, total);
  uint32_t above = total - inclusive;  // keys in the bins of higher threads
  for (uint32_t q = per; q-- > 0;) {
    const uint32_t c = hist[first + q];
    if (above < need && need <= above + c) {
      st->prefix = (a.round == 1 ? 0u : st->prefix) | ((first + q) << shift);
      st->need = need - above;
    }
    above += c;
  }
}

// ---------------------------------------------------------------------------------------
// Encode pass 2 (full): per tile, the values whose first digit is above the boundary's
// (kept whatever the rest of the key); those in the boundary bin go to the job's
// candidate list, in tile order through one atomic per tile.

template <DType T, bool kResidual>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) collect_kernel(const __grid_constant__ Table t,
                                                           const __grid_constant__ PassArgs p) {
  __shared__ uint32_t sh[kItems * kWarps + 1];
  __shared__ uint32_t sums[kWarps];
  __shared__ uint32_t list_base;
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  for (uint32_t tile = begin; tile < end; ++tile) {
    const uint32_t j = job_of<&TableJob::tile_begin>(t, tile);
    const TableJob& job = t.jobs[j];
    const uint32_t local = tile - job.tile_begin;
    const bool residual = kResidual && uses_residual(p.a, job);
    const bool raw = residual && p.s.tile_raw[tile] != 0;
    float x[kItems];
    load_tile<T>(x, p.a, job, local, residual, raw);
    const uint32_t boundary = p.s.sel[j].prefix >> plan::kShift1;
    uint32_t candidate = 0;  // bit q: item q is in the boundary bin
    uint32_t sure = 0;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const bool valid = item_valid(job, local, q);
      const uint32_t digit = magnitude_key(x[q]) >> plan::kShift1;
      sure += valid && digit > boundary;
      candidate |= static_cast<uint32_t>(valid && digit == boundary) << q;
    }
    const uint32_t count = tile_scan(candidate, sh);
    if (count != 0) {
      if (threadIdx.x == 0) list_base = atomicAdd(&p.s.jobs[j].list_count, count);
      __syncthreads();
      const uint32_t base = list_base;
      uint2* list = p.s.list + job.list_begin;
      LGRECO_UNROLL
      for (uint32_t q = 0; q < kItems; ++q) {
        const uint32_t slot = base + rank_of(candidate, q, sh);
        if ((candidate >> q) & 1u && slot < job.list_capacity)
          list[slot] = make_uint2(magnitude_key(x[q]), item_index(local, q));
      }
    }
    __syncthreads();
    const uint32_t total = block_sum(sure, sums);
    if (threadIdx.x == 0) p.s.tile_above[tile] = total;
  }
}

// ---------------------------------------------------------------------------------------
// Rounds 2 and 3: the histogram of the next digit among the keys matching each
// selection's prefix, from the candidate list (encode, when it did not overflow) or from
// the full data. Round 3 of the statistics also sums, per tile and selection, x^2 of the
// values below the round's range (certainly not kept).

template <DType T, bool kResidual, bool kEncode, uint32_t kRound>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) refine_kernel(const __grid_constant__ Table t,
                                                          const __grid_constant__ PassArgs p) {
  constexpr uint32_t kTargets = kEncode ? kEncodeTargets : kStatsTargets;
  constexpr uint32_t kBins = kRound == 2 ? plan::kBins2 : plan::kBins3;
  constexpr uint32_t kMatchShift = kRound == 2 ? plan::kShift1 : plan::kShift2;
  constexpr uint32_t kDigitShift = kRound == 2 ? plan::kShift2 : 0;
  constexpr bool kSums = !kEncode && kRound == 3;
  __shared__ uint32_t hist[kTargets * kBins];
  __shared__ double sums[kSums ? kTargets : 1][kWarps];
  uint32_t* global_hist = kRound == 2 ? p.s.hist2 : p.s.hist3;
  const uint32_t active = kEncode ? 1 : p.active;
  const uint32_t bins = active * kBins;  // the active histograms, contiguous
  for (uint32_t b = threadIdx.x; b < kTargets * kBins; b += kThreads) hist[b] = 0;
  __syncthreads();

  // Full data: every tile of a job that has no candidate list.
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  uint32_t current = ~0u;
  uint32_t match[kTargets];  // per selection: its prefix, the key bits fixed so far
  LGRECO_UNROLL
  for (uint32_t g = 0; g < kTargets; ++g) match[g] = ~0u;
  for (uint32_t tile = begin; tile < end; ++tile) {
    const uint32_t j = job_of<&TableJob::tile_begin>(t, tile);
    const TableJob& job = t.jobs[j];
    if (kEncode ? uses_list(p.s, job, j) : p.s.jobs[j].nonfinite != 0) continue;
    if (j != current) {
      if (current != ~0u) flush_hist(hist, global_hist + uint64_t{current} * p.s.stride * kBins, bins);
      current = j;
      LGRECO_UNROLL
      for (uint32_t g = 0; g < kTargets; ++g)
        match[g] = g < active ? p.s.sel[uint64_t{j} * p.s.stride + g].prefix >> kMatchShift : ~0u;
    }
    const uint32_t local = tile - job.tile_begin;
    const bool residual = kResidual && uses_residual(p.a, job);
    const bool raw = kEncode && residual && p.s.tile_raw[tile] != 0;
    float x[kItems];
    load_tile<T>(x, p.a, job, local, residual, raw);
    double below[kSums ? kTargets : 1] = {};
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const bool valid = item_valid(job, local, q);
      const uint32_t key = magnitude_key(x[q]);
      const uint32_t digit = (key >> kDigitShift) & (kBins - 1);
      LGRECO_UNROLL
      for (uint32_t g = 0; g < kTargets; ++g) {
        if (g >= active) break;
        hist_add(hist + g * kBins, digit, valid && (key >> kMatchShift) == match[g]);
        if constexpr (kSums) {
          const double v = static_cast<double>(x[q]);
          if (valid && (key >> kMatchShift) < match[g]) below[g] += v * v;
        }
      }
    }
    if constexpr (kSums) {
      LGRECO_UNROLL
      for (uint32_t g = 0; g < kTargets; ++g) {
        if (g >= active) break;
        const double s = warp_sum(below[g]);
        if (lane_id() == 0) sums[g][warp_id()] = s;
      }
      __syncthreads();
      if (threadIdx.x < active) {
        double s = 0.0;
        for (uint32_t w = 0; w < kWarps; ++w) s += sums[threadIdx.x][w];
        p.s.tile_sums[uint64_t{tile} * p.s.stride + threadIdx.x] = s;
      }
      __syncthreads();
    }
  }
  if (current != ~0u) flush_hist(hist, global_hist + uint64_t{current} * p.s.stride * kBins, bins);

  // Candidate lists: each block takes every gridDim.x-th run of 256 entries of each list.
  if constexpr (kEncode) {
    for (uint32_t j = 0; j < t.count; ++j) {
      const TableJob& job = t.jobs[j];
      if (!uses_list(p.s, job, j)) continue;
      const uint32_t n = p.s.jobs[j].list_count;
      if (blockIdx.x * kThreads >= n) continue;
      const uint32_t prefix = p.s.sel[j].prefix >> kMatchShift;
      const uint2* list = p.s.list + job.list_begin;
      for (uint32_t e0 = blockIdx.x * kThreads; e0 < n; e0 += gridDim.x * kThreads) {
        const uint32_t e = e0 + threadIdx.x;
        const uint32_t key = e < n ? list[e].x : 0;
        hist_add(hist, (key >> kDigitShift) & (kBins - 1), e < n && (key >> kMatchShift) == prefix);
      }
      flush_hist(hist, global_hist + uint64_t{j} * kBins, kBins);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Encode: per tile, the boundary bin's values above the threshold key and equal to it
// (the values above the boundary bin were counted by collect_kernel).

template <DType T, bool kResidual>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) attribute_kernel(const __grid_constant__ Table t,
                                                             const __grid_constant__ PassArgs p) {
  __shared__ uint32_t sums[kWarps];
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  for (uint32_t tile = begin; tile < end; ++tile) {
    const uint32_t j = job_of<&TableJob::tile_begin>(t, tile);
    const TableJob& job = t.jobs[j];
    if (uses_list(p.s, job, j)) continue;
    const uint32_t local = tile - job.tile_begin;
    const bool residual = kResidual && uses_residual(p.a, job);
    const bool raw = residual && p.s.tile_raw[tile] != 0;
    float x[kItems];
    load_tile<T>(x, p.a, job, local, residual, raw);
    const uint32_t threshold = p.s.sel[j].prefix;
    uint32_t above = 0, equal = 0;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const bool valid = item_valid(job, local, q);
      const uint32_t key = magnitude_key(x[q]);
      above += valid && key > threshold && (key >> plan::kShift1) == (threshold >> plan::kShift1);
      equal += valid && key == threshold;
    }
    above = block_sum(above, sums);
    equal = block_sum(equal, sums);
    if (threadIdx.x == 0) {
      p.s.tile_above[tile] += above;
      p.s.tile_equal[tile] = equal;
    }
  }
  for (uint32_t j = 0; j < t.count; ++j) {
    const TableJob& job = t.jobs[j];
    if (!uses_list(p.s, job, j)) continue;
    const uint32_t n = p.s.jobs[j].list_count;
    const uint32_t threshold = p.s.sel[j].prefix;
    const uint2* list = p.s.list + job.list_begin;
    for (uint32_t e = blockIdx.x * kThreads + threadIdx.x; e < n; e += gridDim.x * kThreads) {
      const uint2 entry = list[e];
      const uint32_t tile = job.tile_begin + entry.y / plan::kTileElements;
      if (entry.x > threshold)
        atomicAdd(&p.s.tile_above[tile], 1u);
      else if (entry.x == threshold)
        atomicAdd(&p.s.tile_equal[tile], 1u);
    }
  }
}

// Encode: exclusive sums of each job's per-tile counts (one block per job), so that each
// tile knows where its kept values go.
__global__ void __launch_bounds__(kThreads) scan_kernel(const __grid_constant__ Table t, const __grid_constant__ Scratch s) {
  __shared__ uint32_t sh[kWarps];
  const TableJob& job = t.jobs[blockIdx.x];
  const uint32_t tiles = tile_count(job);
  const uint32_t* above = s.tile_above + job.tile_begin;
  const uint32_t* equal = s.tile_equal + job.tile_begin;
  uint32_t* off_above = s.off_above + job.tile_begin;
  uint32_t* off_equal = s.off_equal + job.tile_begin;
  uint32_t carry_above = 0, carry_equal = 0;
  for (uint32_t c = 0; c < tiles; c += kThreads * 4) {
    const uint32_t i0 = c + threadIdx.x * 4;
    uint32_t a[4], e[4], sum_a = 0, sum_e = 0;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < 4; ++q) {
      a[q] = i0 + q < tiles ? above[i0 + q] : 0;
      e[q] = i0 + q < tiles ? equal[i0 + q] : 0;
      sum_a += a[q];
      sum_e += e[q];
    }
    uint32_t total_a, total_e;
    uint32_t run_a = carry_above + block_scan(sum_a, sh, total_a) - sum_a;
    uint32_t run_e = carry_equal + block_scan(sum_e, sh, total_e) - sum_e;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < 4; ++q) {
      if (i0 + q < tiles) {
        off_above[i0 + q] = run_a;
        off_equal[i0 + q] = run_e;
      }
      run_a += a[q];
      run_e += e[q];
    }
    carry_above += total_a;
    carry_equal += total_e;
  }
}

// Encode, last pass (full): writes each tile's kept values in index order, every value
// above the threshold key and the first (need) equal to it in the job, and the residuals.
template <DType T, bool kResidual>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) write_kernel(const __grid_constant__ Table t,
                                                         const __grid_constant__ PassArgs p) {
  __shared__ uint32_t sh[kItems * kWarps + 1];
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  for (uint32_t tile = begin; tile < end; ++tile) {
    const uint32_t j = job_of<&TableJob::tile_begin>(t, tile);
    const TableJob& job = t.jobs[j];
    const uint32_t local = tile - job.tile_begin;
    const bool residual = kResidual && uses_residual(p.a, job);
    const bool raw = residual && p.s.tile_raw[tile] != 0;
    const SelState st = p.s.sel[j];
    const uint32_t threshold = st.prefix, need_equal = st.need;
    const uint32_t equal_before = p.s.off_equal[tile], equal_here = p.s.tile_equal[tile];
    const uint32_t equal_take =
        equal_before >= need_equal ? 0 : umin(equal_here, need_equal - equal_before);
    // A tile with nothing to keep needs no work, unless its residuals are still to write.
    if (p.s.tile_above[tile] + equal_take == 0 && !raw) continue;
    float x[kItems];
    load_tile<T>(x, p.a, job, local, residual, raw);
    uint32_t kept = 0;  // bit q: item q is kept
    if (equal_take > 0 && equal_take < equal_here) {
      // The tile where the ties run out: the first equal_take of its equal keys.
      uint32_t equal = 0;
      LGRECO_UNROLL
      for (uint32_t q = 0; q < kItems; ++q)
        equal |= static_cast<uint32_t>(item_valid(job, local, q) && magnitude_key(x[q]) == threshold) << q;
      tile_scan(equal, sh);
      LGRECO_UNROLL
      for (uint32_t q = 0; q < kItems; ++q) {
        const bool take = rank_of(equal, q, sh) < equal_take;
        kept |= static_cast<uint32_t>(item_valid(job, local, q) &&
                                      (magnitude_key(x[q]) > threshold || ((equal >> q) & 1u && take)))
                << q;
      }
      __syncthreads();
    } else {
      LGRECO_UNROLL
      for (uint32_t q = 0; q < kItems; ++q) {
        const uint32_t key = magnitude_key(x[q]);
        kept |= static_cast<uint32_t>(item_valid(job, local, q) && (key > threshold || (equal_take > 0 && key == threshold)))
                << q;
      }
    }
    tile_scan(kept, sh);
    const uint32_t out = p.s.off_above[tile] + umin(equal_before, need_equal);
    uint32_t* index = reinterpret_cast<uint32_t*>(p.payload + job.byte_offset);
    uint32_t* value = index + job.k;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const uint32_t at = out + rank_of(kept, q, sh);
      if ((kept >> q) & 1u && at < job.k) {  // the bound only matters if the counts were inconsistent
        index[at] = item_index(local, q);
        value[at] = float_bits(x[q]);
      }
    }
    __syncthreads();
    if (residual) {
      float* r = p.residual_out + (job.element_offset - p.a.residual_first);
      LGRECO_UNROLL
      for (uint32_t q = 0; q < kItems; ++q) {
        if (!item_valid(job, local, q)) continue;
        if (raw) {
          if (quant::is_finite_value(x[q])) r[item_index(local, q)] = (kept >> q) & 1u ? 0.0f : x[q];
        } else if ((kept >> q) & 1u) {
          r[item_index(local, q)] = 0.0f;  // the residual holds x already
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Decode

template <DType T>
__global__ void __launch_bounds__(kThreads) zero_kernel(const __grid_constant__ Table t,
                                                        const __grid_constant__ DecodeArgs a) {
  uint32_t begin, end;
  my_tiles(t.tiles, begin, end);
  for (uint32_t tile = begin; tile < end; ++tile) {
    const TableJob& job = t.jobs[job_of<&TableJob::tile_begin>(t, tile)];
    const uint32_t local = tile - job.tile_begin;
    const uint64_t o0 = job.element_offset - a.output_first;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q)
      if (item_valid(job, local, q)) store_from_float(a.output, T, o0 + item_index(local, q), 0.0f);
  }
}

// One thread per payload entry. An entry whose index is not below the count or not above
// the previous entry's is skipped: corrupt input must not write outside the job.
template <DType T, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) scatter_kernel(const __grid_constant__ Table t,
                                                           const __grid_constant__ DecodeArgs a) {
  uint32_t begin, end;
  my_tiles(t.entry_tiles, begin, end);
  for (uint32_t tile = begin; tile < end; ++tile) {
    const TableJob& job = t.jobs[job_of<&TableJob::entry_tile_begin>(t, tile)];
    const uint32_t first = (tile - job.entry_tile_begin) * plan::kTileElements + threadIdx.x;
    const uint32_t* index = reinterpret_cast<const uint32_t*>(a.payload + job.byte_offset);
    const uint32_t* value = index + job.k;
    const uint64_t o0 = job.element_offset - a.output_first;
    LGRECO_UNROLL
    for (uint32_t q = 0; q < kItems; ++q) {
      const uint32_t e = first + q * kThreads;
      if (e >= job.k) break;
      const uint32_t i = index[e];
      if (i >= job.count || (e > 0 && i <= index[e - 1])) continue;
      const float v = bits_float(value[e]);
      if constexpr (kAccumulate) {
        float* acc = static_cast<float*>(a.output) + o0 + i;
        *acc = quant::canonical_nan(quant::f32_add(*acc, v));
      } else {
        store_from_float(a.output, T, o0 + i, v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Statistics: one block per selection of the group adds, job after job, its error: the
// tiles' sums below round 3's range, the round-3 bins below the threshold key (each bin is
// one key, one magnitude), and the threshold's equal keys that are not kept.

__global__ void __launch_bounds__(kThreads) stats_reduce_kernel(const __grid_constant__ Table t,
                                                                const __grid_constant__ ReduceArgs a) {
  __shared__ double sh[kWarps];
  const uint32_t g = blockIdx.x;
  for (uint32_t j = 0; j < t.count; ++j) {
    const TableJob& job = t.jobs[j];
    double* out = a.squared + uint64_t{job.layer} * a.row_stride + a.columns[g];
    if (a.s.jobs[j].nonfinite != 0) {
      if (threadIdx.x == 0) {
        *out += a.weight * static_cast<double>(bits_float(0x7f800000u));
        a.nonfinite[job.layer] = 1;
      }
      continue;
    }
    const uint64_t row = uint64_t{j} * a.s.stride + g;
    const SelState st = a.s.sel[row];
    const uint32_t* hist = a.s.hist3 + row * plan::kBins3;
    const uint32_t low = st.prefix & (plan::kBins3 - 1), range = st.prefix - low;
    double local = 0.0;
    const uint32_t tiles = tile_count(job);
    for (uint32_t i = threadIdx.x; i < tiles; i += kThreads)
      local += a.s.tile_sums[uint64_t{job.tile_begin + i} * a.s.stride + g];
    for (uint32_t b = threadIdx.x; b < low; b += kThreads) {
      const double v = static_cast<double>(bits_float(range | b));
      local += static_cast<double>(hist[b]) * (v * v);
    }
    double total = block_sum(local, sh);
    if (threadIdx.x == 0) {
      const double v = static_cast<double>(bits_float(st.prefix));
      total += static_cast<double>(hist[low] - st.need) * (v * v);
      *out += a.weight * total;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Launch sequences, over a launcher L (CUDA's in topk_cuda.cu, the emulator's in the tests):
//   uint32_t L::full_grid(uint32_t tiles)      blocks of a full pass
//   void L::zero(void* p, uint64_t bytes)      clears scratch bytes (in stream order)
//   void L::launch(kernel, uint32_t grid, const char* name, params...)   kThreads a block

inline Scratch scratch_of(void* base, const plan::Layout& l) {
  uint8_t* b = static_cast<uint8_t*>(base);
  Scratch s{};
  s.jobs = reinterpret_cast<JobState*>(b + l.job_state);
  s.sel = reinterpret_cast<SelState*>(b + l.sel);
  s.hist1 = reinterpret_cast<uint32_t*>(b + l.hist1);
  s.hist2 = reinterpret_cast<uint32_t*>(b + l.hist2);
  s.hist3 = reinterpret_cast<uint32_t*>(b + l.hist3);
  s.tile_above = reinterpret_cast<uint32_t*>(b + l.tile_above);
  s.tile_equal = reinterpret_cast<uint32_t*>(b + l.tile_equal);
  s.tile_raw = reinterpret_cast<uint32_t*>(b + l.tile_raw);
  s.off_above = reinterpret_cast<uint32_t*>(b + l.off_above);
  s.off_equal = reinterpret_cast<uint32_t*>(b + l.off_equal);
  s.list = reinterpret_cast<uint2*>(b + l.list);
  s.tile_sums = reinterpret_cast<double*>(b + l.tile_sums);
  s.stride = l.targets;
  return s;
}

// One table of an encode: clear the counters, then 10 launches.
template <class L, DType T, bool kResidual>
void encode_table(L& l, const Table& t, const plan::Layout& layout, void* scratch, PassArgs p) {
  const uint32_t grid = l.full_grid(t.tiles);
  l.zero(scratch, layout.zero_end);
  SelectArgs sel{};
  sel.s = p.s;
  sel.active = 1;
  p.a.materialized = false;
  l.launch(first_pass_kernel<T, kResidual>, grid, "the topk first-pass kernel", t, p);
  p.a.materialized = p.materialize;
  p.materialize = false;
  sel.round = 1;
  l.launch(select_kernel, t.count, "the topk select kernel", t, sel);
  l.launch(collect_kernel<T, kResidual>, grid, "the topk collect kernel", t, p);
  l.launch(refine_kernel<T, kResidual, true, 2>, grid, "the topk refine kernel", t, p);
  sel.round = 2;
  l.launch(select_kernel, t.count, "the topk select kernel", t, sel);
  l.launch(refine_kernel<T, kResidual, true, 3>, grid, "the topk refine kernel", t, p);
  sel.round = 3;
  l.launch(select_kernel, t.count, "the topk select kernel", t, sel);
  l.launch(attribute_kernel<T, kResidual>, grid, "the topk attribute kernel", t, p);
  l.launch(scan_kernel, t.count, "the topk scan kernel", t, p.s);
  l.launch(write_kernel<T, kResidual>, grid, "the topk write kernel", t, p);
}

// One table of the statistics: the first pass, then per group of up to
// kMaxTargetsPerPass candidates 2 refine passes, 3 selects and the reduction.
template <class L, DType T, bool kResidual>
void stats_table(L& l, const Table& t, const StatsBatch& b, const plan::Layout& layout, PassArgs p) {
  const uint32_t grid = l.full_grid(t.tiles);
  uint8_t* base = static_cast<uint8_t*>(b.scratch);
  l.zero(base, layout.group_begin);
  p.stats = true;
  l.launch(first_pass_kernel<T, kResidual>, grid, "the topk first-pass kernel", t, p);
  p.stats = false;
  for (size_t g0 = 0; g0 < b.candidates.size(); g0 += layout.targets) {
    const uint32_t active = static_cast<uint32_t>(std::min<size_t>(layout.targets, b.candidates.size() - g0));
    l.zero(base + layout.group_begin, layout.zero_end - layout.group_begin);
    SelectArgs sel{};
    sel.s = p.s;
    sel.active = active;
    sel.stats = true;
    ReduceArgs reduce{};
    reduce.s = p.s;
    reduce.squared = b.squared;
    reduce.nonfinite = b.nonfinite;
    reduce.weight = b.weight;
    reduce.row_stride = b.row_stride;
    for (uint32_t c = 0; c < active; ++c) {
      sel.density_ppb[c] = b.candidates[g0 + c].density_ppb;
      reduce.columns[c] = b.columns[g0 + c];
    }
    p.active = active;
    const uint32_t selections = t.count * layout.targets;
    sel.round = 1;
    l.launch(select_kernel, selections, "the topk select kernel", t, sel);
    l.launch(refine_kernel<T, kResidual, false, 2>, grid, "the topk statistics refine kernel", t, p);
    sel.round = 2;
    l.launch(select_kernel, selections, "the topk select kernel", t, sel);
    l.launch(refine_kernel<T, kResidual, false, 3>, grid, "the topk statistics refine kernel", t, p);
    sel.round = 3;
    l.launch(select_kernel, selections, "the topk select kernel", t, sel);
    l.launch(stats_reduce_kernel, active, "the topk statistics reduction kernel", t, reduce);
  }
}

template <class L, DType T>
void decode_table(L& l, const Table& t, const DecodeArgs& a, bool accumulate) {
  if (accumulate) {
    l.launch(scatter_kernel<DType::kFloat32, true>, l.full_grid(t.entry_tiles), "the topk decode-accumulate kernel", t, a);
    return;
  }
  l.launch(zero_kernel<T>, l.full_grid(t.tiles), "the topk decode zero-fill kernel", t, a);
  l.launch(scatter_kernel<T, false>, l.full_grid(t.entry_tiles), "the topk decode kernel", t, a);
}

// The batch-level entry points of topk_cuda.h, over a launcher.

template <class L>
void run_encode(L& l, const EncodeBatch& b) {
  const char* what = "topk cuda encode";
  const std::vector<Table> tables = plan::tables(b.jobs, what);
  if (tables.empty()) return;
  plan::check_encode(b, tables, what);
  for (const Table& t : tables) {
    const plan::Layout layout = plan::encode_layout(t);
    PassArgs p{};
    p.a = Arrays{b.input, b.input_first, b.residual, b.residual_first, b.skip_residual, false};
    p.s = scratch_of(b.scratch, layout);
    p.residual_out = b.residual;
    p.nonfinite_values = b.nonfinite_values;
    p.payload = b.payload;
    p.materialize = b.residual != nullptr;
    p.active = 1;
    const bool r = b.residual != nullptr;
    switch (b.input_dtype) {
      case DType::kFloat32:
        r ? encode_table<L, DType::kFloat32, true>(l, t, layout, b.scratch, p)
          : encode_table<L, DType::kFloat32, false>(l, t, layout, b.scratch, p);
        break;
      case DType::kFloat16:
        r ? encode_table<L, DType::kFloat16, true>(l, t, layout, b.scratch, p)
          : encode_table<L, DType::kFloat16, false>(l, t, layout, b.scratch, p);
        break;
      case DType::kBFloat16:
        r ? encode_table<L, DType::kBFloat16, true>(l, t, layout, b.scratch, p)
          : encode_table<L, DType::kBFloat16, false>(l, t, layout, b.scratch, p);
        break;
    }
  }
}

template <class L>
void run_decode(L& l, const DecodeBatch& b, bool accumulate) {
  const char* what = accumulate ? "topk cuda decode_accumulate" : "topk cuda decode";
  const std::vector<Table> tables = plan::tables(b.jobs, what);
  if (tables.empty()) return;
  plan::check_decode(b, accumulate, what);
  const DecodeArgs a{b.payload, b.output, b.output_first};
  for (const Table& t : tables) {
    switch (b.output_dtype) {
      case DType::kFloat32: decode_table<L, DType::kFloat32>(l, t, a, accumulate); break;
      case DType::kFloat16: decode_table<L, DType::kFloat16>(l, t, a, accumulate); break;
      case DType::kBFloat16: decode_table<L, DType::kBFloat16>(l, t, a, accumulate); break;
    }
  }
}

template <class L>
void run_squared_errors(L& l, const StatsBatch& b) {
  const char* what = "topk cuda squared_errors";
  plan::check_candidates(b, what);
  const std::vector<Table> tables = plan::tables(b.jobs, what);
  if (tables.empty() || b.candidates.empty()) return;
  plan::check_stats(b, tables, what);
  for (const Table& t : tables) {
    const plan::Layout layout = plan::stats_layout(t, b.candidates.size());
    PassArgs p{};
    p.a = Arrays{b.input, b.input_first, b.residual, b.residual_first, nullptr, false};
    p.s = scratch_of(b.scratch, layout);
    const bool r = b.residual != nullptr;
    switch (b.input_dtype) {
      case DType::kFloat32:
        r ? stats_table<L, DType::kFloat32, true>(l, t, b, layout, p) : stats_table<L, DType::kFloat32, false>(l, t, b, layout, p);
        break;
      case DType::kFloat16:
        r ? stats_table<L, DType::kFloat16, true>(l, t, b, layout, p) : stats_table<L, DType::kFloat16, false>(l, t, b, layout, p);
        break;
      case DType::kBFloat16:
        r ? stats_table<L, DType::kBFloat16, true>(l, t, b, layout, p)
          : stats_table<L, DType::kBFloat16, false>(l, t, b, layout, p);
        break;
    }
  }
}

}  // namespace lgreco::topk::cuda::kernels (or emulated_kernels)
