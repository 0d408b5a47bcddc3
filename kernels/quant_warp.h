// The warp programs of the CUDA quantization kernels: what one warp does to one bucket.
//
// Each function below is run by the 32 lanes of a warp together, in the SIMT style, and
// talks to the other lanes only through the warp policy W:
//   W::lane()          this lane's index, 0..31
//   W::ballot(p)       bit l = lane l's p, on every lane (__ballot_sync)
//   W::shfl_xor(v, m)  lane l gets lane (l ^ m)'s v (__shfl_xor_sync), float and uint32_t
// In the kernels (quant_cuda.cu) W is the hardware warp; in the unit tests it is a
// cooperative emulation of 32 lanes on the CPU (tests/unit/warp_emulator.h), so that
// these exact programs are checked against the CPU reference byte for byte on a machine
// with no GPU. The grid-level part of a kernel (which warp takes which bucket) is
// find_work() below, also host-testable.
//
// Data layout in registers. A bucket is read in windows of 1024 elements; window element
// (128 c + 4 l + s) is element s of lane l's chunk c (c < 8, s < 4): four consecutive
// elements per lane, so each load is one 16-byte (float32) or 8-byte (16-bit types)
// access, and a warp's load is 512 (256) contiguous bytes. One Philox block gives a lane
// its four elements' rounding noise (element e uses word e mod 4 of block e / 4).
//
// Bit planes. Group q of a chunk (its elements 32 q .. 32 q + 31) is lanes 8q .. 8q + 7.
// A ballot of "bit j of the code of element s" gives bit l = that bit of element 4l + s,
// so plane word j of group q takes bit 8q + i of ballot (j, s) to bit 4i + s: four bytes
// interleaved (spread_byte_to_nibbles). Lane t < 4 bits writes the chunk's word t, which is
// group t / bits, plane t % bits (it keeps that plane's four ballots): the chunk's words are contiguous in the payload, so
// the stores are coalesced too.
//
// Arithmetic is quant_math.h's, with the same rounding on both sides, so encode and decode
// reproduce the CPU reference's bits. The statistics are allowed to differ from the CPU
// within a stated tolerance (docs/KERNELS.md): they multiply by a reciprocal where the
// reference divides, which saves an IEEE division per candidate per element.
#pragma once

#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/hd.h"
#include "kernels/noise.h"
#include "kernels/quant_math.h"

