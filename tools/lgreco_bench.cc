// lgreco-bench: the compressed allreduce, timed and checked, in the manner of nccl-tests'
// all_reduce_perf. Ranks are threads (--fabric inproc) or processes (--fabric socket:
// one process per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets
// them, or --ranks N to start N local processes). --fabric nccl runs the processes on
// the GPU: the engine's CUDA backend and NCCL fabric (plugin/shim) over a communicator
// of the libnccl the tool loads itself, device buffers, and plain NCCL allreduce of the
// same buffers timed beside it (built with CUDA only).
//
// Inputs come from a counter-based hash of (seed, rank, element), so every rank can
// compute every rank's input and hence the exact float64 sum without exchanging it. The
// check (-c 1) reports rel_err = ||out - exact||_2 / ||exact||_2 and #wrong, the elements
// outside the error bound the algorithm guarantees (docs/ENGINE.md, "Error bound"), summed
// over ranks, plus every element of a rank whose output differs from rank 0's.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "config/bucket_matcher.h"
#include "config/params.h"
#include "config/registration.h"
#include "config/version.h"
#include "kernels/quant_math.h"
#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/engine.h"
#include "plugin/collective/inproc_fabric.h"
#include "plugin/collective/socket_fabric.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

// Set by the Makefile when it builds with CUDA: --fabric nccl drives the device itself
// (device choice, its stream) through the CUDA runtime.
#ifdef LGRECO_BENCH_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <link.h>
#include <signal.h>

#include "plugin/shim/device_runtime.h"
#include "plugin/shim/nccl_abi.h"
#include "plugin/shim/nccl_api.h"
#include "plugin/shim/nccl_fabric.h"
#include "plugin/shim/nccl_locator.h"
#endif

