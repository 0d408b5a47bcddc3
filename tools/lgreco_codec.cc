// lgreco-codec: encode, decode and measure gradient codecs on files, outside training.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "config/version.h"
#include "kernels/codec.h"
#include "kernels/lgc_file.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage:
  lgreco-codec encode --codec SPEC [--seed N] [--rank R] [--step S] [--layer L] [--shape NxM] IN.f32 OUT.lgc
  lgreco-codec decode IN.lgc OUT.f32
  lgreco-codec stats --codec SPEC [--codec SPEC ...] [--seed N] [--layer L] [--shape NxM] IN.f32
  lgreco-codec info IN.lgc
  lgreco-codec --help | --version

IN.f32 and OUT.f32 are raw little-endian float32 arrays. OUT.lgc is an encoded layer
with its codec, count and noise key in a checksummed header (docs/FORMAT.md).

Codec specs (docs/FORMAT.md):
  none                                      the values themselves
  quant[:bits=B,bucket=N,rounding=R]        max-min bucketed quantization;
                                            B in 1..8 (default 4), N a multiple of 32
                                            (default 1024), R stochastic (default) or nearest
  topk[:density=D]                          the ceil(D x n) values of largest magnitude with
                                            their indices; D a decimal in (0, 1] with at
                                            most 9 digits after the point (default 0.01)
  powersgd[:rank=R][,rows=N]                rank-R factors of the values as an N x (n/N)
                                            matrix, one power iteration from a seeded start
                                            (R in 1..256, default 4); N from --shape

encode   --seed, --rank, --step, --layer key the stochastic-rounding noise (default 0);
         --seed and --layer also seed PowerSGD's starting matrix.
--shape  NxM: the matrix view of IN.f32 for powersgd (N x M must be its count); sets
         rows=N in the spec stored in OUT.lgc, so that decode needs no --shape.
stats    prints one line per candidate: spec, encoded bytes, L2 error ||x - C(x)||, and
         that error relative to ||x||. powersgd's error is the one-shot codec's with the
         --seed and --layer given (every rank from one seeded basis). For stochastic rounding the error is the exact
         expectation over the rounding noise (sqrt of the expected squared error), so it
         does not depend on --seed; for nearest rounding and topk it is the actual error.
info     prints the header of an .lgc file.

Exit status: 0 success, 1 error (unreadable or corrupt file, ...), 2 bad command line.
)";

struct Options {
  std::vector<std::string> specs;
  NoiseKey noise;
  uint64_t shape_rows = 0, shape_cols = 0;  // --shape NxM; 0: not given
  std::vector<std::string> positional;
};

// "NxM" with N, M >= 1 and N x M below 2^34.
void parse_shape(const std::string& text, Options* o) {
  const size_t x = text.find('x');
  if (x == std::string::npos) throw cli::UsageError("--shape expects NxM (such as 1024x4096), got '" + text + "'");
  o->shape_rows = cli::parse_u64("--shape", text.substr(0, x));
  o->shape_cols = cli::parse_u64("--shape", text.substr(x + 1));
  if (o->shape_rows == 0 || o->shape_cols == 0 || o->shape_rows > kMaxLayerElements ||
      o->shape_cols > kMaxLayerElements / o->shape_rows)
    throw cli::UsageError("--shape " + text + ": each side must be at least 1 and the product at most 2^34");
}

// allow_noise_key: --rank, --step, --layer (encode); allow_shape: --shape, --layer.
Options parse_options(int argc, char** argv, int first, bool allow_noise_key, bool allow_shape) {
  Options o;
  for (cli::Args args(argc, argv, first); args.next();) {
    const std::string& arg = args.arg();
    const auto value = [&] { return args.value(); };
    if (arg == "--codec")
      o.specs.push_back(value());
    else if (arg == "--seed")
      o.noise.seed = cli::parse_u64(arg, value());
    else if (allow_noise_key && arg == "--rank")
      o.noise.rank = cli::parse_u32(arg, value());
    else if (allow_noise_key && arg == "--step")
      o.noise.step = cli::parse_u64(arg, value());
    else if ((allow_noise_key || allow_shape) && arg == "--layer")
      o.noise.layer = cli::parse_u32(arg, value());
    else if (allow_shape && arg == "--shape")
      parse_shape(value(), &o);
    else if (arg.size() > 1 && arg[0] == '-')
      throw cli::UsageError("unknown option " + arg);
    else
      o.positional.push_back(arg);
  }
  return o;
}

// A bad spec on the command line is a usage error (exit 2), not a runtime one. A powersgd
// spec takes its rows from --shape.
CodecSpec parse_spec(const std::string& text, const Options& o) {
  CodecSpec spec;
  try {
    spec = CodecSpec::parse(text);
  } catch (const CodecError& e) {
    throw cli::UsageError(e.what());
  }
  if (spec.family() == CodecFamily::kPowersgd) {
    PowersgdParams p = spec.powersgd_params();
    if (o.shape_rows && p.rows && p.rows != o.shape_rows)
      throw cli::UsageError(text + ": rows=" + std::to_string(p.rows) + " disagrees with --shape " +
                            std::to_string(o.shape_rows) + "x" + std::to_string(o.shape_cols));
    if (!p.rows) p.rows = o.shape_rows;
    if (!p.rows) throw cli::UsageError(text + " needs the matrix shape: --shape NxM");
    spec = CodecSpec::powersgd(p);
  }
  return spec;
}

