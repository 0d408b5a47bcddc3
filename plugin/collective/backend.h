// Backend: where the engine's arithmetic runs. The CPU backend (cpu_backend.h) runs the
// reference codecs on the calling thread; the CUDA backend (the shim issue) launches the
// kernels of kernels/*.cu on the user's stream.
//
// Every operation is enqueued: it takes effect after the operations issued before it
// and before those issued after it, on the backend's queue (and the fabric's operations
// share that queue). The CPU backend completes each before returning; a CUDA backend only
// launches. So the engine never looks at what an operation produced on the host, except
// through read_back(), whose Event says when the bytes have arrived. Pointers handed to
// operations are the backend's memory (device memory for CUDA) unless named `host`.
//
// Operations work on the segments of a plan (plugin/collective/plan.h) and address a
// buffer that holds call elements [first, first + n) by an ElementSpan: element i of the
// call is at data + (i - first). Encoded bytes of segment s are at base + s.byte_offset.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

#include "kernels/codec_spec.h"
#include "kernels/dtype.h"
#include "plugin/collective/plan.h"

namespace lgreco::collective {

struct ElementSpan {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  uint64_t first = 0;  // the call element at data[0]
};

// Rounding noise of one call: every segment's key is {seed, rank, step, layer_base + layer}
// (kernels/noise.h). `rank` distinguishes who encodes: a rank's own gradient uses its
// rank, the owner's re-encoding of a reduced partition uses kReencodeRankBit | owner.
struct NoiseBase {
  uint64_t seed = 0;
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t layer_base = 0;
  static constexpr uint32_t kReencodeRankBit = 0x80000000u;
};

// When the data a read-back copies is on the host.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool ready() = 0;
  virtual void wait() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // "" when this backend can encode, decode and measure `spec`, else why not (a family
  // whose kernels this backend lacks). The engine asks before compressing, so that every
  // rank passes through together instead of failing in the middle of a call. By default
  // low rank is unsupported: a backend that implements the lowrank_* operations says so.
  virtual std::string unsupported(const CodecSpec& spec) const {
    return spec.family() == CodecFamily::kPowersgd ? "the " + name() + " backend has no low-rank operations" : "";
  }

  // Backend memory, zero-filled; freed when the owner goes. Throws std::bad_alloc.
  class Buffer {
   public:
    virtual ~Buffer() = default;
    virtual void* data() = 0;
    virtual uint64_t bytes() const = 0;
  };
  virtual std::unique_ptr<Buffer> allocate(uint64_t bytes) = 0;
  // Host memory that read_back() can copy into without waiting (CUDA: pinned; a copy to
  // pageable memory returns only when it is done). Zero-filled.
  virtual std::unique_ptr<Buffer> allocate_host(uint64_t bytes) = 0;

  virtual void fill_zero(void* data, uint64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, uint64_t bytes) = 0;
  virtual void upload(void* dst, const void* host_src, uint64_t bytes) = 0;
  // Copies to host memory; the Event says when the bytes are there. host_dst comes from
  // allocate_host(): into other memory a CUDA backend's copy returns only when it is done,
  // a wait that await() cannot see.
  virtual std::unique_ptr<Event> read_back(void* host_dst, const void* src, uint64_t bytes) = 0;

  // flags[l] = 1 for each layer l of the segments whose input holds a NaN or an
  // infinity, 0 for the others (flags has one byte per layer of the bucket).
  virtual void find_nonfinite(const Plan& plan, std::span<const Segment> segments, ElementSpan input,
                              uint8_t* flags) = 0;

  // Encodes each segment of input (+ residual when not null, with error feedback) into
  // out + byte_offset_base + s.byte_offset, as plan.codecs[s.codec] with payload element
  // type plan.dtype. A layer whose flag is set (flags not null) is encoded without its
  // residual, which stays untouched. input may be float32 for a plan of another dtype
  // (the reduced sum); the payload is the same.
  virtual void encode(const Plan& plan, std::span<const Segment> segments, ElementSpan input, float* residual_data,
                      uint64_t residual_first, const uint8_t* flags, const NoiseBase& noise, uint8_t* out,
                      uint64_t byte_offset_base) = 0;
  // Decodes each segment from in + base + s.byte_offset into out (of any element type).
  virtual void decode(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                      uint64_t byte_offset_base, ElementSpan out) = 0;
  // acc (float32) += each decoded segment.
  virtual void decode_accumulate(const Plan& plan, std::span<const Segment> segments, const uint8_t* in,
                                 uint64_t byte_offset_base, ElementSpan acc) = 0;
  // acc += input + residual, exactly in float32 (an owner's own contribution, which it
  // never needs to send); the residual becomes 0, except in flagged layers (untouched,
  // and not added). residual may be null.
  virtual void accumulate_exact(const Plan& plan, std::span<const Segment> segments, ElementSpan input,
                                float* residual_data, uint64_t residual_first, const uint8_t* flags,
                                ElementSpan acc) = 0;
  // acc[i] = acc[i] / divisor for n float32 values (the average of ncclAvg).
  virtual void divide(float* acc, uint64_t n, float divisor) = 0;

