// The controller driven by the real codec, as the engine will drive it: two ranks, error
// feedback, candidate errors from measure_candidates() on the corrected gradient, sums
// across ranks, and encoding with whatever assignment is in effect.
#include <boost/test/unit_test.hpp>
#include <random>
#include <vector>

#include "controller/controller.h"
#include "kernels/codec.h"
#include "tests/unit/test_util.h"

namespace lgreco {
namespace {

BOOST_AUTO_TEST_SUITE(controller_codec)

BOOST_AUTO_TEST_CASE(adaptive_assignment_sends_fewer_bytes_within_the_default_error) {
  const uint64_t seed = test::run_seed();
  BOOST_TEST_CONTEXT("LGRECO_TEST_SEED=" << seed) {
    std::mt19937_64 rng(seed);
    const std::vector<uint64_t> sizes = {2048, 4096, 8192, 16384, 32768, 65536};
    const std::vector<double> scales = {1e-4, 3e-3, 1e-2, 1e-3, 3e-4, 1e-1};  // layers differ, as real ones do
    std::vector<CodecSpec> specs;
    std::vector<controller::Layer> layers;
    for (int b = 2; b <= 8; ++b) specs.push_back(CodecSpec::parse("quant:bits=" + std::to_string(b)));
    for (size_t l = 0; l < sizes.size(); ++l) {
      controller::Layer layer{"layer" + std::to_string(l), sizes[l], 2, {}};
      for (const CodecSpec& spec : specs)
        layer.candidates.push_back({spec.str(), Codec::create(spec, DType::kFloat32)->encoded_bytes(sizes[l]), 0});
      layers.push_back(std::move(layer));
    }
    controller::ControllerSettings settings;
    settings.schedule = {4, 6, 2, 2};
    constexpr int kRanks = 2;
    std::vector<std::unique_ptr<controller::Controller>> ranks;
    std::vector<controller::ErrorStats> local;
    std::vector<std::vector<std::vector<float>>> residual(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      ranks.push_back(std::make_unique<controller::Controller>(settings, layers));
      local.push_back(ranks.back()->new_stats());
      for (uint64_t n : sizes) residual[r].emplace_back(n, 0.0f);
    }
    const uint64_t default_bytes = [&] {
      uint64_t b = 0;
      for (const auto& l : layers) b += l.candidates[l.default_index].bytes;
      return b;
    }();

    std::vector<uint8_t> encoded;
    bool switched = false;
    for (uint64_t step = 0; step < 16; ++step) {
      for (int r = 0; r < kRanks; ++r) {
        const auto assignment = ranks[r]->assignment_for_step(step);
        BOOST_TEST(assignment->choices == ranks[0]->assignment_for_step(step)->choices);
        uint64_t step_bytes = 0;
        for (size_t l = 0; l < layers.size(); ++l) {
          std::vector<float> g = test::draw(test::Dist::kMixedScales, sizes[l], rng, 1024);
          for (float& v : g) v = static_cast<float>(v * scales[l]);
          const Slice slice{g.data(), sizes[l], 0};
          if (ranks[r]->schedule().measures(step)) {
            const CandidateReport report = measure_candidates(specs, DType::kFloat32, slice, residual[r][l].data());
            std::vector<double> e;
            for (const auto& c : report.candidates) e.push_back(c.squared_error);
            BOOST_TEST(local[r].add(l, e));
          }
          const CodecSpec chosen = CodecSpec::parse(layers[l].candidates[assignment->choices[l]].codec);
          const auto codec = Codec::create(chosen, DType::kFloat32);
          encoded.resize(codec->encoded_bytes(sizes[l]));
          codec->encode(NoiseKey{seed, static_cast<uint32_t>(r), step, static_cast<uint32_t>(l)}, slice,
                        residual[r][l].data(), encoded);
          step_bytes += encoded.size();
        }
        if (assignment->epoch > 0) {
          switched = true;
          BOOST_TEST(step_bytes < default_bytes);
          BOOST_TEST(assignment->solution.feasible);
          BOOST_TEST(assignment->solution.error <= assignment->solution.budget);
        } else {
          BOOST_TEST(step_bytes == default_bytes);
        }
      }
      if (ranks[0]->schedule().window_ends(step)) {
        controller::ErrorStats sum = ranks[0]->new_stats();
        for (const auto& l : local) sum.merge(l);
        BOOST_TEST(sum.samples(0) == kRanks * settings.schedule.window);
        for (auto& c : ranks) c->submit(step, sum);
        for (auto& l : local) l.clear();
      }
    }
    BOOST_TEST(switched);
  }
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco
