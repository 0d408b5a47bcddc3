// lgreco-codec-bench: throughput of the CPU reference codec on one core, as a table.
//
// Every row times one operation over the same input (default 16 Mi float32 values,
// larger than the last-level cache, so memory traffic is real) and reports the median of
// the repetitions. GB/s counts the float32 input bytes (count x 4) for every operation,
// the unit of the targets in issue "Foundation and the quantization codec". A memcpy of
// the input in the same run gives the machine's ceiling for comparison.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "config/version.h"
#include "kernels/codec.h"
#include "kernels/cpu_dispatch.h"
#include "kernels/lowrank.h"
#include "kernels/quant.h"
#include "kernels/topk.h"
#include "tools/bench_util.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-codec-bench [--count N] [--reps R] [--bits B] [--bucket N]

Times the CPU reference codecs on one core: quantization's encode, encode with error
feedback, decode, decode-accumulate, and the error statistics of 7 candidates (bits
2..8), for float32 input, plus float16/bfloat16 encode; TopK at 1% (encode with
feedback, decode-accumulate, statistics of 6 densities); one-shot PowerSGD at rank 4 on
the input as a matrix, and its statistics for ranks 2..8. Prints the median GB/s of
float32 input over R repetitions, and the targets of the foundation issue.

  --count N   values per run (default 16777216)
  --reps R    repetitions, median reported (default 9)
  --bits B    bit width of the single-candidate rows (default 4)
  --bucket N  bucket size (default 1024)
)";

