// The host side of PowerSGD's CUDA module (kernels/lowrank_cuda.h,
// kernels/lowrank_cuda_plan.h): scratch sizes, launch tables and the argument checks that
// run before anything is enqueued. No GPU needed: the checks throw before any CUDA call,
// and nothing here dereferences the (host) stand-ins for device pointers. In a build
// without CUDA, valid calls end in CudaError naming the missing kernels.
#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/lowrank.h"
#include "kernels/lowrank_cuda.h"
#include "kernels/lowrank_cuda_plan.h"
#include "test_util.h"

using namespace lgreco;
using namespace lgreco::lowrank::cuda;

namespace {

// Stand-ins for device memory: aligned, never read.
alignas(256) float g_input[4096];
alignas(256) float g_residual[4096];
alignas(256) float g_p[4096];
alignas(256) float g_q[4096];
alignas(256) float g_q0[4096];
alignas(256) unsigned char g_scratch[1 << 16];
alignas(256) double g_squared[64];
alignas(256) uint8_t g_flags[64];

Layer layer(uint32_t index, uint64_t offset, uint64_t rows, uint64_t cols, uint32_t rank, uint64_t p_offset = 0,
            uint64_t q_offset = 0) {
  return Layer{index, offset, rows, cols, rank, p_offset, q_offset};
}

uint64_t up256(uint64_t n) { return (n + 255) / 256 * 256; }

// The CodecError message of fn, or "" (failing the test) when it throws nothing or another type.
std::string codec_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CodecError& e) {
    return e.what();
  } catch (const std::exception& e) {
    BOOST_ERROR("expected CodecError, got: " << e.what());
    return "";
  }
  BOOST_ERROR("expected CodecError, nothing was thrown");
  return "";
}

void expect_codec_error(const std::function<void()>& fn, const std::string& part) {
  const std::string message = codec_error(fn);
  BOOST_TEST_CONTEXT("message: " << message) {
    BOOST_TEST(test::contains(message, part));
    BOOST_TEST(test::contains(message, "powersgd cuda "));
  }
}

Source f32_source(bool residual) {
  Source s;
  s.input = g_input;
  s.residual = residual ? g_residual : nullptr;
  return s;
}

Scratch big_scratch() { return Scratch{g_scratch, sizeof g_scratch}; }