namespace lgreco {
namespace {

using collective::Algorithm;
using collective::BucketLayout;
using collective::CallOutcome;
using collective::Engine;
using collective::EngineOptions;
using collective::Fabric;
using collective::ReduceOp;

constexpr const char* kUsage = R"(usage: lgreco-bench [options]

The compressed allreduce of lgreco's engine, timed and checked like nccl-tests'
all_reduce_perf. One row per size:
  size count type codec time(us) algbw busbw wire_B wire_GB/s rel_err #wrong
algbw = size / time and busbw = algbw * 2 (n-1) / n count uncompressed bytes, as in
nccl-tests; wire_B is what one rank sent per call, wire_GB/s that over the time.
--fabric nccl adds nccl_us, plain NCCL allreduce of the same buffers, and vs_nccl =
nccl_us / time: how many times faster than plain NCCL.

Sizes and iterations
  -b, --minbytes SIZE      smallest size (K, M, G suffixes; default 1M)
  -e, --maxbytes SIZE      largest size (default: the smallest)
  -f, --stepfactor N       multiply the size by N between rows (default 2)
  -n, --iters N            timed iterations per size (default 20); time is their median
  -w, --warmup_iters N     untimed iterations before them (default 5)
  -c, --check 0|1          check the result of the last iteration (default 1)
  -d, --datatype T         float, half or bfloat16 (default float)
  -o, --op sum|avg         the reduction (default sum)

Compression
  --codec SPEC             a codec spec for every segment (default quant:bits=4; also
                           topk:density=D, and powersgd:rank=R with each segment a
                           matrix of 2^j rows, the largest power of two at most its
                           square root that divides it; docs/FORMAT.md), `none`
                           for the uncompressed algorithm, or `lgreco` for the adaptive
                           mode with the LGRECO_* parameters
  --registration FILE      lgreco mode: the buckets of this registration file, called in
                           order each iteration (one row; -b/-e ignored)
  --objective size|time    lgreco mode: what the search minimises (default size)
  --schedule W,P,N,L       lgreco mode: warm-up, period, window and switch lag in
                           iterations (default 3,1000000,2,2: one solve, in effect from
                           the 5th iteration; warm-up iterations count)
  --error-feedback 0|1     keep residuals across iterations (default 0: one-shot error)
  --algorithm A            auto, sra or allgather (default auto)
  --segment-bytes SIZE     without a registration, a size is split into segments of
                           this many bytes that act as layers (default 1M)

Ranks
  --fabric inproc|socket|nccl
                           threads of this process, processes over TCP, or processes on
                           the GPU through NCCL (default inproc). nccl: the CUDA backend
                           and device buffers; the ranks meet as with socket, and rank 0
                           hands NCCL's unique id to the others through that rendezvous.
                           Needs a build with CUDA and a GPU
  --ranks N                inproc: threads; socket, nccl: local processes to start, when
                           no rank is given (default 4)
  --rank R --world-size N --master-addr HOST --master-port P
                           socket, nccl: this process is rank R of N, rendezvous at rank
                           0's HOST:P (default: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                           from the environment, as torchrun sets them)
  --nccl-lib PATH          nccl: the libnccl to dlopen (default libnccl.so.2)
  --device N               nccl: the CUDA device (default: LOCAL_RANK modulo the number
                           of devices; the local processes --ranks starts get LOCAL_RANK =
                           their rank; 0 without LOCAL_RANK). Several ranks on one GPU
                           need a distinct NCCL_HOSTID each (docs/BENCH.md)
  --timeout S              longest wait for a peer, in seconds (default: LGRECO_TIMEOUT,
                           300)
  --seed N                 input seed (default 1)
  -h, --help               this text
)";

struct Options {
  uint64_t min_bytes = 1 << 20, max_bytes = 0, factor = 2;
  int iters = 20, warmup = 5;
  bool check = true;
  DType dtype = DType::kFloat32;
  bool dtype_given = false;
  ReduceOp op = ReduceOp::kSum;
  std::string codec = "quant:bits=4";
  std::string registration;
  std::string objective = "size";
  uint64_t schedule[4] = {3, 1000000, 2, 2};
  bool error_feedback = false;
  Algorithm algorithm = Algorithm::kAuto;
  uint64_t segment_bytes = 1 << 20;
  std::string fabric = "inproc";
  int ranks = 4;
  int rank = -1, world_size = -1;  // socket, given by flags
  std::string master_addr;
  int master_port = -1;
  std::string nccl_lib = "libnccl.so.2";  // nccl
  bool nccl_lib_given = false;
  int device = -1;                        // nccl; -1: LOCAL_RANK modulo the device count
  uint64_t timeout_s = 0;  // 0: LGRECO_TIMEOUT
  uint64_t seed = 1;
  bool adaptive() const { return codec == "lgreco"; }
  bool processes() const { return fabric == "socket" || fabric == "nccl"; }
};

uint64_t parse_size(const std::string& option, const std::string& text) {
  return cli::parse_size(option, text, uint64_t{1} << 40);
}

using cli::parse_int;

Options parse(int argc, char** argv) {
  Options o;
  cli::Args args(argc, argv, 1);
  while (args.next()) {
    const std::string a = args.arg();
    if (args.is_help()) {
      fputs(kUsage, stdout);
      exit(0);
    } else if (a == "-b" || a == "--minbytes") {
      o.min_bytes = parse_size(a, args.value());
    } else if (a == "-e" || a == "--maxbytes") {
      o.max_bytes = parse_size(a, args.value());
    } else if (a == "-f" || a == "--stepfactor") {
      o.factor = static_cast<uint64_t>(parse_int(a, args.value(), 2, 1 << 20));
    } else if (a == "-n" || a == "--iters") {
      o.iters = parse_int(a, args.value(), 1, 1000000);
    } else if (a == "-w" || a == "--warmup_iters") {
      o.warmup = parse_int(a, args.value(), 0, 1000000);
    } else if (a == "-c" || a == "--check") {
      o.check = parse_int(a, args.value(), 0, 1) == 1;
    } else if (a == "-d" || a == "--datatype") {
      const std::string t = args.value();
      o.dtype_given = true;
      if (t == "float" || t == "float32") o.dtype = DType::kFloat32;
      else if (t == "half" || t == "float16") o.dtype = DType::kFloat16;
      else if (t == "bfloat16") o.dtype = DType::kBFloat16;
      else throw cli::UsageError(a + " expects float, half or bfloat16, got '" + t + "'");
    } else if (a == "-o" || a == "--op") {
      const std::string t = args.value();
      if (t == "sum") o.op = ReduceOp::kSum;
      else if (t == "avg") o.op = ReduceOp::kAvg;
      else throw cli::UsageError(a + " expects sum or avg, got '" + t + "'");
    } else if (a == "--codec") {
      o.codec = args.value();
      if (o.codec != "lgreco") {
        try {
          CodecSpec::parse(o.codec);
        } catch (const CodecError& e) {
          throw cli::UsageError(std::string("--codec: ") + e.what());
        }
      }
    } else if (a == "--registration") {
      o.registration = args.value();
    } else if (a == "--objective") {
      o.objective = args.value();
      if (o.objective != "size" && o.objective != "time")
        throw cli::UsageError("--objective expects size or time, got '" + o.objective + "'");
    } else if (a == "--schedule") {
      const std::string t = args.value();
      unsigned long long v[4];
      char end;
      if (sscanf(t.c_str(), "%llu,%llu,%llu,%llu%c", &v[0], &v[1], &v[2], &v[3], &end) != 4)
        throw cli::UsageError("--schedule expects W,P,N,L (four whole numbers), got '" + t + "'");
      const std::string rule = config::schedule_rule_violation(v[0], v[1], v[2], v[3]);
      if (!rule.empty()) throw cli::UsageError("--schedule " + t + ": " + rule);
      std::copy(v, v + 4, o.schedule);
    } else if (a == "--error-feedback") {
      o.error_feedback = parse_int(a, args.value(), 0, 1) == 1;
    } else if (a == "--algorithm") {
      const std::string t = args.value();
      if (!collective::parse_algorithm(t, &o.algorithm))
        throw cli::UsageError("--algorithm expects auto, sra or allgather, got '" + t + "'");
    } else if (a == "--segment-bytes") {
      o.segment_bytes = parse_size(a, args.value());
      if (o.segment_bytes < 4096) throw cli::UsageError("--segment-bytes must be at least 4096");
    } else if (a == "--fabric") {
      o.fabric = args.value();
      if (o.fabric != "inproc" && o.fabric != "socket" && o.fabric != "nccl")
        throw cli::UsageError("--fabric expects inproc, socket or nccl, got '" + o.fabric + "'");
#ifndef LGRECO_BENCH_CUDA
      if (o.fabric == "nccl")
        throw cli::UsageError("--fabric nccl needs a build with CUDA: this lgreco-bench was built without nvcc "
                              "(make CUDA_HOME=/path/to/cuda)");
#endif
    } else if (a == "--nccl-lib") {
      o.nccl_lib = args.value();
      o.nccl_lib_given = true;
      if (o.nccl_lib.empty()) throw cli::UsageError("--nccl-lib needs a path");
    } else if (a == "--device") {
      o.device = parse_int(a, args.value(), 0, 1023);
    } else if (a == "--ranks") {
      o.ranks = parse_int(a, args.value(), 1, 1024);
    } else if (a == "--rank") {
      o.rank = parse_int(a, args.value(), 0, 1023);
    } else if (a == "--world-size") {
      o.world_size = parse_int(a, args.value(), 1, 1024);
    } else if (a == "--master-addr") {
      o.master_addr = args.value();
    } else if (a == "--master-port") {
      o.master_port = parse_int(a, args.value(), 1, 65535);
    } else if (a == "--timeout") {
      o.timeout_s = static_cast<uint64_t>(parse_int(a, args.value(), 1, 86400));
    } else if (a == "--seed") {
      o.seed = cli::parse_u64(a, args.value());
    } else {
      throw cli::UsageError("unknown option " + a);
    }
  }
  if (o.max_bytes == 0) o.max_bytes = o.min_bytes;
  if (o.timeout_s == 0) o.timeout_s = config::params().timeout_seconds;
  if (o.max_bytes < o.min_bytes) throw cli::UsageError("-e (maxbytes) is smaller than -b (minbytes)");
  if ((o.rank >= 0) != (o.world_size >= 0))
    throw cli::UsageError("--rank and --world-size go together");
  if (o.rank >= 0 && o.rank >= o.world_size)
    throw cli::UsageError("--rank " + std::to_string(o.rank) + " is not below --world-size " + std::to_string(o.world_size));
  if ((o.rank >= 0 || !o.master_addr.empty() || o.master_port >= 0) && !o.processes())
    throw cli::UsageError("--rank, --world-size, --master-addr and --master-port need --fabric socket or nccl");
  if ((o.nccl_lib_given || o.device >= 0) && o.fabric != "nccl")
    throw cli::UsageError("--nccl-lib and --device need --fabric nccl");
  if (!o.registration.empty() && o.dtype_given)
    throw cli::UsageError("-d/--datatype does not go with --registration: each bucket's type is the registration's");
  if (!o.registration.empty() && !o.adaptive())
    throw cli::UsageError("--registration needs --codec lgreco (with a fixed codec use --segment-bytes)");
  return o;
}

// ---------------------------------------------------------------------------------------
// Inputs and the check

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Input element i of a rank: uniform in [-1, 1) times a scale that changes every 64K
// elements by powers of two (so segments differ, as layers do), rounded to the dtype.
float input_value(uint64_t seed, int rank, uint64_t i, DType dtype) {
  const uint64_t h = mix(seed * 0x100000001b3ull ^ (uint64_t(rank) << 48) ^ i);
  const int exponent = static_cast<int>(mix(seed ^ (i >> 16)) % 12) - 8;
  const float v = std::ldexp(static_cast<float>(h >> 40) * 0x1p-23f - 1.0f, exponent);
  return round_to_dtype(v, dtype);
}

// The largest error one quantization of a bucket of values in [lo, hi] may add.
double unit_bound(const CodecSpec& spec, double lo, double hi) {
  if (spec.family() != CodecFamily::kQuant) return 0.0;
  return (hi - lo) / ((1u << spec.quant_params().bits) - 1);
}

// Half an ulp of the output type at magnitude m, and never less than half its smallest
// subnormal (float16: 2^-24; bfloat16: 2^-133), where the spacing stops shrinking. Twice
// that, for a value that lands next to a rounding boundary of the type after float32
// accumulation.
double output_rounding(DType dtype, double m) {
  switch (dtype) {
    case DType::kFloat32: return 0.0;
    case DType::kFloat16: return std::max(std::ldexp(m, -10), std::ldexp(1.0, -24));
    case DType::kBFloat16: return std::max(std::ldexp(m, -7), std::ldexp(1.0, -133));
  }
  return 0.0;
}

struct CheckResult {
  double squared_error = 0, squared_exact = 0;
  uint64_t wrong = 0;
};

// Against the float64 sum: each element's error must be within
//   TopK: the sum over ranks of |x| (each rank's value arrives exactly or not at all),
//   plus float32 rounding; PowerSGD: no per-element bound (a projection may move any
//   element), only rel_err and the bit-identity across ranks; quantization:
//   sum over ranks of their bucket's unit      (first quantization, every algorithm)
// + the unit of the reduced bucket             (sra's re-quantization, bounded through
//                                               the exact range widened by the first)
// + float32 rounding: (ranks + 3) ulps of the sum of magnitudes, and half an ulp of the
//   output's element type.
CheckResult check_output(const std::vector<uint8_t>& out, const BucketLayout& layout,
                         const std::vector<CodecSpec>& codecs, Algorithm algorithm, int ranks, uint64_t seed,
                         uint64_t offset, ReduceOp op) {
  CheckResult r;
  const DType dtype = layout.dtype;
  const double divisor = op == ReduceOp::kAvg ? ranks : 1;
  std::vector<double> exact, magnitude;
  for (size_t l = 0; l < layout.layers.size(); ++l) {
    const auto& layer = layout.layers[l];
    const CodecSpec& spec = codecs[l];
    const uint64_t bucket = spec.family() == CodecFamily::kQuant ? spec.quant_params().bucket : layer.numel;
    for (uint64_t b0 = 0; b0 < layer.numel; b0 += bucket) {
      const uint64_t n = std::min(bucket, layer.numel - b0);
      exact.assign(n, 0.0);
      magnitude.assign(n, 0.0);
      double units = 0;
      for (int rank = 0; rank < ranks; ++rank) {
        double lo = INFINITY, hi = -INFINITY;
        for (uint64_t i = 0; i < n; ++i) {
          const double x = input_value(seed, rank, offset + layer.offset + b0 + i, dtype);
          exact[i] += x;
          magnitude[i] += std::fabs(x);
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        units += unit_bound(spec, lo, hi);
      }
      double lo = INFINITY, hi = -INFINITY;
      for (uint64_t i = 0; i < n; ++i) {
        lo = std::min(lo, exact[i] / divisor);
        hi = std::max(hi, exact[i] / divisor);
      }
      const double reencode = algorithm == Algorithm::kScatterReduceAllGather
                                  ? unit_bound(spec, lo - units / divisor, hi + units / divisor)
                                  : 0.0;
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t e = layer.offset + b0 + i;
        const double want = exact[i] / divisor;
        const double got = load_as_float(out.data(), dtype, e);
        const double rounding = (ranks + 3) * std::ldexp(magnitude[i] / divisor, -23) +
                                output_rounding(dtype, std::fabs(want) + units / divisor + reencode);
        const double bound = spec.family() == CodecFamily::kTopk
                                 ? magnitude[i] / divisor + rounding
                                 : units / divisor + reencode + rounding;
        const double d = got - want;
        r.squared_error += d * d;
        r.squared_exact += want * want;
        if (!(std::fabs(d) <= bound) && spec.family() != CodecFamily::kPowersgd) ++r.wrong;
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------
// One rank

struct Row {
  uint64_t bytes = 0, count = 0;
  std::string codec, type;
  double seconds = 0, wire_bytes = 0, rel_err = NAN;
  double wrong = NAN;
  double nccl_seconds = NAN;  // --fabric nccl: plain NCCL allreduce of the same buffers
};

// Where one rank runs: the engine's fabric and backend, the fabric the check's host-side
// sums go through (the engine's, except with NCCL, whose operations take device memory),
// how to wait until everything enqueued is done (CPU: nothing to wait for; CUDA: the
// stream), and, with NCCL, plain NCCL's allreduce of the same buffers to time beside it.
struct RankContext {
  RankContext(Fabric& engine_fabric, Fabric& check_fabric, collective::Backend& rank_backend)
      : fabric(engine_fabric), host_fabric(check_fabric), backend(rank_backend) {}
  Fabric& fabric;
  Fabric& host_fabric;
  collective::Backend& backend;
  std::function<void()> sync = [] {};
  // Enqueues one uncompressed allreduce of `count` elements of `dtype` from in to out.
  std::function<void(const void* in, void* out, uint64_t count, DType dtype)> plain_allreduce;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<BucketLayout> layouts_for(const Options& o, const EngineOptions& eo, uint64_t count) {
  std::vector<BucketLayout> out;
  if (!o.registration.empty()) {
    const config::Registration reg = config::load_registration(o.registration);
    for (const auto& b : reg.buckets) out.push_back(collective::layout_from_registration(b, eo));
    return out;
  }
  config::RegisteredBucket bucket = config::auto_layout(count, o.dtype, o.segment_bytes);
  if (!o.adaptive() && eo.codec.family() == CodecFamily::kPowersgd)
    // Segments have no shape; low rank needs one: each becomes a matrix of 2^j rows, the
    // largest power of two not above its square root that divides it.
    for (config::RegisteredLayer& layer : bucket.layers) {
      uint64_t rows = 1;
      while ((rows * 2) * (rows * 2) <= layer.numel && layer.numel % (rows * 2) == 0) rows *= 2;
      layer.shape = {rows, layer.numel / rows};
      layer.has_shape = true;
    }
  out.push_back(collective::layout_from_registration(bucket, eo));
  return out;
}

EngineOptions engine_options(const Options& o, int rank, int ranks) {
  EngineOptions eo;
  if (o.adaptive()) {
    eo = EngineOptions::from_params(config::params(), rank);
    eo.mode = config::Mode::kAdaptive;
    if (!controller::parse_objective(o.objective, &eo.controller.objective))
      throw cli::UsageError("bad --objective");
    if (eo.controller.objective == controller::Objective::kTime &&
        std::find(eo.candidates.begin(), eo.candidates.end(), CodecSpec::none()) == eo.candidates.end())
      eo.candidates.push_back(CodecSpec::none());
    eo.controller.schedule = {o.schedule[0], o.schedule[1], o.schedule[2], o.schedule[3]};
    eo.controller.decision_log_path.clear();
  } else {
    eo.mode = config::Mode::kUniform;
    eo.codec = CodecSpec::parse(o.codec);
    eo.candidates = {eo.codec};
  }
  eo.error_feedback = o.error_feedback;
  eo.algorithm = o.algorithm;
  // One rank has nothing to exchange and auto would pass every call through; the
  // all-gather algorithm still shows what the codec costs and loses.
  if (ranks == 1 && eo.algorithm == Algorithm::kAuto) eo.algorithm = Algorithm::kAllGather;
  // What the ranks must agree on beyond the parameters: the bench's own settings.
  char schedule[96];
  snprintf(schedule, sizeof schedule, " schedule=%llu,%llu,%llu,%llu", static_cast<unsigned long long>(o.schedule[0]),
           static_cast<unsigned long long>(o.schedule[1]), static_cast<unsigned long long>(o.schedule[2]),
           static_cast<unsigned long long>(o.schedule[3]));
  eo.parameters_text += " bench: codec=" + o.codec + " objective=" + o.objective + schedule +
                        " error_feedback=" + (o.error_feedback ? "1" : "0") +
                        " algorithm=" + collective::algorithm_name(o.algorithm) + " dtype=" + dtype_name(o.dtype) +
                        " op=" + (o.op == ReduceOp::kAvg ? "avg" : "sum") + " segment_bytes=" +
                        std::to_string(o.segment_bytes) + " registration=" + o.registration;
  return eo;
}

// Runs every size on this rank; rank 0's rows are returned.
std::vector<Row> run_rank(const Options& o, const RankContext& ctx) {
  Fabric& fabric = ctx.fabric;
  collective::Backend& backend = ctx.backend;
  const int n = fabric.size(), me = fabric.rank();
  std::vector<Row> rows;
  std::vector<uint64_t> sizes;
  if (!o.registration.empty()) sizes = {0};
  else
    for (uint64_t s = o.min_bytes; s <= o.max_bytes; s *= o.factor) {
      sizes.push_back(s);
      if (s > o.max_bytes / o.factor) break;
    }
  for (uint64_t size : sizes) {
    const uint64_t count = size / dtype_size(o.dtype);
    const EngineOptions eo = engine_options(o, me, n);
    const std::vector<BucketLayout> buckets = layouts_for(o, eo, count);
    Engine engine(eo, buckets, fabric, backend);
    // Inputs and outputs are the backend's memory (device memory on CUDA): inputs are
    // uploaded once, outputs read back into host memory for the check.
    std::vector<std::unique_ptr<collective::Backend::Buffer>> inputs(buckets.size()), out_buffers(buckets.size());
    std::vector<std::vector<uint8_t>> outputs(buckets.size());
    uint64_t offset = 0, total_count = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      // Element i of bucket b draws input i + offset: buckets hold different values.
      const DType t = buckets[b].dtype;
      std::vector<uint8_t> input(buckets[b].count * dtype_size(t));
      for (uint64_t i = 0; i < buckets[b].count; ++i)
        store_from_float(input.data(), t, i, input_value(o.seed, me, offset + i, t));
      offset += buckets[b].count;
      inputs[b] = backend.allocate(input.size());
      backend.upload(inputs[b]->data(), input.data(), input.size());
      out_buffers[b] = backend.allocate(input.size());
      outputs[b].assign(input.size(), 0);
      total_count += buckets[b].count;
    }
    ctx.sync();
    std::vector<double> times;
    double wire = 0;
    std::string codec_name;
    uint64_t step = 0;
    // One iteration: every bucket's call, then a wait until the queue is empty, so that
    // the time covers the work, not only its launch.
    auto iterate = [&](bool timed) {
      const uint64_t sent_before = engine.counters().wire_bytes_sent;
      const double start = cli::seconds_now();
      for (size_t b = 0; b < buckets.size(); ++b) {
        const CallOutcome out = engine.allreduce({static_cast<uint32_t>(b), step, inputs[b]->data(),
                                                  out_buffers[b]->data(), buckets[b].count, buckets[b].dtype, o.op,
                                                  false});
        if (out.kind == CallOutcome::Kind::kError) throw std::runtime_error(out.message);
        if (out.kind == CallOutcome::Kind::kPassThrough)
          throw std::runtime_error("the engine passed the call through: " + out.message);
      }
      ctx.sync();
      const double seconds = cli::seconds_now() - start;
      ++step;
      if (timed) {
        times.push_back(seconds);
        wire += static_cast<double>(engine.counters().wire_bytes_sent - sent_before);
      }
    };
    for (int i = 0; i < o.warmup; ++i) iterate(false);
    for (int i = 0; i < o.iters; ++i) iterate(true);
    for (size_t b = 0; b < buckets.size(); ++b)
      backend.read_back(outputs[b].data(), out_buffers[b]->data(), outputs[b].size())->wait();

    Row row;
    row.type = dtype_name(buckets.empty() ? o.dtype : buckets[0].dtype);
    for (const BucketLayout& bucket : buckets) {
      row.bytes += bucket.count * dtype_size(bucket.dtype);
      if (bucket.dtype != buckets[0].dtype) row.type = "mixed";
    }
    row.count = total_count;
    row.seconds = median(times);
    row.wire_bytes = wire / o.iters;
    if (ctx.plain_allreduce) {
      // Plain NCCL on the same buffers (the engine's outputs are read back already),
      // warmed up and timed the same way.
      std::vector<double> plain;
      for (int i = 0; i < o.warmup + o.iters; ++i) {
        const double start = cli::seconds_now();
        for (size_t b = 0; b < buckets.size(); ++b)
          ctx.plain_allreduce(inputs[b]->data(), out_buffers[b]->data(), buckets[b].count, buckets[b].dtype);
        ctx.sync();
        if (i >= o.warmup) plain.push_back(cli::seconds_now() - start);
      }
      row.nccl_seconds = median(plain);
    }
    if (o.adaptive()) {
      // The adaptive assignment: average bits per value of the last iteration's codecs.
      double bits = 0;
      for (size_t b = 0; b < buckets.size(); ++b) {
        const auto codecs = engine.layer_codecs(static_cast<uint32_t>(b));
        for (size_t l = 0; l < codecs.size(); ++l)
          bits += 8.0 * collective::encoded_bytes(codecs[l], buckets[b].dtype, buckets[b].layers[l].numel);
      }
      char text[64];
      snprintf(text, sizeof text, "lgreco(%.2fb,e%llu)", bits / total_count,
               static_cast<unsigned long long>(engine.epoch()));
      row.codec = text;
    } else {
      row.codec = o.codec;
    }
    if (o.check) {
      CheckResult c;
      uint64_t at = 0;
      for (size_t b = 0; b < buckets.size(); ++b) {
        const CheckResult cb = check_output(outputs[b], buckets[b], engine.layer_codecs(static_cast<uint32_t>(b)),
                                            engine.algorithm(static_cast<uint32_t>(b)), n, o.seed, at, o.op);
        c.squared_error += cb.squared_error;
        c.squared_exact += cb.squared_exact;
        c.wrong += cb.wrong;
        at += buckets[b].count;
      }
      // Bit-identical outputs: every rank compares a digest of its output with rank 0's.
      uint64_t h = 0xcbf29ce484222325ull;
      for (const auto& out : outputs) h = collective::digest({reinterpret_cast<const char*>(out.data()), out.size()}, h);
      std::vector<double> sums(n + 1, 0.0);
      sums[me] = static_cast<double>(h >> 12);  // 52 bits: exact in a double
      sums[n] = static_cast<double>(o.error_feedback ? 0 : c.wrong);  // the bound assumes no residual
      ctx.host_fabric.all_reduce_sum(std::span<double>(sums));
      double wrong = sums[n];
      for (int r = 1; r < n; ++r)
        if (sums[r] != sums[0]) wrong += static_cast<double>(total_count);
      row.rel_err = c.squared_exact > 0 ? std::sqrt(c.squared_error / c.squared_exact) : 0.0;
      row.wrong = wrong;  // with error feedback: only outputs that differ between ranks
    }
    if (me == 0) rows.push_back(row);
  }
  return rows;
}

void print_header(const Options& o, int ranks, const std::string& backend = "cpu") {
  printf("# lgreco-bench %s (%s)\n", version_string(), bench::utc_now().c_str());
  printf("# ranks %d, fabric %s, backend %s, codec %s, algorithm %s, error feedback %s, op %s, datatype %s\n",
         ranks, o.fabric.c_str(), backend.c_str(), o.codec.c_str(), collective::algorithm_name(o.algorithm),
         o.error_feedback ? "on" : "off", o.op == ReduceOp::kAvg ? "avg" : "sum",
         o.registration.empty() ? dtype_name(o.dtype) : "the registration's");
  if (o.adaptive())
    printf("# lgreco: objective %s, schedule %llu,%llu,%llu,%llu%s%s\n", o.objective.c_str(),
           static_cast<unsigned long long>(o.schedule[0]), static_cast<unsigned long long>(o.schedule[1]),
           static_cast<unsigned long long>(o.schedule[2]), static_cast<unsigned long long>(o.schedule[3]),
           o.registration.empty() ? "" : ", registration ", o.registration.c_str());
  printf("# iterations %d timed (median) after %d warm-up; seed %llu; cpu %s\n", o.iters, o.warmup,
         static_cast<unsigned long long>(o.seed), bench::cpu_model().c_str());
  printf("#%12s %12s %9s %22s %11s %9s %9s %12s %9s %10s %8s", "size", "count", "type", "codec", "time(us)",
         "algbw", "busbw", "wire_B", "wire_GB/s", "rel_err", "#wrong");
  if (o.fabric == "nccl") printf(" %11s %8s", "nccl_us", "vs_nccl");
  printf("\n");
  fflush(stdout);
}

void print_row(const Row& r, int ranks) {
  const double algbw = r.bytes / r.seconds / 1e9;
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  char wrong[32] = "-", rel[32] = "-";
  if (!std::isnan(r.wrong)) snprintf(wrong, sizeof wrong, "%.0f", r.wrong);
  if (!std::isnan(r.rel_err)) snprintf(rel, sizeof rel, "%.3e", r.rel_err);
  printf(" %12llu %12llu %9s %22s %11.1f %9.3f %9.3f %12.0f %9.3f %10s %8s",
         static_cast<unsigned long long>(r.bytes), static_cast<unsigned long long>(r.count), r.type.c_str(),
         r.codec.c_str(), r.seconds * 1e6, algbw, busbw, r.wire_bytes, r.wire_bytes / r.seconds / 1e9, rel, wrong);
  if (!std::isnan(r.nccl_seconds)) printf(" %11.1f %8.2f", r.nccl_seconds * 1e6, r.nccl_seconds / r.seconds);
  printf("\n");
  fflush(stdout);
}

// Returns the process exit code: 0, or 1 when a row has wrong elements.
int report(const std::vector<Row>& rows, const Options& o, int ranks) {
  uint64_t wrong = 0;
  for (const Row& r : rows) {
    print_row(r, ranks);
    if (!std::isnan(r.wrong)) wrong += static_cast<uint64_t>(r.wrong);
  }
  if (o.check) printf("# Out of bounds values : %llu %s\n", static_cast<unsigned long long>(wrong), wrong ? "FAILED" : "OK");
  return wrong ? 1 : 0;
}

int run_inproc(const Options& o) {
  auto hub = std::make_shared<collective::InProcHub>(o.ranks, std::chrono::seconds(o.timeout_s));
  std::vector<Row> rows;
  std::vector<std::string> errors(o.ranks);
  std::vector<std::thread> threads;
  print_header(o, o.ranks);
  for (int r = 0; r < o.ranks; ++r)
    threads.emplace_back([&, r] {
      collective::InProcFabric fabric(hub, r);
      collective::CpuBackend backend;
      try {
        auto mine = run_rank(o, RankContext{fabric, fabric, backend});
        if (r == 0) rows = std::move(mine);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        hub->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < o.ranks; ++r)
    if (!errors[r].empty()) throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
  return report(rows, o, o.ranks);
}

#ifdef LGRECO_BENCH_CUDA
// ---------------------------------------------------------------------------------------
// --fabric nccl: one process per rank on the GPU

// The two calls that create a communicator, which the shim's table does not hold (the
// shim never creates one). Declared here from nccl.h's signatures with nccl_abi.h's types:
// the tool neither includes nccl.h nor links libnccl.
using GetUniqueIdFn = nccl::Result (*)(nccl::UniqueId* id);
using CommInitRankFn = nccl::Result (*)(nccl::Comm* comm, int nranks, nccl::UniqueId id, int rank);

void cuda_check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}

nccl::DataType nccl_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return nccl::kFloat32;
    case DType::kFloat16: return nccl::kFloat16;
    case DType::kBFloat16: return nccl::kBfloat16;
  }
  throw std::logic_error("no NCCL type for this dtype");
}

template <typename Fn>
Fn nccl_symbol(void* lib, const std::string& path, const char* pname, const char* name) {
  void* f = dlsym(lib, pname);
  if (!f) f = dlsym(lib, name);
  if (!f) throw std::runtime_error("--fabric nccl: " + path + " exports neither " + pname + " nor " + name);
  return reinterpret_cast<Fn>(f);
}

// The CUDA device of this rank: --device, else LOCAL_RANK modulo the devices, else 0.
int pick_device(const Options& o) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0)
    throw std::runtime_error(std::string("--fabric nccl needs a CUDA device, and this process sees none (cudaGetDeviceCount: ") +
                             (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
  if (o.device >= 0) {
    if (o.device >= devices)
      throw std::runtime_error("--device " + std::to_string(o.device) + ": this process sees " +
                               std::to_string(devices) + " CUDA device(s)");
    return o.device;
  }
  const char* local = getenv("LOCAL_RANK");
  if (!local || !*local) return 0;
  char* end = nullptr;
  const long v = strtol(local, &end, 10);
  if (*end != '\0' || v < 0) throw std::runtime_error(std::string("LOCAL_RANK is not a rank: '") + local + "'");
  return static_cast<int>(v % devices);
}

int run_nccl_rank(const Options& o, const collective::SocketFabricOptions& so) {
  // NCCL first: a wrong --nccl-lib is reported the same with or without a GPU. The
  // shim's resolver then finds it among the loaded objects, as it finds a framework's.
  void* lib = dlopen(o.nccl_lib.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!lib)
    throw std::runtime_error("--fabric nccl: cannot load NCCL from '" + o.nccl_lib + "' (--nccl-lib PATH): " +
                             dlerror());
  const auto get_unique_id = nccl_symbol<GetUniqueIdFn>(lib, o.nccl_lib, "pncclGetUniqueId", "ncclGetUniqueId");
  const auto comm_init_rank = nccl_symbol<CommInitRankFn>(lib, o.nccl_lib, "pncclCommInitRank", "ncclCommInitRank");
  std::string error;
  const std::optional<shim::ResolvedNccl> resolved = shim::resolve_loaded_nccl(&error);
  if (!resolved) throw std::runtime_error("--fabric nccl: " + o.nccl_lib + ": " + error);
  // The table must point into the library the communicator comes from: the resolver
  // takes the first loaded libnccl, which is another one if something loaded one before.
  struct link_map* map = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name) {
    char* mine = realpath(map->l_name, nullptr);
    char* theirs = realpath(resolved->path.c_str(), nullptr);
    const bool same = mine && theirs && strcmp(mine, theirs) == 0;
    const std::string loaded = mine ? mine : map->l_name;
    free(mine);
    free(theirs);
    if (!same)
      throw std::runtime_error("--fabric nccl: two NCCL libraries are loaded, " + loaded + " (--nccl-lib) and " +
                               resolved->path + " (found first by the shim's resolver)");
  }
  const shim::NcclApi& api = resolved->api;
  auto nccl_check = [&](nccl::Result r, const char* call) {
    if (r != nccl::kSuccess) throw std::runtime_error(std::string(call) + ": " + api.error_string(r));
  };

  const int device = pick_device(o);
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");

  // The ranks meet through the socket fabric's rendezvous; it carries NCCL's unique id
  // from rank 0 to the others, and later the check's sums (host memory).
  auto host = collective::SocketFabric::create(so);
  nccl::UniqueId id{};
  if (so.rank == 0) nccl_check(get_unique_id(&id), "ncclGetUniqueId");
  std::vector<uint8_t> ids(sizeof id * so.world_size);
  const std::vector<uint64_t> id_bytes(so.world_size, sizeof id);
  host->all_gather_v(reinterpret_cast<const uint8_t*>(&id), id_bytes, ids.data());
  memcpy(&id, ids.data(), sizeof id);  // rank 0's
  nccl::Comm comm = nullptr;
  nccl_check(comm_init_rank(&comm, so.world_size, id, so.rank), "ncclCommInitRank");

  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  int code = 0;
  try {
    std::unique_ptr<shim::DeviceRuntime> runtime = shim::cuda_runtime();
    std::unique_ptr<shim::StreamBackend> backend = runtime->create_backend(device, 0);
    backend->set_stream(stream);
    shim::NcclFabric fabric(api, comm, so.rank, so.world_size, std::chrono::milliseconds(so.timeout));
    fabric.set_stream(stream);
    RankContext ctx{fabric, *host, *backend};
    ctx.sync = [&] { cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); };
    ctx.plain_allreduce = [&](const void* in, void* out, uint64_t count, DType t) {
      nccl_check(api.all_reduce(in, out, count, nccl_dtype(t), o.op == ReduceOp::kAvg ? nccl::kAvg : nccl::kSum, comm,
                                stream),
                 "ncclAllReduce");
    };
    if (so.rank == 0) {
      print_header(o, so.world_size, runtime->name() + " on device " + std::to_string(device) + " (" + prop.name + ")");
      printf("# nccl %s at %s; plain NCCL allreduce of the same buffers timed the same way: nccl_us, vs_nccl\n",
             shim::nccl_version_name(resolved->version_code).c_str(), resolved->path.c_str());
      fflush(stdout);
    }
    const std::vector<Row> rows = run_rank(o, ctx);
    code = so.rank == 0 ? report(rows, o, so.world_size) : 0;
    ctx.sync();
  } catch (...) {
    // Peers waiting in the check's exchange fail at once; NCCL's own waits end when the
    // launcher (or the user) ends the processes: never destroy a communicator whose
    // operations may still be running.
    host->abort("rank " + std::to_string(so.rank) + " failed");
    api.comm_abort(comm);
    throw;
  }
  nccl_check(api.comm_destroy(comm), "ncclCommDestroy");
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return code;
}
#endif

int run_socket_rank(const Options& o, const collective::SocketFabricOptions& so) {
#ifdef LGRECO_BENCH_CUDA
  if (o.fabric == "nccl") {
    try {
      return run_nccl_rank(o, so);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (what.rfind("--fabric nccl", 0) == 0) throw;
      throw std::runtime_error("--fabric nccl, rank " + std::to_string(so.rank) + ": " + what);
    }
  }
#endif
  auto fabric = collective::SocketFabric::create(so);
  collective::CpuBackend backend;
  if (so.rank == 0) print_header(o, so.world_size);
  const std::vector<Row> rows = run_rank(o, RankContext{*fabric, *fabric, backend});
  return so.rank == 0 ? report(rows, o, so.world_size) : 0;
}

// --fabric socket or nccl: this process is one rank (flags, else torchrun's environment),
// or, with neither, it starts --ranks local processes.
int run_socket(const Options& o) {
  if (o.rank >= 0 || (getenv("RANK") && getenv("WORLD_SIZE"))) {
    collective::SocketFabricOptions so;  // rendezvous at 127.0.0.1:29500 unless told otherwise
    if (getenv("RANK") && getenv("WORLD_SIZE")) so = collective::SocketFabricOptions::from_env();
    if (o.rank >= 0) {
      so.rank = o.rank;
      so.world_size = o.world_size;
    }
    if (!o.master_addr.empty()) so.master_host = o.master_addr;
    if (o.master_port >= 0) so.master_port = static_cast<uint16_t>(o.master_port);
    so.timeout = std::chrono::seconds(o.timeout_s);
    return run_socket_rank(o, so);
  }
  collective::SocketFabricOptions so;
  so.world_size = o.ranks;
  so.master_host = "127.0.0.1";
  so.master_port = static_cast<uint16_t>(20000 + getpid() % 20000);
  so.timeout = std::chrono::seconds(o.timeout_s);
  fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + strerror(errno));
    if (pid == 0) {
      so.rank = r;
      // Local processes, as torchrun starts them: the local rank picks the device.
      if (o.fabric == "nccl") setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      const int code = cli::guarded_main("lgreco-bench", [&] { return run_socket_rank(o, so); });
      fflush(stdout);
      _exit(code);
    }
    children.push_back(pid);
  }
  int worst = 0;
  for (size_t left = children.size(); left > 0; --left) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    worst = std::max(worst, code);
    // With NCCL a failed rank can leave its peers waiting on the GPU for ever (NCCL's
    // own waits have no timeout): end them.
    if (code != 0 && o.fabric == "nccl")
      for (pid_t other : children)
        if (other != pid) kill(other, SIGTERM);
  }
  return worst;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-bench", [&] {
    const lgreco::Options o = lgreco::parse(argc, argv);
    return o.processes() ? lgreco::run_socket(o) : lgreco::run_inproc(o);
  });
}