namespace lgreco::quant::warp {

constexpr uint32_t kLanes = 32;
constexpr uint32_t kLaneElements = 4;                                // consecutive elements per lane per chunk
constexpr uint32_t kChunkElements = kLanes * kLaneElements;          // 128
constexpr uint32_t kWindowChunks = 8;                                // chunks held in registers
constexpr uint32_t kWindowElements = kChunkElements * kWindowChunks;  // 1024
constexpr uint32_t kGroupsPerChunk = kChunkElements / kGroupElements;  // 4
constexpr uint32_t kLanesPerGroup = kGroupElements / kLaneElements;    // 8
constexpr int kMaxBits = 8;
constexpr uint32_t kMaxJobsPerLaunch = 64;
constexpr uint32_t kMaxCandidates = 16;

// ---------------------------------------------------------------------------------------
// Jobs and the grid: work item w of a launch is bucket w - job.work_begin of the job whose
// range [work_begin, work_begin + buckets) holds w.

struct KernelJob {
  uint64_t element_offset;  // of the slice's first element in the element arrays
  uint64_t byte_offset;     // of the slice's payload
  uint64_t count;           // elements in the slice
  uint32_t first_bucket;    // the slice's first element / bucket (its first layer bucket)
  uint32_t work_begin;      // first work item of this job in the launch
  uint32_t layer;           // the batch's layer index (noise layer offset, flag and row index)
  uint32_t bucket;          // elements per bucket
  uint8_t bits;             // quant bits (0 in a statistics launch)
  uint8_t stochastic;       // 1: stochastic rounding
  uint8_t pad[6];
};
static_assert(sizeof(KernelJob) == 48, "KernelJob is copied into kernel parameters");

// A launch's jobs, passed to the kernel by value (kernel parameter space, under 4 KB), so
// that nothing needs allocating or uploading per call. jobs[i].work_begin ascends.
struct JobTable {
  uint32_t count;
  uint32_t total_work;
  KernelJob jobs[kMaxJobsPerLaunch];
};
static_assert(sizeof(JobTable) <= 4000, "kernel parameters are limited to 4 KB");

// The job that owns work item w (< total_work): the last whose work_begin <= w.
LGRECO_HD uint32_t find_job(const JobTable& table, uint32_t w) {
  uint32_t lo = 0, hi = table.count;  // invariant: jobs[lo].work_begin <= w < jobs[hi].work_begin
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (table.jobs[mid].work_begin <= w)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

LGRECO_HD uint64_t bucket_count_of(const KernelJob& job) { return (job.count + job.bucket - 1) / job.bucket; }

// ---------------------------------------------------------------------------------------
// Loads and stores of a lane's four elements.

struct Quad {
  float v[kLaneElements];
};

// Elements [i, i + valid) of base widened to float32 (valid <= 4; the others are 0).
// `vector` says that base + i is aligned for one access of all four (16 bytes for float32,
// 8 for 16-bit types) and valid == 4.
template <DType T>
LGRECO_HD Quad load_quad(const void* base, uint64_t i, uint32_t valid, bool vector) {
  Quad q{{0.0f, 0.0f, 0.0f, 0.0f}};
#if defined(__CUDA_ARCH__)
  if (vector) {
    if constexpr (T == DType::kFloat32) {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
      q.v[0] = f.x, q.v[1] = f.y, q.v[2] = f.z, q.v[3] = f.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
      const uint16_t h[4] = {static_cast<uint16_t>(u.x), static_cast<uint16_t>(u.x >> 16),
                             static_cast<uint16_t>(u.y), static_cast<uint16_t>(u.y >> 16)};
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s)
        q.v[s] = T == DType::kFloat16 ? half_to_float(h[s]) : bf16_to_float(h[s]);
    }
    return q;
  }
#endif
  (void)vector;
  LGRECO_UNROLL
  for (uint32_t s = 0; s < kLaneElements; ++s)
    if (s < valid) q.v[s] = load_as_float<T>(base, i + s);
  return q;
}

LGRECO_HD Quad load_residual(const float* base, uint64_t i, uint32_t valid, bool vector) {
  return load_quad<DType::kFloat32>(base, i, valid, vector);
}

template <DType T>
LGRECO_HD void store_quad(void* base, uint64_t i, uint32_t valid, bool vector, const Quad& q) {
#if defined(__CUDA_ARCH__)
  if (vector) {
    if constexpr (T == DType::kFloat32) {
      *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = make_float4(q.v[0], q.v[1], q.v[2], q.v[3]);
    } else {
      uint16_t h[4];
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s)
        h[s] = T == DType::kFloat16 ? float_to_half_rn(q.v[s]) : float_to_bf16_rn(q.v[s]);
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) =
          make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
    }
    return;
  }
#endif
  (void)vector;
  LGRECO_UNROLL
  for (uint32_t s = 0; s < kLaneElements; ++s)
    if (s < valid) store_from_float(base, T, i + s, q.v[s]);
}

// Whether element i of an array of `element_bytes`-wide elements at base can be the
// start of a four-element vector access.
LGRECO_HD bool vector_aligned(const void* base, uint64_t i, uint32_t element_bytes) {
  const uint64_t address = reinterpret_cast<uint64_t>(base) + i * element_bytes;
  return address % (kLaneElements * element_bytes) == 0;
}

// ---------------------------------------------------------------------------------------
// Ranges (min and max over the finite values, and whether all were finite).