// What cublasSgemm computes (column-major BLAS semantics, alpha 1, beta 0), with the sums
// in float64 in order of the inner index, as the CPU reference sums: C = op(A) op(B).
void blas_gemm(const plan::Gemm& g, const float* a, const float* b, float* c) {
  for (int j = 0; j < g.n; ++j)
    for (int i = 0; i < g.m; ++i) {
      double sum = 0;
      for (int l = 0; l < g.k; ++l) {
        const float x = g.transpose_a ? a[l + static_cast<size_t>(i) * g.lda] : a[i + static_cast<size_t>(l) * g.lda];
        const float y = g.transpose_b ? b[j + static_cast<size_t>(l) * g.ldb] : b[l + static_cast<size_t>(j) * g.ldb];
        sum += double(x) * double(y);
      }
      c[i + static_cast<size_t>(j) * g.ldc] = static_cast<float>(sum);
    }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(lowrank_cuda_host)

BOOST_AUTO_TEST_CASE(scratch_is_the_larger_of_staging_and_gram_schmidt) {
  const std::vector<Layer> layers{layer(0, 0, 3, 5, 2), layer(1, 15, 100, 7, 4), layer(2, 715, 40, 40, 1)};
  // Gram-Schmidt: 8 rows rank per layer, each rounded up to 256.
  const uint64_t gs = up256(8 * 3 * 2) + up256(8 * 100 * 4) + up256(8 * 40 * 1);
  BOOST_TEST(gs == 256u + 3328u + 512u);
  BOOST_TEST(scratch_bytes(layers, DType::kFloat32, false) == gs);
  // Staging (4 x the largest layer: 1600 elements) only for a residual or a 16-bit input.
  BOOST_TEST(scratch_bytes(layers, DType::kFloat32, true) == std::max(gs, up256(4 * 1600)));
  BOOST_TEST(scratch_bytes(layers, DType::kBFloat16, false) == std::max(gs, up256(4 * 1600)));
  const std::vector<Layer> wide{layer(0, 0, 1000, 1000, 1)};
  BOOST_TEST(scratch_bytes(wide, DType::kFloat16, true) == 4'000'000u);
  BOOST_TEST(scratch_bytes(wide, DType::kFloat32, false) == up256(8000));
  BOOST_TEST(scratch_bytes({}, DType::kFloat16, true) == 0u);
  expect_codec_error([] { (void)scratch_bytes(std::vector<Layer>{layer(0, 0, 0, 5, 1)}, DType::kFloat32, false); },
                     "at least 1");
}

BOOST_AUTO_TEST_CASE(measure_scratch_is_the_largest_layer) {
  const Layer a = layer(0, 0, 30, 50, 1), b = layer(1, 1500, 200, 3, 1);
  const uint32_t r = 8;
  auto bytes = [&](const Layer& l, bool staged) {
    return (staged ? up256(4 * l.rows * l.cols) : 0) + up256(4 * l.cols * r) + up256(4 * l.rows * r) +
           up256(4 * l.cols * r) + up256(8 * l.rows * r) + up256(8 * 1024) + up256(4 * 1024);
  };
  const std::vector<Layer> layers{a, b};
  BOOST_TEST(measure_scratch_bytes(layers, r, DType::kFloat32, false) == std::max(bytes(a, false), bytes(b, false)));
  BOOST_TEST(measure_scratch_bytes(layers, r, DType::kFloat32, true) == std::max(bytes(a, true), bytes(b, true)));
  BOOST_TEST(measure_scratch_bytes(layers, r, DType::kFloat16, false) == std::max(bytes(a, true), bytes(b, true)));
  const plan::MeasureLayout x = plan::measure_layout(a, r, true);
  BOOST_TEST(x.m == 0u);
  BOOST_TEST(x.basis == up256(4 * 1500));
  BOOST_TEST(x.p == x.basis + up256(4 * 50 * r));
  BOOST_TEST(x.b == x.p + up256(4 * 30 * r));
  BOOST_TEST(x.work == x.b + up256(4 * 50 * r));
  BOOST_TEST(x.partial == x.work + up256(8 * 30 * r));
  BOOST_TEST(x.flags == x.partial + 8u * 1024);
  BOOST_TEST(x.bytes == x.flags + 4u * 1024);
  for (uint64_t offset : {x.basis, x.p, x.b, x.work, x.partial, x.flags}) BOOST_TEST(offset % 256 == 0u);
  expect_codec_error([&] { (void)measure_scratch_bytes(layers, 0, DType::kFloat32, false); }, "outside 1..256");
  expect_codec_error([&] { (void)measure_scratch_bytes(layers, 257, DType::kFloat32, false); }, "outside 1..256");
}

BOOST_AUTO_TEST_CASE(tables_number_items_and_split_at_64_layers) {
  std::vector<Layer> layers;
  for (uint32_t i = 0; i < 130; ++i) layers.push_back(layer(i, 1000 * i, 33 + i, 65, 1 + i % 40, 7 * i, 11 * i));
  const auto tiles = plan::tables(layers, plan::Items::kTiles);
  BOOST_TEST_REQUIRE(tiles.size() == 3u);
  BOOST_TEST(tiles[0].count == 64u);
  BOOST_TEST(tiles[1].count == 64u);
  BOOST_TEST(tiles[2].count == 2u);
  uint64_t gs_bytes = 0;
  for (size_t t = 0; t < tiles.size(); ++t) {
    uint32_t items = 0;
    for (uint32_t k = 0; k < tiles[t].count; ++k) {
      const plan::TableLayer& x = tiles[t].layers[k];
      const Layer& l = layers[t * 64 + k];
      BOOST_TEST(x.item_begin == items);
      BOOST_TEST(x.tiles_x == 3u);  // 65 columns: tiles of 32
      BOOST_TEST(x.rows == l.rows);
      BOOST_TEST(x.rank == l.rank);
      BOOST_TEST(x.layer == l.layer);
      BOOST_TEST(x.offset == l.offset);
      BOOST_TEST(x.p_offset == l.p_offset);
      BOOST_TEST(x.q_offset == l.q_offset);
      // Gram-Schmidt columns are numbered across tables.
      BOOST_TEST(x.work_offset * 8 == gs_bytes);
      gs_bytes += up256(8 * l.rows * l.rank);
      items += static_cast<uint32_t>(((l.rows + 31) / 32) * 3);
    }
    BOOST_TEST(tiles[t].items == items);
  }
  const auto columns = plan::tables(layers, plan::Items::kColumns);
  BOOST_TEST(columns[0].layers[1].item_begin == layers[0].rank);
  BOOST_TEST(plan::items_of(layer(0, 0, 5, 300, 3), plan::Items::kQ0Blocks) == 4u);  // 900 / 256, rounded up
  BOOST_TEST(plan::items_of(layer(0, 0, 5, 300, 3), plan::Items::kLayers) == 1u);
  BOOST_TEST(plan::tables({}, plan::Items::kTiles).empty());
}

// The SGEMMs' transposes and leading dimensions: BLAS's column-major product with these
// arguments on the row-major arrays is exactly lowrank::project / back_project.
BOOST_AUTO_TEST_CASE(gemm_arguments_give_the_cpu_products) {
  std::mt19937_64 rng(test::run_seed());
  std::normal_distribution<float> normal;
  for (const auto& [rows, cols, rank] : std::vector<std::tuple<uint64_t, uint64_t, uint32_t>>{
           {1, 37, 4}, {29, 1, 3}, {7, 13, 1}, {13, 7, 5}, {16, 16, 32}, {40, 9, 2}}) {
    BOOST_TEST_CONTEXT(rows << " x " << cols << " rank " << rank << ", seed " << test::run_seed()) {
      std::vector<float> m(rows * cols), q(cols * rank), p(rows * rank);
      for (float& v : m) v = normal(rng);
      for (float& v : q) v = normal(rng);
      for (float& v : p) v = normal(rng);
      const plan::Gemm g1 = plan::project_gemm(rows, cols, rank);
      BOOST_TEST(g1.m == static_cast<int>(rank));
      BOOST_TEST(g1.n == static_cast<int>(rows));
      BOOST_TEST(g1.k == static_cast<int>(cols));
      std::vector<float> p_gemm(rows * rank), p_ref(rows * rank);
      blas_gemm(g1, q.data(), m.data(), p_gemm.data());  // A = Q, B = M, C = P
      lowrank::project(m.data(), {rows, cols}, q.data(), rank, p_ref.data());
      BOOST_TEST(std::memcmp(p_gemm.data(), p_ref.data(), 4 * p_ref.size()) == 0);
      const plan::Gemm g2 = plan::back_project_gemm(rows, cols, rank);
      std::vector<float> q_gemm(cols * rank), q_ref(cols * rank);
      blas_gemm(g2, p.data(), m.data(), q_gemm.data());  // A = P, B = M, C = Q
      lowrank::back_project(m.data(), {rows, cols}, p.data(), rank, q_ref.data());
      BOOST_TEST(std::memcmp(q_gemm.data(), q_ref.data(), 4 * q_ref.size()) == 0);
      // BLAS's own rules: ld >= the stored matrix's rows.
      BOOST_TEST(g1.lda >= g1.m);
      BOOST_TEST(g1.ldb >= g1.k);
      BOOST_TEST(g1.ldc >= g1.m);
      BOOST_TEST(g2.lda >= g2.m);
      BOOST_TEST(g2.ldb >= g2.n);  // B transposed: stored n x k
      BOOST_TEST(g2.ldc >= g2.m);
    }
  }
}

BOOST_AUTO_TEST_CASE(sum_blocks_grow_with_the_layer_up_to_1024) {
  BOOST_TEST(plan::sum_blocks(1) == 1u);
  BOOST_TEST(plan::sum_blocks(4096) == 1u);
  BOOST_TEST(plan::sum_blocks(4097) == 2u);
  BOOST_TEST(plan::sum_blocks(uint64_t{1} << 34) == 1024u);
}

BOOST_AUTO_TEST_CASE(layers_are_checked_before_anything_else) {
  Handle empty;
  const Source s = f32_source(false);
  auto project_one = [&](const Layer& l) {
    project(empty, std::vector<Layer>{l}, s, g_q, g_p, big_scratch(), nullptr);
  };
  expect_codec_error([&] { project_one(layer(3, 0, 0, 5, 1)); }, "layer 0 of the batch (bucket layer 3");
  expect_codec_error([&] { project_one(layer(0, 0, 4, 0, 1)); }, "rows, cols and rank must be at least 1");
  expect_codec_error([&] { project_one(layer(0, 0, 4, 4, 0)); }, "rows, cols and rank must be at least 1");
  expect_codec_error([&] { project_one(layer(0, 0, 4, 4, 257)); }, "the rank is above 256");
  expect_codec_error([&] { project_one(layer(0, 0, uint64_t{1} << 31, 1, 1)); }, "below 2^31");
  expect_codec_error([&] { project_one(layer(0, 0, uint64_t{1} << 20, uint64_t{1} << 15, 1)); },
                     "more than 2^34 elements");
  expect_codec_error([&] { project_one(layer(0, ~uint64_t{0} - 3, 2, 2, 1)); }, "overflows 64 bits");
  // The second layer of a batch is named as such.
  expect_codec_error(
      [&] {
        orthonormalize(std::vector<Layer>{layer(0, 0, 2, 2, 1), layer(9, 4, 2, 2, 300)}, g_p, big_scratch(), nullptr);
      },
      "layer 1 of the batch (bucket layer 9");
}

BOOST_AUTO_TEST_CASE(no_layers_is_nothing_to_do) {
  Handle empty;
  const std::vector<Layer> none;
  project(empty, none, Source{}, nullptr, nullptr, Scratch{}, nullptr);
  orthonormalize(none, nullptr, Scratch{}, nullptr);
  back_project(empty, none, Source{}, nullptr, nullptr, Scratch{}, nullptr);
  reconstruct(none, nullptr, nullptr, 1.0f, Output{}, nullptr);
  keep(none, nullptr, nullptr, nullptr, nullptr);
  initial_q(none, 1, 2, 3, nullptr, nullptr);
  squared_errors(empty, none, Source{}, Measure{}, Scratch{}, nullptr);
  // Layers, none of them measured.
  const uint32_t ranks[] = {4}, columns[] = {0};
  const uint8_t measured[] = {0, 0};
  Measure m;
  m.ranks = ranks;
  m.columns = columns;
  m.row_stride = 1;
  m.measured = measured;
  m.squared = g_squared;
  m.nonfinite = g_flags;
  squared_errors(empty, std::vector<Layer>{layer(1, 0, 4, 4, 1)}, Source{}, m, Scratch{}, nullptr);
}

BOOST_AUTO_TEST_CASE(sources_factors_and_scratch_are_checked) {
  Handle empty;
  const std::vector<Layer> layers{layer(0, 100, 8, 16, 4), layer(1, 300, 16, 8, 2, 32, 64)};
  const uint64_t need = scratch_bytes(layers, DType::kFloat32, true);
  const Scratch enough{g_scratch, need};
  auto project_with = [&](Source s, const float* q, float* p, Scratch scratch) {
    project(empty, layers, s, q, p, scratch, nullptr);
  };
  Source s = f32_source(true);
  expect_codec_error([&] { Source x = s; x.input = nullptr; project_with(x, g_q, g_p, enough); },
                     "the input must not be null");
  expect_codec_error([&] { Source x = s; x.input_dtype = static_cast<DType>(7); project_with(x, g_q, g_p, enough); },
                     "invalid input element type");
  expect_codec_error(
      [&] {
        Source x = s;
        x.input = reinterpret_cast<const char*>(g_input) + 2;  // 2-byte aligned: fine for bfloat16, not float32
        project_with(x, g_q, g_p, enough);
      },
      "not aligned to its element size");
  {
    Source x = s;
    x.input = reinterpret_cast<const char*>(g_input) + 2;
    x.input_dtype = DType::kBFloat16;
    // Passes the source checks; stops at the Handle (the last check).
    expect_codec_error([&] { project_with(x, g_q, g_p, Scratch{g_scratch, scratch_bytes(layers, DType::kBFloat16, true)}); },
                       "an empty Handle");
  }
  expect_codec_error(
      [&] { Source x = s; x.residual = reinterpret_cast<float*>(reinterpret_cast<char*>(g_residual) + 2); project_with(x, g_q, g_p, enough); },
      "the residual is not 4-byte aligned");
  expect_codec_error([&] { Source x = s; x.input_first = 101; project_with(x, g_q, g_p, enough); },
                     "starts at call element 100, before the input's first element 101");
  expect_codec_error([&] { Source x = s; x.residual_first = 300; project_with(x, g_q, g_p, enough); },
                     "before the residual's first element 300");
  {
    Source x = s;
    x.residual = nullptr;
    x.residual_first = 300;  // no residual: its first element does not matter
    expect_codec_error([&] { project_with(x, g_q, g_p, enough); }, "an empty Handle");
  }
  expect_codec_error([&] { project_with(s, nullptr, g_p, enough); }, "q must not be null");
  expect_codec_error([&] { project_with(s, g_q, nullptr, enough); }, "p must not be null");
  expect_codec_error([&] { project_with(s, g_q + 1, reinterpret_cast<float*>(reinterpret_cast<char*>(g_p) + 1), enough); },
                     "p is not 4-byte aligned");
  expect_codec_error([&] { project_with(s, g_q, g_p, Scratch{g_scratch, need - 1}); },
                     "a scratch of " + std::to_string(need - 1) + " bytes, needs " + std::to_string(need));
  expect_codec_error([&] { project_with(s, g_q, g_p, Scratch{nullptr, need}); }, "the scratch is null");
  expect_codec_error([&] { project_with(s, g_q, g_p, Scratch{g_scratch + 64, need}); }, "not 256-byte aligned");
  expect_codec_error([&] { project_with(s, g_q, g_p, enough); }, "an empty Handle (make one with Handle::create)");
  // back_project: the same checks, its own name.
  const std::string m = codec_error([&] { back_project(empty, layers, s, g_p, g_q, Scratch{g_scratch, need - 1}, nullptr); });
  BOOST_TEST(test::contains(m, "powersgd cuda back_project: a scratch of"));
  expect_codec_error([&] { back_project(empty, layers, s, g_p, g_q, enough, nullptr); }, "an empty Handle");
  // orthonormalize needs only the Gram-Schmidt part.
  const uint64_t gs = scratch_bytes(layers, DType::kFloat32, false);
  expect_codec_error([&] { orthonormalize(layers, g_p, Scratch{g_scratch, gs - 1}, nullptr); }, "needs " + std::to_string(gs));
}

BOOST_AUTO_TEST_CASE(outputs_keep_and_q0_are_checked) {
  const std::vector<Layer> layers{layer(0, 100, 8, 16, 4)};
  expect_codec_error([&] { reconstruct(layers, g_p, g_q, 1.0f, Output{}, nullptr); }, "the output must not be null");
  expect_codec_error([&] { reconstruct(layers, g_p, g_q, 1.0f, Output{g_input, static_cast<DType>(3), 0}, nullptr); },
                     "invalid output element type");
  expect_codec_error(
      [&] { reconstruct(layers, g_p, g_q, 1.0f, Output{reinterpret_cast<char*>(g_input) + 1, DType::kFloat16, 0}, nullptr); },
      "the output is not aligned");
  expect_codec_error([&] { reconstruct(layers, g_p, g_q, 1.0f, Output{g_input, DType::kFloat32, 101}, nullptr); },
                     "before the output's first element 101");
  expect_codec_error([&] { reconstruct(layers, nullptr, g_q, 1.0f, Output{g_input, DType::kFloat32, 0}, nullptr); },
                     "p must not be null");
  expect_codec_error([&] { keep(layers, g_q, g_q0, g_q, nullptr); }, "q must not be q_new or q0");
  expect_codec_error([&] { keep(layers, g_q, nullptr, g_p, nullptr); }, "q0 must not be null");
  expect_codec_error([&] { initial_q(layers, 1, 2, 3, nullptr, nullptr); }, "q0 must not be null");
  expect_codec_error([&] { (void)Handle::create(nullptr, kWorkspaceBytes); }, "workspace");
  expect_codec_error([&] { (void)Handle::create(g_scratch, 0); }, "workspace");
  expect_codec_error([&] { (void)Handle::create(g_scratch + 16, 4096); }, "not 256-byte aligned");
}

BOOST_AUTO_TEST_CASE(statistics_arguments_are_checked) {
  Handle empty;
  const std::vector<Layer> layers{layer(0, 0, 8, 16, 1), layer(2, 128, 16, 8, 1)};
  const uint32_t ranks[] = {1, 4, 8}, columns[] = {0, 2, 3};
  Measure m;
  m.ranks = ranks;
  m.columns = columns;
  m.row_stride = 4;
  m.squared = g_squared;
  m.nonfinite = g_flags;
  const Source s = f32_source(true);
  const Scratch enough = big_scratch();
  auto run = [&](const Measure& x, const Source& src, const Scratch& scratch) {
    squared_errors(empty, layers, src, x, scratch, nullptr);
  };
  expect_codec_error([&] { run(m, s, enough); }, "squared_errors: an empty Handle");
  expect_codec_error([&] { Measure x = m; x.ranks = {}; x.columns = {}; run(x, s, enough); }, "0 ranks");
  expect_codec_error([&] { Measure x = m; x.columns = std::span<const uint32_t>(columns, 2); run(x, s, enough); },
                     "3 ranks but 2 columns");
  expect_codec_error([&] { Measure x = m; x.row_stride = 3; run(x, s, enough); }, "column 3 is not below the row stride 3");
  const uint32_t bad_rank[] = {1, 0, 8};
  expect_codec_error([&] { Measure x = m; x.ranks = bad_rank; run(x, s, enough); }, "rank 0 is outside 1..256");
  const uint32_t big_rank[] = {1, 257, 8};
  expect_codec_error([&] { Measure x = m; x.ranks = big_rank; run(x, s, enough); }, "rank 257 is outside 1..256");
  std::vector<uint32_t> many(kMaxMeasureRanks + 1, 1), many_columns(kMaxMeasureRanks + 1, 0);
  expect_codec_error([&] { Measure x = m; x.ranks = many; x.columns = many_columns; run(x, s, enough); },
                     "33 ranks; 1 to 32 are measured");
  expect_codec_error([&] { Measure x = m; x.squared = nullptr; run(x, s, enough); }, "squared must not be null");
  expect_codec_error([&] { Measure x = m; x.nonfinite = nullptr; run(x, s, enough); }, "nonfinite must not be null");
  const uint8_t short_mask[] = {1, 1};
  expect_codec_error([&] { Measure x = m; x.measured = short_mask; run(x, s, enough); },
                     "beyond the 2 entries of `measured`");
  expect_codec_error([&] { Source x = s; x.flags = g_flags; run(m, x, enough); }, "flags must be null");
  // The scratch: for R = 8 over the measured layers only.
  const uint64_t both = measure_scratch_bytes(layers, 8, DType::kFloat32, true);
  expect_codec_error([&] { run(m, s, Scratch{g_scratch, both - 1}); }, "needs " + std::to_string(both));
  const uint8_t only_first[] = {1, 0, 0};
  const uint64_t first = measure_scratch_bytes(std::vector<Layer>{layers[0]}, 8, DType::kFloat32, true);
  BOOST_TEST(first < both);
  Measure x = m;
  x.measured = only_first;
  expect_codec_error([&] { run(x, s, Scratch{g_scratch, first}); }, "an empty Handle");
  expect_codec_error([&] { run(x, s, Scratch{g_scratch, first - 1}); }, "needs " + std::to_string(first));
}

BOOST_AUTO_TEST_CASE(without_cuda_valid_calls_say_so) {
  if (available()) return;  // a CUDA build: valid calls would launch (tests/gpu/lowrank_cuda_check.cc)
  const std::vector<Layer> layers{layer(0, 0, 8, 16, 4)};
  auto cuda_error = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const CudaError& e) {
      return e.what();
    }
    return "";
  };
  for (const std::string& m :
       {cuda_error([&] { orthonormalize(layers, g_p, big_scratch(), nullptr); }),
        cuda_error([&] { reconstruct(layers, g_p, g_q, 1.0f, Output{g_input, DType::kFloat32, 0}, nullptr); }),
        cuda_error([&] { keep(layers, g_q, g_q0, g_p, nullptr); }),
        cuda_error([&] { initial_q(layers, 1, 2, 3, g_q0, nullptr); }),
        cuda_error([&] { (void)Handle::create(g_scratch, sizeof g_scratch); })}) {
    BOOST_TEST_CONTEXT("message: " << m) { BOOST_TEST(test::contains(m, "no CUDA kernels")); }
  }
  // The CUDA backend asks this before offering PowerSGD (plugin/shim/cuda_backend.h).
  BOOST_TEST(test::contains(cublas_problem(), "no CUDA kernels"), cublas_problem());
}

// In a CUDA build, cublas_problem() is "" exactly when Handle::create can get past loading
// cuBLAS: a failure to load must name what was tried, not pass silently.
BOOST_AUTO_TEST_CASE(cublas_problem_names_what_could_not_be_loaded) {
  if (!available()) return;  // the build without CUDA: the case above
  const std::string why = cublas_problem();
  BOOST_TEST_INFO("cublas_problem(): " << why);
  BOOST_TEST((why.empty() || test::contains(why, "libcublas.so") || test::contains(why, "has no ")));
  BOOST_TEST(cublas_problem() == why);  // loaded once per process, the answer does not change
}

BOOST_AUTO_TEST_SUITE_END()
