// lgreco-quant-demo: the quantization codec on the layer shapes of a real model.
//
// For every bit width it reports what a whole model's gradient would cost on the wire
// and what error it would carry, using the same rule for small and 1-D tensors as the
// library (kept in float32). The gradients are synthetic (heavy-tailed, with per-row
// scales that differ across rows and layers as real gradients do), so the numbers show
// the codec's behaviour, not a training result. It ends with what the L-GreCo search
// makes of these errors: per-layer bit widths at the uniform 4-bit total error. The engine
// issue replaces this demo with compressed allreduce across ranks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "config/version.h"
#include "controller/solver.h"
#include "kernels/codec.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-quant-demo [--model resnet50|gpt2] [--scale S] [--seed N]

Runs the max-min quantization codec over every parameter tensor of a model (layer shapes
of torchvision's resnet50 or of GPT-2 small) with synthetic heavy-tailed gradients, and
prints, per bit width 2..8, the bytes sent, the compression ratio and the error. Tensors
with one dimension or fewer than 1024 elements stay float32, as in the library. Then
runs the L-GreCo search (lgreco-solve's) on the measured errors: one bit width per
layer, total error within that of uniform 4 bits, fewest bytes.

  --model M   resnet50 (default, 25.6 M parameters) or gpt2 (124.4 M)
  --scale S   use a fraction S in (0, 1] of each tensor's elements (default 1)
  --seed N    seed of the synthetic gradients and the rounding noise (default 1)
)";

struct Tensor {
  std::string name;
  std::vector<uint64_t> shape;
  uint64_t numel() const { return std::accumulate(shape.begin(), shape.end(), uint64_t{1}, std::multiplies<>()); }
};

void add(std::vector<Tensor>& t, std::string name, std::vector<uint64_t> shape) {
  t.push_back(Tensor{std::move(name), std::move(shape)});
}

void add_batchnorm(std::vector<Tensor>& t, const std::string& name, uint64_t c) {
  add(t, name + ".weight", {c});
  add(t, name + ".bias", {c});
}

// torchvision.models.resnet50: 161 parameter tensors, 25,557,032 parameters.
std::vector<Tensor> resnet50() {
  std::vector<Tensor> t;
  add(t, "conv1.weight", {64, 3, 7, 7});
  add_batchnorm(t, "bn1", 64);
  uint64_t in = 64;
  const uint64_t widths[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  for (int s = 0; s < 4; ++s) {
    const uint64_t w = widths[s], out = 4 * w;
    for (uint64_t b = 0; b < blocks[s]; ++b) {
      const std::string p = "layer" + std::to_string(s + 1) + "." + std::to_string(b);
      add(t, p + ".conv1.weight", {w, in, 1, 1});
      add_batchnorm(t, p + ".bn1", w);
      add(t, p + ".conv2.weight", {w, w, 3, 3});
      add_batchnorm(t, p + ".bn2", w);
      add(t, p + ".conv3.weight", {out, w, 1, 1});
      add_batchnorm(t, p + ".bn3", out);
      if (b == 0) {
        add(t, p + ".downsample.0.weight", {out, in, 1, 1});
        add_batchnorm(t, p + ".downsample.1", out);
      }
      in = out;
    }
  }
  add(t, "fc.weight", {1000, 2048});
  add(t, "fc.bias", {1000});
  return t;
}

// GPT-2 small (Hugging Face layout, tied output embedding): 148 tensors, 124,439,808 parameters.
std::vector<Tensor> gpt2() {
  std::vector<Tensor> t;
  const uint64_t d = 768;
  add(t, "wte.weight", {50257, d});
  add(t, "wpe.weight", {1024, d});
  for (int l = 0; l < 12; ++l) {
    const std::string p = "h." + std::to_string(l);
    add(t, p + ".ln_1.weight", {d});
    add(t, p + ".ln_1.bias", {d});
    add(t, p + ".attn.c_attn.weight", {d, 3 * d});
    add(t, p + ".attn.c_attn.bias", {3 * d});
    add(t, p + ".attn.c_proj.weight", {d, d});
    add(t, p + ".attn.c_proj.bias", {d});
    add(t, p + ".ln_2.weight", {d});
    add(t, p + ".ln_2.bias", {d});
    add(t, p + ".mlp.c_fc.weight", {d, 4 * d});
    add(t, p + ".mlp.c_fc.bias", {4 * d});
    add(t, p + ".mlp.c_proj.weight", {4 * d, d});
    add(t, p + ".mlp.c_proj.bias", {d});
  }
  add(t, "ln_f.weight", {d});
  add(t, "ln_f.bias", {d});
  return t;
}

// Synthetic gradient of one tensor: a Gaussian scale mixture (heavy tails, heavier in
// some layers than others), rows with log-normal scales, and a magnitude drawn per layer.
std::vector<float> synthetic_gradient(const Tensor& t, uint64_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> exponent(-4.0, -2.0), tail(0.1, 1.2);
  const double layer_scale = std::pow(10.0, exponent(rng));
  const double tail_sigma = tail(rng);
  const uint64_t row = std::max<uint64_t>(1, t.numel() / t.shape[0]);
  std::vector<float> g(n);
  double row_scale = layer_scale;
  for (uint64_t i = 0; i < n; ++i) {
    if (i % row == 0) row_scale = layer_scale * std::exp(0.75 * normal(rng));
    g[i] = static_cast<float>(row_scale * normal(rng) * std::exp(tail_sigma * normal(rng)));
  }
  return g;
}

bool stays_uncompressed(const Tensor& t) { return t.shape.size() <= 1 || t.numel() < 1024; }

std::string shape_text(const Tensor& t) {
  std::string s;
  for (uint64_t d : t.shape) {
    if (!s.empty()) s.push_back('x');
    s.append(std::to_string(d));
  }
  return s;
}

using cli::thousands;

// The L-GreCo search on the measured candidates, for both error metrics: the squared
// error (lgreco's default, additive over layers) and the L2 norm (the paper's).
void print_search(controller::Problem search, const std::vector<CodecSpec>& specs, uint64_t values) {
  printf("#\n# L-GreCo: one bit width per layer, fewest bytes with the total error at most uniform 4 bits\n");
  printf("%-10s %14s %8s %11s %12s %12s %9s  %s\n", "metric", "bytes_sent", "vs_4bit", "bits/value", "total_error",
         "budget", "solve_ms", "layers at 2..8 bits");
  for (const char* metric : {"squared", "l2"}) {
    controller::Problem p = search;
    if (std::string(metric) == "l2")
      for (auto& layer : p.layers)
        for (auto& c : layer.candidates) c.error = std::sqrt(c.error);
    const double start = cli::seconds_now();
    const controller::Solution s = controller::solve(p);
    const double ms = (cli::seconds_now() - start) * 1e3;
    std::vector<int> histogram(specs.size(), 0);
    for (size_t l = 0; l < p.layers.size(); ++l)
      if (p.layers[l].candidates.size() > 1) ++histogram[s.choices[l]];
    std::string hist;
    for (int h : histogram) hist += (hist.empty() ? "" : " ") + std::to_string(h);
    printf("%-10s %14s %8.4f %11.3f %12.4e %12.4e %9.2f  %s\n", metric, thousands(s.bytes).c_str(),
           static_cast<double>(s.bytes) / static_cast<double>(s.default_bytes), 8.0 * s.bytes / values, s.error,
           s.budget, ms, hist.c_str());
  }
  printf("# vs_4bit: bytes relative to uniform 4 bits (the default), at no more total error.\n");
}

int run(int argc, char** argv) {
  std::string model = "resnet50";
  double scale = 1.0;
  uint64_t seed = 1;
  for (cli::Args args(argc, argv, 1); args.next();) {
    const std::string& arg = args.arg();
    const auto value = [&] { return args.value(); };
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--model") {
      model = value();
    } else if (arg == "--scale") {
      const std::string v = value();
      char* end = nullptr;
      scale = strtod(v.c_str(), &end);
      if (*end != '\0' || !(scale > 0.0 && scale <= 1.0)) throw cli::UsageError("--scale must be in (0, 1]: " + v);
    } else if (arg == "--seed") {
      seed = cli::parse_u64(arg, value());
    } else {
      throw cli::UsageError("unknown option " + arg);
    }
  }
  std::vector<Tensor> tensors;
  uint64_t expected_params = 0;
  if (model == "resnet50")
    tensors = resnet50(), expected_params = 25557032;
  else if (model == "gpt2")
    tensors = gpt2(), expected_params = 124439808;
  else
    throw cli::UsageError("unknown model '" + model + "' (resnet50 or gpt2)");
  uint64_t params = 0;
  for (const Tensor& t : tensors) params += t.numel();
  if (params != expected_params)
    throw std::logic_error("layer table of " + model + " has " + std::to_string(params) + " parameters");

  std::vector<CodecSpec> specs;
  for (int bits = 2; bits <= 8; ++bits) specs.push_back(CodecSpec::parse("quant:bits=" + std::to_string(bits)));
  const size_t nspecs = specs.size();
  const size_t four_bits = 2;  // specs[2] is bits=4

  std::mt19937_64 rng(seed);
  uint64_t kept_values = 0, compressed_values = 0, compressed_tensors = 0;
  std::vector<double> bytes(nspecs, 0), sq_error(nspecs, 0), sum_layer_l2(nspecs, 0);
  double norm2 = 0, measured_sq = 0, stats_seconds = 0, encode_seconds = 0;
  struct LayerError {
    std::string name, shape;
    double l2, rel;
  };
  std::vector<LayerError> layer_errors;
  controller::Problem search;  // the L-GreCo problem these measurements define
  const auto four = Codec::create(specs[four_bits], DType::kFloat32);
  for (size_t l = 0; l < tensors.size(); ++l) {
    const Tensor& t = tensors[l];
    const uint64_t n = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(t.numel() * scale)));
    const std::vector<float> g = synthetic_gradient(t, n, rng);
    double layer_norm2 = 0;
    for (float v : g) layer_norm2 += double(v) * v;
    norm2 += layer_norm2;
    controller::Layer& layer = search.layers.emplace_back();
    layer.name = t.name;
    layer.numel = n;
    if (stays_uncompressed(t)) {
      kept_values += n;
      for (size_t c = 0; c < nspecs; ++c) bytes[c] += 4.0 * n;
      layer.candidates.push_back({"none", 4 * n, 0.0});
      continue;
    }
    ++compressed_tensors;
    compressed_values += n;
    const Slice slice{g.data(), n, 0};
    double start = cli::seconds_now();
    const CandidateReport report = measure_candidates(specs, DType::kFloat32, slice, nullptr);
    stats_seconds += cli::seconds_now() - start;
    for (size_t c = 0; c < nspecs; ++c) {
      bytes[c] += report.candidates[c].bytes;
      sq_error[c] += report.candidates[c].squared_error;
      sum_layer_l2[c] += std::sqrt(report.candidates[c].squared_error);
      layer.candidates.push_back({specs[c].str(), report.candidates[c].bytes, report.candidates[c].squared_error});
    }
    layer.default_index = static_cast<uint32_t>(four_bits);
    const double l2 = std::sqrt(report.candidates[four_bits].squared_error);
    layer_errors.push_back({t.name, shape_text(t), l2, l2 / std::sqrt(layer_norm2)});
    // One real encode + decode at 4 bits, to set the expectation beside a measurement.
    std::vector<uint8_t> enc(four->encoded_bytes(n));
    std::vector<float> y(n);
    start = cli::seconds_now();
    four->encode(NoiseKey{seed, 0, 0, static_cast<uint32_t>(l)}, slice, nullptr, enc);
    encode_seconds += cli::seconds_now() - start;
    four->decode(enc, n, DType::kFloat32, y.data());
    for (uint64_t i = 0; i < n; ++i) measured_sq += (double(g[i]) - y[i]) * (double(g[i]) - y[i]);
  }

  const double fp32_bytes = 4.0 * (kept_values + compressed_values);
  printf("# lgreco-quant-demo, lgreco %s\n", version_string());
  printf("# model %s: %zu parameter tensors, %s parameters%s\n", model.c_str(), tensors.size(),
         thousands(params).c_str(), scale < 1 ? (" (using " + std::to_string(scale) + " of each tensor)").c_str() : "");
  printf("# gradients: synthetic; heavy tails varying by layer, per-row and per-layer scales; seed %llu\n",
         static_cast<unsigned long long>(seed));
  printf("# compressed: %llu tensors, %s values; kept float32 (1-D or < 1024 elements): %zu tensors, %s values\n",
         static_cast<unsigned long long>(compressed_tensors), thousands(compressed_values).c_str(),
         tensors.size() - compressed_tensors, thousands(kept_values).c_str());
  printf("# codec quant:bits=B,bucket=1024,rounding=stochastic; error = expected ||g - C(g)||, relative to ||g||\n");
  printf("%5s %14s %8s %11s %13s %18s\n", "bits", "bytes_sent", "ratio", "bits/value", "rel_l2_error",
         "sum_layer_l2_error");
  printf("%5s %14s %8.2f %11.3f %13s %18s\n", "fp32", thousands(static_cast<uint64_t>(fp32_bytes)).c_str(), 1.0, 32.0,
         "0", "0");
  for (size_t c = 0; c < nspecs; ++c)
    printf("%5d %14s %8.2f %11.3f %13.4e %18.4e\n", specs[c].quant_params().bits,
           thousands(static_cast<uint64_t>(bytes[c])).c_str(), fp32_bytes / bytes[c],
           8.0 * bytes[c] / (kept_values + compressed_values), std::sqrt(sq_error[c] / norm2), sum_layer_l2[c]);
  printf("#\n# 4 bits, expected relative error %.4e; one actual encode+decode (seed %llu): %.4e\n",
         std::sqrt(sq_error[four_bits] / norm2), static_cast<unsigned long long>(seed), std::sqrt(measured_sq / norm2));
  printf("# CPU time, one core: 7-candidate statistics %.0f ms, 4-bit encode %.0f ms\n", stats_seconds * 1e3,
         encode_seconds * 1e3);

  // L-GreCo budgets the sum of the layers' absolute errors, so that is what to rank by.
  std::sort(layer_errors.begin(), layer_errors.end(), [](const auto& a, const auto& b) { return a.l2 > b.l2; });
  if (layer_errors.size() >= 6) {
    const double total = sum_layer_l2[four_bits];
    printf("#\n# At 4 bits, layer errors (L2, share of the summed layer error, relative to the layer's norm):\n");
    for (size_t i = 0; i < layer_errors.size(); ++i) {
      if (i == 4) printf("#   ...\n"), i = layer_errors.size() - 2;
      const LayerError& e = layer_errors[i];
      printf("#   %-30s %-14s %.3e %6.2f%% %.3e\n", e.name.c_str(), e.shape.c_str(), e.l2, 100 * e.l2 / total, e.rel);
    }
    const auto [lo, hi] = std::minmax_element(layer_errors.begin(), layer_errors.end(),
                                              [](const auto& a, const auto& b) { return a.rel < b.rel; });
    printf("# Relative errors range over %.1fx between layers; absolute ones over %.0fx.\n", hi->rel / lo->rel,
           layer_errors.front().l2 / layer_errors.back().l2);
  }
  print_search(search, specs, kept_values + compressed_values);
  return 0;
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-quant-demo", [&] { return lgreco::run(argc, argv); });
}
