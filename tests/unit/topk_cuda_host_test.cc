// The host side of the TopK CUDA kernels (kernels/topk_cuda_plan.h, kernels/topk_cuda.h)
// that needs no GPU: launch tables, scratch layouts and sizes, and the checks that throw
// CodecError before anything is launched. The kernels themselves are tested by
// topk_cuda_emulation_test.cc (on the CPU) and tests/gpu/topk_cuda_check.cc (on a GPU).
#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/topk.h"
#include "kernels/topk_cuda.h"
#include "kernels/topk_cuda_plan.h"
#include "test_util.h"

using namespace lgreco;
namespace tc = lgreco::topk::cuda;
namespace plan = lgreco::topk::cuda::plan;

namespace {

tc::Job job(uint64_t offset, uint64_t count, uint32_t ppb = 10'000'000, uint64_t byte_offset = 0, uint32_t layer = 0) {
  tc::Job j;
  j.element_offset = offset;
  j.count = count;
  j.byte_offset = byte_offset;
  j.layer = layer;
  j.params = TopkParams{ppb};
  return j;
}

// Runs `call`, which must throw CodecError with `part` in its message.
template <class F>
void expect_error(F&& call, const std::string& part) {
  try {
    call();
    BOOST_ERROR("no CodecError; expected one saying '" << part << "'");
  } catch (const CodecError& e) {
    BOOST_TEST(test::contains(e.what(), part), e.what());
  }
}

// Fake device addresses: the checks look at alignment and null only, never at memory.
template <class T = void>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(topk_cuda_host)

BOOST_AUTO_TEST_CASE(list_capacity_is_a_32nd_of_the_count_and_at_least_a_tile) {
  BOOST_TEST(plan::list_capacity(1) == 1u);
  BOOST_TEST(plan::list_capacity(4095) == 4095u);
  BOOST_TEST(plan::list_capacity(4096) == 4096u);
  BOOST_TEST(plan::list_capacity(131072) == 4096u);
  BOOST_TEST(plan::list_capacity(131073) == 4097u);
  BOOST_TEST(plan::list_capacity(100'000'000) == 3'125'000u);
  BOOST_TEST(plan::list_capacity(4294967295u) == 134217728u);
}

BOOST_AUTO_TEST_CASE(tables_hold_64_jobs_drop_empty_ones_and_number_tiles_per_table) {
  std::vector<tc::Job> jobs;
  uint64_t offset = 0, bytes = 0;
  for (uint32_t i = 0; i < 150; ++i) {
    const uint64_t count = i % 10 == 3 ? 0 : 1 + i * 1000;  // 15 empty jobs
    jobs.push_back(job(offset, count, 1 + i * 6'000'000, bytes, i % 5));
    offset += count;
    bytes += topk::encoded_bytes(jobs.back().params, count);
  }
  const std::vector<plan::Table> tables = plan::tables(jobs, "test");
  BOOST_REQUIRE_EQUAL(tables.size(), 3u);  // 135 non-empty jobs
  BOOST_TEST(tables[0].count == 64u);
  BOOST_TEST(tables[1].count == 64u);
  BOOST_TEST(tables[2].count == 7u);
  size_t next = 0;
  for (const plan::Table& t : tables) {
    uint32_t tiles = 0, entry_tiles = 0;
    uint64_t list = 0;
    for (uint32_t j = 0; j < t.count; ++j) {
      while (jobs[next].count == 0) ++next;
      const tc::Job& want = jobs[next++];
      const plan::TableJob& got = t.jobs[j];
      BOOST_TEST(got.element_offset == want.element_offset);
      BOOST_TEST(got.byte_offset == want.byte_offset);
      BOOST_TEST(got.count == want.count);
      BOOST_TEST(got.k == want.params.k(want.count));
      BOOST_TEST(got.layer == want.layer);
      BOOST_TEST(got.density_ppb == want.params.density_ppb);
      BOOST_TEST(got.tile_begin == tiles);
      BOOST_TEST(got.entry_tile_begin == entry_tiles);
      BOOST_TEST(got.list_begin == list);
      BOOST_TEST(got.list_capacity == plan::list_capacity(want.count));
      tiles += static_cast<uint32_t>((want.count + plan::kTileElements - 1) / plan::kTileElements);
      entry_tiles += static_cast<uint32_t>((got.k + plan::kTileElements - 1) / plan::kTileElements);
      list += got.list_capacity;
    }
    BOOST_TEST(t.tiles == tiles);
    BOOST_TEST(t.entry_tiles == entry_tiles);
  }
  BOOST_TEST(next == jobs.size());
  BOOST_TEST(plan::tables(std::vector<tc::Job>{job(0, 0), job(5, 0)}, "test").empty());
}

BOOST_AUTO_TEST_CASE(layouts_are_aligned_disjoint_and_sized_by_the_jobs) {
  const std::vector<tc::Job> jobs = {job(0, 1), job(1, 100'000), job(200'000, 4097, 500'000'000)};
  const std::vector<plan::Table> tables = plan::tables(jobs, "test");
  BOOST_REQUIRE_EQUAL(tables.size(), 1u);
  const plan::Table& t = tables[0];
  for (size_t candidates : {size_t{0}, size_t{1}, size_t{7}, size_t{16}}) {
    const bool encode = candidates == 0;
    const plan::Layout l = encode ? plan::encode_layout(t) : plan::stats_layout(t, candidates);
    BOOST_TEST_CONTEXT((encode ? std::string("encode") : std::to_string(candidates) + " candidates")) {
      const uint32_t targets = encode ? 1u : static_cast<uint32_t>(std::min<size_t>(candidates, 8));
      BOOST_TEST(l.targets == targets);
      const uint64_t tile_words = encode ? uint64_t{t.tiles} * 4 : 0;
      uint64_t entries = 0;
      for (uint32_t j = 0; j < t.count; ++j) entries += t.jobs[j].list_capacity;
      // Region, size, in layout order.
      const std::vector<std::pair<uint64_t, uint64_t>> regions = {
          {l.job_state, t.count * sizeof(plan::JobState)},
          {l.hist1, uint64_t{t.count} * plan::kBins1 * 4},
          {l.tile_above, tile_words},
          {l.tile_equal, tile_words},
          {l.tile_raw, tile_words},
          {l.sel, uint64_t{t.count} * targets * sizeof(plan::SelState)},
          {l.hist2, uint64_t{t.count} * targets * plan::kBins2 * 4},
          {l.hist3, uint64_t{t.count} * targets * plan::kBins3 * 4},
          {l.off_above, tile_words},
          {l.off_equal, tile_words},
          {l.list, encode ? entries * 8 : 0},
          {l.tile_sums, encode ? 0 : uint64_t{t.tiles} * targets * 8},
      };
      uint64_t end = 0;
      for (const auto& [begin, size] : regions) {
        BOOST_TEST(begin % 256 == 0u);
        BOOST_TEST(begin >= end);
        BOOST_TEST(begin < end + 256);
        end = begin + size;
      }
      BOOST_TEST(l.total >= end);
      BOOST_TEST(l.total < end + 256);
      BOOST_TEST(l.group_begin <= l.sel);
      BOOST_TEST(l.group_begin >= l.tile_raw + tile_words);
      BOOST_TEST(l.zero_end >= l.hist3 + uint64_t{t.count} * targets * plan::kBins3 * 4);
      BOOST_TEST(l.zero_end <= l.off_above);
    }
  }
}

BOOST_AUTO_TEST_CASE(scratch_sizes_are_the_largest_table_layout) {
  BOOST_TEST(tc::encode_scratch_bytes({}) == 0u);
  const std::vector<tc::Job> one = {job(0, 100'000'000)};
  const uint64_t big = tc::encode_scratch_bytes(one);
  BOOST_TEST(big == plan::encode_layout(plan::tables(one, "test")[0]).total);
  // About count / 4 bytes (the candidate list) plus per-tile counters and histograms.
  BOOST_TEST(big > 100'000'000u / 4);
  BOOST_TEST(big < 100'000'000u / 4 + 1'000'000u);
  // 65 jobs: two tables run one after the other and share the scratch.
  std::vector<tc::Job> many;
  for (uint32_t i = 0; i < 65; ++i) many.push_back(job(i * 1000, i == 64 ? 50'000'000 : 1000));
  const std::vector<plan::Table> tables = plan::tables(many, "test");
  BOOST_REQUIRE_EQUAL(tables.size(), 2u);
  BOOST_TEST(tc::encode_scratch_bytes(many) ==
             std::max(plan::encode_layout(tables[0]).total, plan::encode_layout(tables[1]).total));
  const std::vector<TopkParams> seven(7, TopkParams{}), sixteen(16, TopkParams{});
  BOOST_TEST(tc::stats_scratch_bytes(one, {}) == 0u);
  BOOST_TEST(tc::stats_scratch_bytes(one, seven) == plan::stats_layout(plan::tables(one, "test")[0], 7).total);
  BOOST_TEST(tc::stats_scratch_bytes(one, sixteen) == plan::stats_layout(plan::tables(one, "test")[0], 8).total);
  BOOST_TEST(tc::stats_scratch_bytes(one, sixteen) > tc::stats_scratch_bytes(one, std::vector<TopkParams>(1)));
  expect_error([] { tc::stats_scratch_bytes({}, std::vector<TopkParams>(17)); }, "17 candidates, at most 16");
  expect_error([] { tc::stats_scratch_bytes({}, std::vector<TopkParams>{TopkParams{0}}); }, "candidate 0");
}

BOOST_AUTO_TEST_CASE(invalid_jobs_are_named) {
  expect_error([] { tc::encode_scratch_bytes(std::vector<tc::Job>{job(0, 10), job(10, uint64_t{1} << 32)}); },
               "topk cuda encode_scratch_bytes: job 1: 4294967296 values; topk indexes a slice with u32, so at most 4294967295");
  expect_error([] { plan::tables(std::vector<tc::Job>{job(0, 10, 10'000'000, 6)}, "topk cuda encode"); },
               "topk cuda encode: job 0: payload offset 6 is not a multiple of 4");
  expect_error([] { plan::tables(std::vector<tc::Job>{job(0, 10), job(0, 10, 0)}, "what"); }, "what: job 1: ");
  expect_error([] { plan::tables(std::vector<tc::Job>{job(0, 10, 1'000'000'001)}, "what"); }, "what: job 0: ");
  expect_error([] { plan::check_first(std::vector<tc::Job>{job(5, 0), job(7, 3)}, 8, "input", "what"); },
               "what: job 1: element offset 7 is before input's first element 8");
  plan::check_first(std::vector<tc::Job>{job(5, 0), job(8, 3)}, 8, "input", "what");  // empty jobs may lie anywhere
}

BOOST_AUTO_TEST_CASE(encode_checks_pointers_and_the_scratch) {
  const std::vector<tc::Job> jobs = {job(16, 1000)};
  const std::vector<plan::Table> tables = plan::tables(jobs, "e");
  const uint64_t need = plan::encode_scratch(tables);
  tc::EncodeBatch b;
  b.jobs = jobs;
  b.input = at(0x10000);
  b.payload = at<uint8_t>(0x20000);
  b.scratch = at(0x30000);
  b.scratch_bytes = need;
  plan::check_encode(b, tables, "e");
  const auto fails = [&](tc::EncodeBatch bad, const std::string& part) {
    expect_error([&] { plan::check_encode(bad, tables, "e"); }, part);
  };
  tc::EncodeBatch bad = b;
  bad.input = nullptr;
  fails(bad, "e: input and payload must not be null");
  bad = b;
  bad.payload = at<uint8_t>(0x20002);
  fails(bad, "e: the payload must be 4-byte aligned");
  bad = b;
  bad.input = at(0x10002);
  fails(bad, "e: the input is not aligned to its element size");
  bad.input_dtype = DType::kBFloat16;
  plan::check_encode(bad, tables, "e");
  bad = b;
  bad.input_dtype = static_cast<DType>(7);
  fails(bad, "e: invalid input element type");
  bad = b;
  bad.residual = at<float>(0x40002);
  fails(bad, "e: the residual is not 4-byte aligned");
  bad = b;
  bad.nonfinite_values = at<unsigned long long>(0x50004);
  fails(bad, "e: the non-finite counter is not 8-byte aligned");
  bad = b;
  bad.input_first = 17;
  fails(bad, "e: job 0: element offset 16 is before input's first element 17");
  bad = b;
  bad.residual = at<float>(0x40000);
  bad.residual_first = 20;
  fails(bad, "before residual's first element 20");
  bad = b;
  bad.scratch_bytes = need - 1;
  fails(bad, "e: scratch of " + std::to_string(need - 1) + " bytes is too small (needs " + std::to_string(need) +
                 ", see encode_scratch_bytes)");
  bad = b;
  bad.scratch = nullptr;
  fails(bad, "is too small");
  bad = b;
  bad.scratch = at(0x30080);
  fails(bad, "e: the scratch is not 256-byte aligned");
}

BOOST_AUTO_TEST_CASE(decode_and_statistics_check_their_arguments) {
  const std::vector<tc::Job> jobs = {job(0, 1000)};
  tc::DecodeBatch d{jobs, at<uint8_t>(0x1000), at(0x2000), DType::kFloat32, 0};
  plan::check_decode(d, false, "d");
  plan::check_decode(d, true, "d");
  tc::DecodeBatch bad = d;
  bad.output_dtype = DType::kFloat16;
  plan::check_decode(bad, false, "d");
  expect_error([&] { plan::check_decode(bad, true, "d"); }, "d: accumulators must be float32");
  bad = d;
  bad.payload = at<uint8_t>(0x1001);
  expect_error([&] { plan::check_decode(bad, false, "d"); }, "d: the payload must be 4-byte aligned");
  bad = d;
  bad.output = at(0x2002);
  expect_error([&] { plan::check_decode(bad, false, "d"); }, "d: the output is not aligned to its element size");
  bad = d;
  bad.output = nullptr;
  expect_error([&] { plan::check_decode(bad, false, "d"); }, "d: payload and output must not be null");
  bad = d;
  bad.output_first = 1;
  expect_error([&] { plan::check_decode(bad, false, "d"); }, "before output's first element 1");

  const std::vector<TopkParams> candidates = {TopkParams{1'000'000}, TopkParams{10'000'000}};
  const std::vector<uint32_t> columns = {3, 1};
  tc::StatsBatch s;
  s.jobs = jobs;
  s.candidates = candidates;
  s.columns = columns;
  s.row_stride = 4;
  s.input = at(0x1000);
  s.squared = at<double>(0x2000);
  s.nonfinite = at<uint8_t>(0x3000);
  const std::vector<plan::Table> tables = plan::tables(jobs, "s");
  s.scratch = at(0x4000);
  s.scratch_bytes = plan::stats_scratch(tables, candidates.size());
  plan::check_candidates(s, "s");
  plan::check_stats(s, tables, "s");
  tc::StatsBatch sb = s;
  sb.row_stride = 3;
  expect_error([&] { plan::check_candidates(sb, "s"); }, "s: candidate 0's column 3 is not below the row stride 3");
  const std::vector<uint32_t> same = {1, 1};
  sb = s;
  sb.columns = same;
  expect_error([&] { plan::check_candidates(sb, "s"); }, "s: candidates 0 and 1 share column 1");
  sb = s;
  sb.columns = std::span<const uint32_t>(columns.data(), 1);
  expect_error([&] { plan::check_candidates(sb, "s"); }, "s: 2 candidates but 1 columns");
  sb = s;
  sb.squared = at<double>(0x2004);
  expect_error([&] { plan::check_stats(sb, tables, "s"); }, "s: squared is not 8-byte aligned");
  sb = s;
  sb.nonfinite = nullptr;
  expect_error([&] { plan::check_stats(sb, tables, "s"); }, "s: input, squared and nonfinite must not be null");
  sb = s;
  sb.scratch_bytes -= 8;
  expect_error([&] { plan::check_stats(sb, tables, "s"); }, "see stats_scratch_bytes");
}

// Without nvcc the entry points say so; with the kernels built, available() is true (they
// are run by topk_cuda_emulation and the GPU check).
BOOST_AUTO_TEST_CASE(a_build_without_cuda_says_so) {
  if (tc::available()) return;
  const std::vector<tc::Job> jobs = {job(0, 10)};
  tc::EncodeBatch b;
  b.jobs = jobs;
  try {
    tc::encode(b, nullptr);
    BOOST_ERROR("encode did not throw");
  } catch (const tc::CudaError& e) {
    BOOST_TEST(test::contains(e.what(), "topk cuda encode: this build of lgreco has no CUDA kernels"), e.what());
  }
  BOOST_CHECK_THROW(tc::decode(tc::DecodeBatch{}, nullptr), tc::CudaError);
  BOOST_CHECK_THROW(tc::decode_accumulate(tc::DecodeBatch{}, nullptr), tc::CudaError);
  BOOST_CHECK_THROW(tc::squared_errors(tc::StatsBatch{}, nullptr), tc::CudaError);
  BOOST_TEST(tc::encode_scratch_bytes(jobs) > 0u);  // host arithmetic answers anyway
}

BOOST_AUTO_TEST_SUITE_END()