  // Copies runs of elements into one float32 array: for each run and i < run.count,
  // dst[run.to + i] = scale x src element (run.from + i), or += with `accumulate`. A source
  // element outside [src.first, src_end) counts as 0 (an owner residual covers its
  // partition only). The error probe (plugin/collective/probe.h) collects its samples so.
  struct Run {
    uint64_t from = 0;   // first source element (in src's element numbering)
    uint64_t to = 0;     // first destination element
    uint64_t count = 0;  // elements
  };
  virtual void gather(std::span<const Run> runs, ElementSpan src, uint64_t src_end, float scale, bool accumulate,
                      float* dst) = 0;
  // For each segment s: sum over its elements i of |a[i] - b[i]|^power (power 1 or 2) in
  // double, a of any element type, b float32 (null: 0), both indexed by element - a.first;
  // times weight, ADDED to out[s.layer]. A segment whose sum is not finite sets
  // nonfinite[s.layer] = 1 and adds nothing. Segments of one layer may be several; the
  // caller zeroes both arrays.
  virtual void distance(std::span<const Segment> segments, ElementSpan a, const float* b, int power, double weight,
                        double* out, uint8_t* nonfinite) = 0;
  // The signed sketch of float32 runs (kernels/sketch.h): for each run and j < width,
  // dst[to + j] = sum over i < count with i mod width = j of sign(key, i) x src[from + i],
  // summed in double in the order of i and stored as float32 (j >= count: 0). Overwrites;
  // the same bits on the CPU and the CUDA backend up to that rounding of the sum.
  struct SketchRun {
    uint64_t from = 0, count = 0;  // src elements
    uint64_t to = 0;               // dst element of bucket 0
    uint64_t width = 0;            // buckets (>= 1)
    uint64_t key = 0;              // of the signs: the same on every rank
  };
  virtual void sketch(std::span<const SketchRun> runs, const float* src, float* dst) = 0;
  // out[i] = acc[i] narrowed to out's element type (round to nearest even).
  virtual void narrow(const float* acc, uint64_t n, ElementSpan out) = 0;

  // The squared error of every candidate on input + residual for each measured layer of
  // the segments, ADDED to squared[l * candidates.size() + c] (squared errors add across
  // buckets, segments and quantization stages); nonfinite[l] becomes 1 if any value of
  // the layer was not finite (its errors are then meaningless), and is never cleared
  // here. Layers not measured are left alone; the caller zeroes both arrays.
  struct Measure {
    std::span<const CodecSpec> candidates;  // the same list for every layer measured
    std::span<const uint8_t> measured;      // per layer of the bucket: 1 if measured
    double* squared = nullptr;              // layers x candidates
    uint8_t* nonfinite = nullptr;           // layers
    // Each squared error is multiplied by this before it is added: the square of the
    // factor by which this stage's error reaches the output (1/P^2 for a rank's own
    // encoding under ncclAvg, whose sum is divided by P afterwards).
    double weight = 1.0;
    // Per candidate: 1 if measured here, 0 if its column is left alone (a family measured
    // at another stage of the call: plugin/collective/engine.cc). Empty: every candidate.
    std::span<const uint8_t> candidate_mask;
  };
  virtual void measure(const Plan& plan, std::span<const Segment> segments, ElementSpan input, const float* residual,
                       uint64_t residual_first, const Measure& m) = 0;
  // Makes sure that measure() on any segments of `plan` with these candidates allocates
  // nothing (CUDA: the statistics' scratch), so that no allocation can fail in the middle
  // of a call on one rank only. The engine calls it where an allocation failure still
  // makes every rank pass through (switching to an assignment). Throws std::bad_alloc.
  virtual void prepare_measure(const Plan& plan, std::span<const CodecSpec> candidates) {
    (void)plan, (void)candidates;
  }
  // Likewise for encode() on any segments of `plan` (CUDA: the TopK selection's scratch).
  // Throws std::bad_alloc, or CodecError for a segment the backend's kernels cannot take.
  virtual void prepare_encode(const Plan& plan) { (void)plan; }
  // Likewise for encode() and distance() on any segments of `plan` (the error
  // probe's simulation: CUDA needs scratch for the distances' partial sums too).
  virtual void prepare_probe(const Plan& plan) { prepare_encode(plan); }