struct Range {
  float min;
  float max;
  bool finite;
};

LGRECO_HD Range empty_range() { return Range{bits_float(0x7f800000u), bits_float(0xff800000u), true}; }

// As the CPU reference: NaN compares false and never becomes min or max; `finite` records it.
LGRECO_HD void extend(Range& r, float v) {
  r.min = v < r.min ? v : r.min;
  r.max = v > r.max ? v : r.max;
  r.finite = r.finite && is_finite_value(v);
}

template <class W>
LGRECO_HD Range warp_range(const W& w, Range r) {
  for (int m = kLanes / 2; m >= 1; m /= 2) {
    const float other_min = w.shfl_xor(r.min, m);
    const float other_max = w.shfl_xor(r.max, m);
    const uint32_t other_finite = w.shfl_xor(r.finite ? 1u : 0u, m);
    r.min = other_min < r.min ? other_min : r.min;
    r.max = other_max > r.max ? other_max : r.max;
    r.finite = r.finite && other_finite != 0;
  }
  return r;
}

template <class W>
LGRECO_HD float warp_sum(const W& w, float v) {
  for (int m = kLanes / 2; m >= 1; m /= 2) v = f32_add(v, w.shfl_xor(v, m));
  return v;
}

// ---------------------------------------------------------------------------------------
// Codes and bit planes.

// Byte x's bit i moves to bit 4i.
LGRECO_HD uint32_t spread_byte_to_nibbles(uint32_t x) {
  x &= 0xffu;
  x = (x | (x << 12)) & 0x000f000fu;
  x = (x | (x << 6)) & 0x03030303u;
  x = (x | (x << 3)) & 0x11111111u;
  return x;
}

// Plane word j of group `group` (0..3) of a chunk, from the chunk's four ballots of plane
// j: ballots[s] bit l = bit j of the code of element 4l + s.
LGRECO_HD uint32_t chunk_word(const uint32_t (&ballots)[kLaneElements], uint32_t group) {
  uint32_t word = 0;
  LGRECO_UNROLL
  for (uint32_t s = 0; s < kLaneElements; ++s) word |= spread_byte_to_nibbles(ballots[s] >> (8 * group)) << s;
  return word;
}

// The four codes (byte s = code of element s) of the lane at position `position` (0..7)
// of a group whose plane words are words[0..bits).
LGRECO_HD uint32_t quad_codes(const uint32_t* words, int bits, uint32_t position) {
  uint32_t packed = 0;
  LGRECO_UNROLL
  for (int j = 0; j < kMaxBits; ++j) {
    if (j >= bits) break;
    const uint32_t nibble = (words[j] >> (4 * position)) & 0xfu;
    packed |= ((nibble * 0x00204081u) & 0x01010101u) << j;  // bit s of the nibble to bit 8s
  }
  return packed;
}

// ---------------------------------------------------------------------------------------
// The bucket programs. `b` is the bucket's index within its job.

// *_first: the element index (in the jobs' element_offset space) of array[0]; element e
// of a job is input[e - input_first], residual[e - residual_first], output[e - output_first].
struct EncodeArgs {
  const void* input;
  uint64_t input_first;
  float* residual;
  uint64_t residual_first;
  const uint8_t* skip_residual;
  uint8_t* payload;
  NoiseKey noise;
  unsigned long long* nonfinite_buckets;
};

LGRECO_HD uint32_t clamp_valid(uint64_t window_valid, uint32_t offset) {
  return offset >= window_valid ? 0u
                                : (window_valid - offset >= kLaneElements ? kLaneElements
                                                                          : static_cast<uint32_t>(window_valid - offset));
}