int run(int argc, char** argv) {
  uint64_t count = uint64_t{1} << 24;
  int reps = 9;
  QuantParams p;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    const auto value = [&] { return args.value(); };
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--count") {
      count = cli::parse_u64(arg, value());
    } else if (arg == "--reps") {
      reps = static_cast<int>(cli::parse_u32(arg, value()));
    } else if (arg == "--bits") {
      p.bits = static_cast<int>(cli::parse_u32(arg, value()));
    } else if (arg == "--bucket") {
      p.bucket = cli::parse_u32(arg, value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  if (count == 0 || count > (uint64_t{1} << 31)) throw cli::UsageError("--count must be in 1..2^31");
  if (reps < 1) throw cli::UsageError("--reps must be at least 1");
  try {
    p.validate();
  } catch (const CodecError& e) {
    throw cli::UsageError(e.what());
  }

  std::mt19937_64 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(count), residual(count), acc(count), y(count), copy(count);
  for (auto& v : x) v = normal(rng);
  for (auto& v : residual) v = 0.01f * normal(rng);
  std::vector<uint16_t> half(count), bf16(count);
  for (uint64_t i = 0; i < count; ++i) {
    half[i] = float_to_half_rn(x[i]);
    bf16[i] = float_to_bf16_rn(x[i]);
  }
  std::vector<uint8_t> encoded(quant::encoded_bytes(p, count));
  std::vector<QuantParams> candidates;
  for (int b = 2; b <= 8; ++b) candidates.push_back(QuantParams{b, p.bucket, p.rounding});
  std::vector<double> errors(candidates.size());
  const NoiseKey noise{42, 0, 1, 0};
  const Slice slice{x.data(), count, 0};

  printf("# lgreco-codec-bench, lgreco %s, %s\n", version_string(), bench::utc_now().c_str());
  printf("# cpu: %s; one thread; hot loops: %s\n", bench::cpu_model().c_str(), cpu_code_path());
  printf("# count %llu values (%.1f MiB float32), bucket %u, median of %d reps; GB/s = count*4 bytes / time\n",
         static_cast<unsigned long long>(count), count * 4.0 / (1 << 20), p.bucket, reps);
  printf("%-28s %5s %10s %9s %8s %s\n", "operation", "bits", "time_ms", "GB/s", "target", "");

  const auto row = [&](const char* name, int bits, double target, const std::function<void()>& fn) {
    const double t = bench::median_seconds(reps, fn);
    const double gbs = count * 4.0 / t / 1e9;
    char target_text[16] = "-";
    if (target > 0) snprintf(target_text, sizeof target_text, "%.2f", target);
    printf("%-28s %5d %10.3f %9.3f %8s %s\n", name, bits, t * 1e3, gbs, target_text,
           target > 0 ? (gbs >= target ? "ok" : "MISSED") : "");
  };

  row("memcpy (ceiling)", 32, 0, [&] { memcpy(copy.data(), x.data(), count * 4); });
  row("encode", p.bits, 0, [&] { quant::encode(p, noise, DType::kFloat32, slice, nullptr, encoded); });
  row("encode + error feedback", p.bits, 0.5,
      [&] { quant::encode(p, noise, DType::kFloat32, slice, residual.data(), encoded); });
  QuantParams nearest = p;
  nearest.rounding = Rounding::kNearest;
  row("encode nearest + feedback", p.bits, 0,
      [&] { quant::encode(nearest, noise, DType::kFloat32, slice, residual.data(), encoded); });
  row("encode float16 input", p.bits, 0, [&] {
    quant::encode(p, noise, DType::kFloat16, Slice{half.data(), count, 0}, nullptr, encoded);
  });
  row("encode bfloat16 input", p.bits, 0, [&] {
    quant::encode(p, noise, DType::kBFloat16, Slice{bf16.data(), count, 0}, nullptr, encoded);
  });
  quant::encode(p, noise, DType::kFloat32, slice, nullptr, encoded);
  row("decode", p.bits, 0, [&] { quant::decode(p, encoded, count, DType::kFloat32, y.data()); });
  row("decode-accumulate", p.bits, 1.0, [&] { quant::decode_accumulate(p, encoded, count, acc.data()); });
  row("stats, 7 candidates (2..8)", 0, 0.15,
      [&] { quant::squared_errors(candidates, DType::kFloat32, slice, residual.data(), errors); });

  // TopK at 1% (bits column: 0), and its statistics for the six densities of the default
  // candidate set; no target on the CPU (the GPU's is in tests/gpu/run.sh families).
  const TopkParams one_percent{10'000'000};
  std::vector<uint8_t> sparse(topk::encoded_bytes(one_percent, count));
  row("topk 1% encode + feedback", 0, 0,
      [&] { topk::encode(one_percent, DType::kFloat32, slice, residual.data(), sparse); });
  topk::encode(one_percent, DType::kFloat32, slice, nullptr, sparse);
  row("topk 1% decode-accumulate", 0, 0, [&] { topk::decode_accumulate(one_percent, sparse, count, acc.data()); });
  const std::vector<TopkParams> densities = {{1'000'000}, {2'500'000}, {5'000'000},
                                             {10'000'000}, {20'000'000}, {50'000'000}};
  std::vector<double> topk_errors(densities.size());
  row("topk stats, 6 densities", 0, 0,
      [&] { topk::squared_errors(densities, DType::kFloat32, slice, residual.data(), topk_errors); });

  // PowerSGD, one-shot, on the input as a square-ish matrix (rows = 2^floor(log2(count)/2)).
  uint64_t rows = 1;
  while (rows * rows * 4 <= count) rows *= 2;
  if (count % rows == 0) {
    const PowersgdParams rank4{4, rows};
    const lowrank::Shape shape{rows, count / rows};
    std::vector<uint8_t> factors(lowrank::encoded_bytes(shape, 4));
    row("powersgd rank 4 encode + fb", 0, 0,
        [&] { lowrank::encode(rank4, noise, DType::kFloat32, slice, residual.data(), factors); });
    const std::vector<uint32_t> ranks = {2, 3, 4, 5, 6, 7, 8};
    std::vector<double> rank_errors(ranks.size());
    std::vector<float> basis(shape.cols * 8);
    lowrank::initial_q(noise, shape.cols, 8, basis.data());
    row("powersgd stats, ranks 2..8", 0, 0,
        [&] { lowrank::squared_errors(x.data(), shape, basis.data(), 8, ranks, rank_errors); });
  }
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-codec-bench", [&] { return lgreco::run(argc, argv); });
}