// With --shape, the input must be that matrix.
void check_shape(const Options& o, uint64_t count) {
  if (o.shape_rows && o.shape_rows * o.shape_cols != count)
    throw std::runtime_error(o.positional[0] + ": " + std::to_string(count) + " values, but --shape " +
                             std::to_string(o.shape_rows) + "x" + std::to_string(o.shape_cols) + " makes " +
                             std::to_string(o.shape_rows * o.shape_cols));
}

void expect_positional(const Options& o, size_t n, const char* what) {
  if (o.positional.size() != n)
    throw cli::UsageError(std::string("expected ") + what + ", got " + std::to_string(o.positional.size()) +
                          " file argument(s)");
}

int cmd_encode(const Options& o) {
  expect_positional(o, 2, "IN.f32 OUT.lgc");
  if (o.specs.size() != 1) throw cli::UsageError("encode needs exactly one --codec");
  const CodecSpec spec = parse_spec(o.specs[0], o);
  const std::vector<float> x = cli::read_f32(o.positional[0]);
  if (x.size() > kMaxLayerElements) throw std::runtime_error(o.positional[0] + ": more than 2^34 values");
  check_shape(o, x.size());
  const auto codec = Codec::create(spec, DType::kFloat32);
  std::vector<uint8_t> payload(codec->encoded_bytes(x.size()));
  const EncodeReport report = codec->encode(o.noise, Slice{x.data(), x.size(), 0}, nullptr, payload);
  if (report.nonfinite_buckets)
    fprintf(stderr, "lgreco-codec: warning: %s: %llu bucket(s) hold NaN or Inf and decode to NaN\n",
            o.positional[0].c_str(), static_cast<unsigned long long>(report.nonfinite_buckets));
  const std::vector<uint8_t> file = serialize_lgc(LgcHeader{spec, DType::kFloat32, x.size(), o.noise}, payload);
  cli::write_file(o.positional[1], file.data(), file.size());
  return 0;
}

int cmd_decode(const Options& o) {
  expect_positional(o, 2, "IN.lgc OUT.f32");
  if (!o.specs.empty()) throw cli::UsageError("decode takes the codec from the file; --codec is not allowed");
  const LgcFile f = parse_lgc(cli::read_file(o.positional[0]), o.positional[0]);
  std::vector<float> y(f.header.count);
  Codec::create(f.header.spec, f.header.dtype)->decode(f.payload, f.header.count, DType::kFloat32, y.data());
  cli::write_file(o.positional[1], y.data(), y.size() * sizeof(float));
  return 0;
}

int cmd_stats(const Options& o) {
  expect_positional(o, 1, "IN.f32");
  if (o.specs.empty()) throw cli::UsageError("stats needs at least one --codec");
  std::vector<CodecSpec> specs;
  for (const std::string& s : o.specs) specs.push_back(parse_spec(s, o));
  const std::vector<float> x = cli::read_f32(o.positional[0]);
  if (x.size() > kMaxLayerElements) throw std::runtime_error(o.positional[0] + ": more than 2^34 values");
  check_shape(o, x.size());
  const CandidateReport report =
      measure_candidates(specs, DType::kFloat32, Slice{x.data(), x.size(), 0}, nullptr, o.noise);
  double norm2 = 0.0;
  for (float v : x) norm2 += double(v) * v;
  printf("# %s: %zu float32 values, %zu bytes, ||x|| = %.6e\n", o.positional[0].c_str(), x.size(), x.size() * 4,
         std::sqrt(norm2));
  printf("# spec bytes l2_error rel_error\n");
  for (size_t i = 0; i < specs.size(); ++i) {
    const CandidateError& c = report.candidates[i];
    const double l2 = std::sqrt(c.squared_error);
    printf("%s %llu %.6e %.6e\n", specs[i].str().c_str(), static_cast<unsigned long long>(c.bytes), l2,
           norm2 > 0 ? l2 / std::sqrt(norm2) : 0.0);
  }
  if (report.nonfinite_buckets)
    fprintf(stderr, "lgreco-codec: warning: %s: %llu bucket(s) hold NaN or Inf: their errors are infinite\n",
            o.positional[0].c_str(), static_cast<unsigned long long>(report.nonfinite_buckets));
  return 0;
}

int cmd_info(const Options& o) {
  expect_positional(o, 1, "IN.lgc");
  const std::vector<uint8_t> bytes = cli::read_file(o.positional[0]);
  const LgcFile f = parse_lgc(bytes, o.positional[0]);
  const LgcHeader& h = f.header;
  printf("codec %s\ndtype %s\ncount %llu\npayload_bytes %zu\nfile_bytes %zu\nseed %llu\nrank %u\nstep %llu\nlayer %u\n",
         h.spec.str().c_str(), dtype_name(h.dtype), static_cast<unsigned long long>(h.count), f.payload.size(),
         bytes.size(), static_cast<unsigned long long>(h.noise.seed), h.noise.rank,
         static_cast<unsigned long long>(h.noise.step), h.noise.layer);
  return 0;
}

int run(int argc, char** argv) {
  if (argc < 2) throw cli::UsageError("missing command");
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    fputs(kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    printf("lgreco-codec %s\n", version_string());
    return 0;
  }
  for (int i = 2; i < argc; ++i)
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      fputs(kUsage, stdout);
      return 0;
    }
  if (command == "encode") return cmd_encode(parse_options(argc, argv, 2, true, true));
  if (command == "decode") return cmd_decode(parse_options(argc, argv, 2, false, false));
  if (command == "stats") return cmd_stats(parse_options(argc, argv, 2, false, true));
  if (command == "info") return cmd_info(parse_options(argc, argv, 2, false, false));
  throw cli::UsageError("unknown command '" + command + "'");
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-codec", [&] { return lgreco::run(argc, argv); });
}