// Loads one window of a bucket (values + residual) into v and extends the range with its
// valid elements. Input element i of the window is input[first_in + i], its residual
// residual[first_res + i]. Every chunk's loads are issued before any is used, so a warp
// has the whole window (8 KB of float32 input and residual) in flight at once rather than
// one chunk per memory round trip.
template <DType T, bool kResidual>
LGRECO_HD void load_window(const void* input, const float* residual, uint64_t first_in, uint64_t first_res,
                           uint64_t window_valid, uint32_t lane, bool vector_in, bool vector_res,
                           Quad (&v)[kWindowChunks], Range& range) {
  Quad r[kWindowChunks];
  LGRECO_UNROLL
  for (uint32_t c = 0; c < kWindowChunks; ++c) {
    const uint32_t offset = c * kChunkElements + lane * kLaneElements;
    const uint32_t valid = clamp_valid(window_valid, offset);
    const bool full = valid == kLaneElements;
    v[c] = valid == 0 ? Quad{{0.0f, 0.0f, 0.0f, 0.0f}} : load_quad<T>(input, first_in + offset, valid, full && vector_in);
    if constexpr (kResidual)
      r[c] = valid == 0 ? Quad{{0.0f, 0.0f, 0.0f, 0.0f}}
                        : load_residual(residual, first_res + offset, valid, full && vector_res);
  }
  LGRECO_UNROLL
  for (uint32_t c = 0; c < kWindowChunks; ++c) {
    const uint32_t valid = clamp_valid(window_valid, c * kChunkElements + lane * kLaneElements);
    LGRECO_UNROLL
    for (uint32_t s = 0; s < kLaneElements; ++s) {
      if constexpr (kResidual) v[c].v[s] = f32_add(v[c].v[s], r[c].v[s]);
      if (s < valid) extend(range, v[c].v[s]);
    }
  }
}