  // Low-rank (PowerSGD) layers, exchanged apart (docs/ENGINE.md): per step, with M the
  // layer's input + residual as a rows x cols row-major matrix (no residual where the
  // layer's flag is set) and Q its warm-started factor:
  //   lowrank_project:        P = M Q
  //   (the engine sums P across ranks)
  //   lowrank_orthonormalize: P's columns by Gram-Schmidt (kernels/lowrank.h)
  //   lowrank_back_project:   Q' = M^T P, and the residual becomes M - P Q'^T (unflagged)
  //   (the engine sums Q' across ranks)
  //   lowrank_reconstruct:    out = scale x P Q'^T, narrowed to out's type
  //   lowrank_keep:           Q = Q', except that a column of Q' that is zero or not
  //                           finite restarts from Q0's (so no direction is lost for good)
  // The arithmetic is kernels/lowrank.h's; a GPU agrees within docs/KERNELS.md's tolerance.
  // P, Q, Q' and Q0 are float32 arrays in backend memory, each layer's at its offsets.
  struct LowRankLayer {
    uint32_t layer = 0;        // index in the bucket (flags)
    uint64_t offset = 0;       // first element, within the call
    uint64_t rows = 0, cols = 0;
    uint32_t rank = 0;
    uint64_t p_offset = 0;     // floats, into P (rows x rank)
    uint64_t q_offset = 0;     // floats, into Q, Q' and Q0 (cols x rank)
  };
  virtual void lowrank_project(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                               const uint8_t* flags, const float* q, float* p) {
    (void)layers, (void)input, (void)residual, (void)flags, (void)q, (void)p;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  virtual void lowrank_orthonormalize(std::span<const LowRankLayer> layers, float* p) {
    (void)layers, (void)p;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  virtual void lowrank_back_project(std::span<const LowRankLayer> layers, ElementSpan input, float* residual,
                                    const uint8_t* flags, const float* p, float* q) {
    (void)layers, (void)input, (void)residual, (void)flags, (void)p, (void)q;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  virtual void lowrank_reconstruct(std::span<const LowRankLayer> layers, const float* p, const float* q, float scale,
                                   ElementSpan out) {
    (void)layers, (void)p, (void)q, (void)scale, (void)out;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  virtual void lowrank_keep(std::span<const LowRankLayer> layers, const float* q_new, const float* q0, float* q) {
    (void)layers, (void)q_new, (void)q0, (void)q;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  // The squared error of each low-rank candidate (those m.candidate_mask marks) on each
  // layer, ADDED to m.squared as measure() does: rank r's error is that of one power
  // iteration from the seeded start of the largest rank measured, Q0 of
  // {seed, layer_base + layer, step} (kernels/lowrank.h, squared_errors). The layers'
  // `rank` and offsets are not used.
  virtual void measure_lowrank(std::span<const LowRankLayer> layers, ElementSpan input, const float* residual,
                               const NoiseBase& key, const Measure& m) {
    (void)layers, (void)input, (void)residual, (void)key, (void)m;
    throw std::logic_error(name() + " backend: no low-rank operations");
  }
  // Makes sure that the low-rank operations on `layers` and measure_lowrank on `measured`
  // with ranks up to max_measured_rank (0: nothing measured), for an input of `dtype` with
  // or without a residual, allocate nothing and find everything they need (CUDA: the
  // cuBLAS context, its workspace and the scratch), called where a failure still makes
  // every rank pass through. Throws std::bad_alloc, CodecError for a layer the backend's
  // kernels cannot take, or std::runtime_error when the backend cannot run them at all
  // (no cuBLAS).
  virtual void prepare_lowrank(std::span<const LowRankLayer> layers, std::span<const LowRankLayer> measured,
                               uint32_t max_measured_rank, DType dtype, bool residual) {
    (void)layers, (void)measured, (void)max_measured_rank, (void)dtype, (void)residual;
  }

  // Timing without waiting, for the time objective and the counters: mark() enqueues a
  // timestamp and returns a handle (CUDA: an event from a pool); mark_ready() says
  // whether the queue has passed it, wait_mark() waits until it has; seconds_between()
  // needs both marks passed; release_mark() hands a mark back once it has been read.
  virtual uint64_t mark() = 0;
  virtual bool mark_ready(uint64_t mark) = 0;
  virtual void wait_mark(uint64_t mark) = 0;
  virtual double seconds_between(uint64_t first_mark, uint64_t second_mark) = 0;
  virtual void release_mark(uint64_t mark) = 0;

  // The host's waits for queued work. The engine waits through these two alone, so that
  // they can be counted: `waits` is every wait, `stalls` the waits that found the work
  // unfinished, where the host blocked until the queue got there (CUDA: the event not yet
  // reached on the device). Training's steady state makes none (docs/ENGINE.md, "The host
  // waits for nothing it just queued"). From the one thread that drives this backend.
  struct WaitCounters {
    uint64_t waits = 0, stalls = 0;
  };
  void await(Event& event) {
    ++waits_.waits;
    if (event.ready()) return;
    ++waits_.stalls;
    event.wait();
  }
  void await_mark(uint64_t mark) {
    ++waits_.waits;
    if (mark_ready(mark)) return;
    ++waits_.stalls;
    wait_mark(mark);
  }
  const WaitCounters& wait_counters() const { return waits_; }

 private:
  WaitCounters waits_;
};

}  // namespace lgreco::collective