template <DType T, bool kResidual, class W>
LGRECO_HD void encode_bucket(const W& w, const EncodeArgs& a, const KernelJob& job, uint64_t b) {
  const uint32_t lane = w.lane();
  const uint64_t begin = b * job.bucket;  // within the slice
  const uint64_t n = job.count - begin < job.bucket ? job.count - begin : job.bucket;
  const uint64_t first_in = job.element_offset + begin - a.input_first;  // in input[]
  const uint64_t first_res = job.element_offset + begin - a.residual_first;  // in residual[]
  const uint64_t layer_first = (uint64_t{job.first_bucket} + b) * job.bucket;
  const int bits = job.bits;
  const uint32_t top = max_code(bits);
  const bool use_residual = kResidual && !(a.skip_residual && a.skip_residual[job.layer]);
  const bool vector_in = vector_aligned(a.input, first_in, static_cast<uint32_t>(dtype_size(T)));
  const bool vector_res = use_residual && vector_aligned(a.residual, first_res, 4);
  const uint64_t windows = (n + kWindowElements - 1) / kWindowElements;

  const uint64_t count_buckets = bucket_count_of(job);
  uint8_t* meta_out = a.payload + job.byte_offset + 8 * b;
  uint32_t* words_out = reinterpret_cast<uint32_t*>(a.payload + job.byte_offset + 8 * count_buckets) +
                        static_cast<uint64_t>(bits) * (begin / kGroupElements);
  const uint64_t bucket_groups = (n + kGroupElements - 1) / kGroupElements;

  // Pass 1: the range. A bucket of one window stays in registers for pass 2.
  Quad v[kWindowChunks];
  Range range = empty_range();
  for (uint64_t wi = 0; wi < windows; ++wi) {
    const uint64_t window_valid = n - wi * kWindowElements;
    if (use_residual)
      load_window<T, true>(a.input, a.residual, first_in + wi * kWindowElements, first_res + wi * kWindowElements,
                           window_valid, lane, vector_in, vector_res, v, range);
    else
      load_window<T, false>(a.input, nullptr, first_in + wi * kWindowElements, 0, window_valid, lane, vector_in,
                            false, v, range);
  }
  range = warp_range(w, range);
  const BucketMeta meta = bucket_meta(range.min, range.max, range.finite, bits);
  if (lane == 0) {
    // The payload has no alignment guarantee beyond 4 bytes (metadata is 8 bytes a bucket).
    reinterpret_cast<float*>(meta_out)[0] = meta.min;
    reinterpret_cast<float*>(meta_out)[1] = meta.unit;
  }
  if (!is_finite_bucket(meta)) {  // codes 0, residual untouched
    for (uint64_t i = lane; i < bucket_groups * bits; i += kLanes) words_out[i] = 0;
#if defined(__CUDA_ARCH__)
    if (lane == 0 && a.nonfinite_buckets) atomicAdd(a.nonfinite_buckets, 1ull);
#else
    if (lane == 0 && a.nonfinite_buckets) ++*a.nonfinite_buckets;
#endif
    return;
  }

  // Pass 2: codes, bit planes and the new residual.
  const bool ranged = meta.unit > 0.0f;  // else a constant bucket: every code is 0
  const bool stochastic = job.stochastic != 0;
  NoiseKey noise = a.noise;
  noise.layer += job.layer;
  const uint32_t writer_group = lane / static_cast<uint32_t>(bits);
  const uint32_t writer_plane = lane % static_cast<uint32_t>(bits);
  const bool writer = lane < kGroupsPerChunk * static_cast<uint32_t>(bits);
  for (uint64_t wi = 0; wi < windows; ++wi) {
    const uint64_t window_first = wi * kWindowElements;
    const uint64_t window_valid = n - window_first;
    if (windows > 1) {
      Range unused = empty_range();
      if (use_residual)
        load_window<T, true>(a.input, a.residual, first_in + window_first, first_res + window_first, window_valid,
                             lane, vector_in, vector_res, v, unused);
      else
        load_window<T, false>(a.input, nullptr, first_in + window_first, 0, window_valid, lane, vector_in, false, v,
                              unused);
    }
    LGRECO_UNROLL
    for (uint32_t c = 0; c < kWindowChunks; ++c) {
      const uint64_t chunk_first = window_first + c * kChunkElements;  // within the bucket
      if (chunk_first >= n) break;                                      // warp-uniform
      const uint32_t offset = c * kChunkElements + lane * kLaneElements;
      const uint32_t valid = clamp_valid(window_valid, offset);
      float threshold[kLaneElements] = {kNearestThreshold, kNearestThreshold, kNearestThreshold, kNearestThreshold};
      if (stochastic && ranged && valid > 0) {
        const PhiloxBlock block = noise_block(noise, (layer_first + window_first + offset) / kLaneElements);
        LGRECO_UNROLL
        for (uint32_t s = 0; s < kLaneElements; ++s) threshold[s] = uniform24(block.v[s]);
      }
      uint32_t packed = 0;
      Quad r;
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s) {
        const uint32_t code = (ranged && s < valid) ? quantize_ranged(v[c].v[s], meta, top, threshold[s]) : 0u;
        packed |= code << (8 * s);
        r.v[s] = f32_sub(v[c].v[s], dequantize(code, meta));
      }
      if (use_residual && valid > 0)
        store_quad<DType::kFloat32>(a.residual, first_res + window_first + offset, valid,
                                    valid == kLaneElements && vector_res, r);
      // Every lane takes part in every ballot; each keeps the four of the plane it writes.
      uint32_t mine[kLaneElements] = {0, 0, 0, 0};
      LGRECO_UNROLL
      for (int j = 0; j < kMaxBits; ++j) {
        if (j >= bits) break;  // warp-uniform
        LGRECO_UNROLL
        for (uint32_t s = 0; s < kLaneElements; ++s) {
          const uint32_t ballot = w.ballot(((packed >> (8 * s + j)) & 1u) != 0);
          if (static_cast<uint32_t>(j) == writer_plane) mine[s] = ballot;
        }
      }
      const uint64_t group = chunk_first / kGroupElements + writer_group;  // within the bucket
      if (writer && group < bucket_groups)
        words_out[(chunk_first / kGroupElements) * bits + lane] = chunk_word(mine, writer_group);
    }
  }
}

struct DecodeArgs {
  const uint8_t* payload;
  void* output;
  uint64_t output_first;
};

// decode (kAccumulate false: output of type T) or decode_accumulate (true: float32 +=).
template <DType T, bool kAccumulate, class W>
LGRECO_HD void decode_bucket(const W& w, const DecodeArgs& a, const KernelJob& job, uint64_t b) {
  const uint32_t lane = w.lane();
  const uint64_t begin = b * job.bucket;
  const uint64_t n = job.count - begin < job.bucket ? job.count - begin : job.bucket;
  const uint64_t first = job.element_offset + begin - a.output_first;  // in output[]
  const int bits = job.bits;
  const uint8_t* meta_in = a.payload + job.byte_offset + 8 * b;
  const uint32_t* words_in = reinterpret_cast<const uint32_t*>(a.payload + job.byte_offset + 8 * bucket_count_of(job)) +
                             static_cast<uint64_t>(bits) * (begin / kGroupElements);
  const BucketMeta meta{reinterpret_cast<const float*>(meta_in)[0], reinterpret_cast<const float*>(meta_in)[1]};
  const bool finite = is_finite_bucket(meta);
  const float nan = bits_float(kDecodedNaNBits);
  const bool vector_out = vector_aligned(a.output, first, static_cast<uint32_t>(dtype_size(T)));
  const uint32_t position = lane % kLanesPerGroup;
  for (uint64_t offset = lane * kLaneElements; offset < n; offset += kChunkElements) {
    const uint32_t valid = clamp_valid(n, static_cast<uint32_t>(offset));
    const bool full = valid == kLaneElements;
    Quad y;
    if (finite) {
      const uint32_t packed = quad_codes(words_in + (offset / kGroupElements) * bits, bits, position);
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s) y.v[s] = dequantize((packed >> (8 * s)) & 0xffu, meta);
    } else {
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s) y.v[s] = nan;
    }
    if constexpr (kAccumulate) {
      if (finite) {
        const Quad acc = load_quad<DType::kFloat32>(a.output, first + offset, valid, full && vector_out);
        LGRECO_UNROLL
        for (uint32_t s = 0; s < kLaneElements; ++s) {
          const float sum = f32_add(acc.v[s], y.v[s]);
          y.v[s] = sum == sum ? sum : nan;  // the canonical NaN, as the CPU writes it
        }
      }
      store_quad<DType::kFloat32>(a.output, first + offset, valid, full && vector_out, y);
    } else {
      store_quad<T>(a.output, first + offset, valid, full && vector_out, y);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Statistics.

struct StatsCandidate {
  uint8_t bits;        // 0: `none`
  uint8_t stochastic;  // quant only
};

struct StatsArgs {
  const void* input;
  uint64_t input_first;
  const float* residual;
  uint64_t residual_first;
  uint8_t* nonfinite;  // per layer
  double* partial;     // work items x candidate count
  uint32_t candidate_count;
  bool has_quant;      // a quant candidate is in this launch (decides what makes a layer non-finite)
  StatsCandidate candidates[kMaxCandidates];
};

// Squared error of each candidate on one bucket (all of this launch's quant candidates
// share job.bucket), written to a.partial[w * count + c] by lane 0. Sums over the bucket
// are float32; the scaling by unit^2 is float64, as in the CPU reference, so that a range
// near float32's limit gives a finite error, not +inf (or 0 x inf = NaN).
// kCapacity (8 or 16) >= a.candidate_count sizes the per-candidate register arrays.
template <DType T, bool kResidual, uint32_t kCapacity, class W>
LGRECO_HD void stats_bucket(const W& w, const StatsArgs& a, const KernelJob& job, uint64_t b, uint32_t work) {
  const uint32_t lane = w.lane();
  const uint64_t begin = b * job.bucket;
  const uint64_t n = job.count - begin < job.bucket ? job.count - begin : job.bucket;
  const uint64_t first_in = job.element_offset + begin - a.input_first;
  const uint64_t first_res = job.element_offset + begin - a.residual_first;
  const bool vector_in = vector_aligned(a.input, first_in, static_cast<uint32_t>(dtype_size(T)));
  const bool vector_res = kResidual && vector_aligned(a.residual, first_res, 4);
  const uint64_t windows = (n + kWindowElements - 1) / kWindowElements;
  const float inf = bits_float(0x7f800000u);

  Quad v[kWindowChunks];
  Range range = empty_range();
  for (uint64_t wi = 0; wi < windows; ++wi)
    load_window<T, kResidual>(a.input, a.residual, first_in + wi * kWindowElements, first_res + wi * kWindowElements,
                              n - wi * kWindowElements, lane, vector_in, vector_res, v, range);
  range = warp_range(w, range);
  const bool quant_ok = range.finite && is_finite_value(f32_sub(range.max, range.min));
  if (lane == 0 && (a.has_quant ? !quant_ok : !range.finite)) a.nonfinite[job.layer] = 1;

  // Per candidate: the reciprocal of its unit. For stochastic rounding d is the distance
  // from the value's position p to the nearest code, and |d| (1 - |d|) = f (1 - f) with
  // f = p - floor(p), the expected squared error in units of unit^2; for round to nearest
  // d is the actual error v - decoded, also in units of `unit`.
  float inverse[kCapacity], sum_abs[kCapacity], sum_sq[kCapacity];
  const float lo = f32_add(range.min, 0.0f);
  LGRECO_UNROLL
  for (uint32_t c = 0; c < kCapacity; ++c) {
    inverse[c] = 0.0f;
    sum_abs[c] = 0.0f;
    sum_sq[c] = 0.0f;
    if (c < a.candidate_count && a.candidates[c].bits != 0 && quant_ok) {
      const float unit = bucket_meta(range.min, range.max, true, a.candidates[c].bits).unit;
      if (unit > 0.0f) inverse[c] = f32_div(1.0f, unit);
      // A unit below 2^-128 (values under 2^-96) has no float32 reciprocal: positions
      // would be inf or NaN. The bucket's error, under n x unit^2 < 2^-244, is 0 in float32
      // partials; the constant path gives that ((v - min)^2 < 2^-240 underflows).
      if (!is_finite_value(inverse[c])) inverse[c] = 0.0f;
    }
  }
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 x 2^23: adding and subtracting it rounds to an integer
  for (uint64_t wi = 0; wi < windows; ++wi) {
    const uint64_t window_valid = n - wi * kWindowElements;
    if (windows > 1) {
      Range unused = empty_range();
      load_window<T, kResidual>(a.input, a.residual, first_in + wi * kWindowElements,
                                first_res + wi * kWindowElements, window_valid, lane, vector_in, vector_res, v, unused);
    }
    // Candidates outside, elements inside: each candidate's kind is one warp-uniform branch
    // per window, and the element loops hold no per-element tests. Elements past the end
    // of the bucket are 0 for `none` (they add 0) and then become lo for the quant
    // candidates (position 0, code 0, error 0).
    LGRECO_UNROLL
    for (uint32_t c = 0; c < kCapacity; ++c) {
      if (c >= a.candidate_count) break;
      if (a.candidates[c].bits != 0) continue;
      LGRECO_UNROLL
      for (uint32_t ch = 0; ch < kWindowChunks; ++ch) {
        if (ch * kChunkElements >= window_valid) break;  // warp-uniform
        LGRECO_UNROLL
        for (uint32_t s = 0; s < kLaneElements; ++s) {  // what rounding to the element type loses
          const float d = f32_sub(v[ch].v[s], round_to_dtype(v[ch].v[s], T));
          sum_sq[c] = f32_add(sum_sq[c], f32_mul(d, d));
        }
      }
    }
    LGRECO_UNROLL
    for (uint32_t ch = 0; ch < kWindowChunks; ++ch) {
      const uint32_t valid = clamp_valid(window_valid, ch * kChunkElements + lane * kLaneElements);
      LGRECO_UNROLL
      for (uint32_t s = 0; s < kLaneElements; ++s)
        if (s >= valid) v[ch].v[s] = lo;
    }
    LGRECO_UNROLL
    for (uint32_t c = 0; c < kCapacity; ++c) {
      if (c >= a.candidate_count) break;
      if (a.candidates[c].bits == 0) continue;
      if (inverse[c] == 0.0f) {  // constant bucket: every value decodes to lo
        LGRECO_UNROLL
        for (uint32_t ch = 0; ch < kWindowChunks; ++ch) {
          if (ch * kChunkElements >= window_valid) break;
          LGRECO_UNROLL
          for (uint32_t s = 0; s < kLaneElements; ++s) {
            const float d = f32_sub(v[ch].v[s], lo);
            sum_sq[c] = f32_add(sum_sq[c], f32_mul(d, d));
          }
        }
      } else if (a.candidates[c].stochastic) {
        LGRECO_UNROLL
        for (uint32_t ch = 0; ch < kWindowChunks; ++ch) {
          if (ch * kChunkElements >= window_valid) break;
          LGRECO_UNROLL
          for (uint32_t s = 0; s < kLaneElements; ++s) {
            const float p = f32_mul(f32_sub(v[ch].v[s], lo), inverse[c]);
            const float d = f32_sub(p, f32_sub(f32_add(p, kRoundMagic), kRoundMagic));
            sum_abs[c] = f32_add(sum_abs[c], d < 0.0f ? -d : d);
            sum_sq[c] = f32_add(sum_sq[c], f32_mul(d, d));
          }
        }
      } else {
        // Round to nearest measures the actual error, the decoded value's float32 rounding
        // included (it matters where |min| is much larger than unit), in units of `unit`.
        const float unit = bucket_meta(range.min, range.max, true, a.candidates[c].bits).unit;
        const float top = static_cast<float>(max_code(a.candidates[c].bits));
        LGRECO_UNROLL
        for (uint32_t ch = 0; ch < kWindowChunks; ++ch) {
          if (ch * kChunkElements >= window_valid) break;
          LGRECO_UNROLL
          for (uint32_t s = 0; s < kLaneElements; ++s) {
            const float x = v[ch].v[s];
            const float p = f32_mul(f32_sub(x, lo), inverse[c]);
            const float code = f32_sub(f32_add(p, kRoundMagic), kRoundMagic);
            const float d = f32_mul(f32_sub(x, dequantize_value(code < top ? code : top, lo, unit)), inverse[c]);
            sum_sq[c] = f32_add(sum_sq[c], f32_mul(d, d));
          }
        }
      }
    }
  }
  LGRECO_UNROLL
  for (uint32_t c = 0; c < kCapacity; ++c) {
    if (c >= a.candidate_count) break;
    const float total_abs = warp_sum(w, sum_abs[c]);
    const float total_sq = warp_sum(w, sum_sq[c]);
    if (lane != 0) continue;
    const StatsCandidate k = a.candidates[c];
    const double unit = k.bits != 0 && quant_ok ? bucket_meta(range.min, range.max, true, k.bits).unit : 0.0;
    double error;
    if (k.bits == 0)
      error = range.finite ? total_sq : inf;
    else if (!quant_ok)
      error = inf;
    else if (inverse[c] == 0.0f)
      error = total_sq;
    else if (k.stochastic)
      error = static_cast<double>(f32_sub(total_abs, total_sq)) * unit * unit;
    else
      error = static_cast<double>(total_sq) * unit * unit;
    a.partial[static_cast<uint64_t>(work) * a.candidate_count + c] = error;
  }
}

}  // namespace lgreco::quant::warp
