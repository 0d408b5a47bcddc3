// The in-process fabric: what each rank receives, rank-ordered reductions with the same
// bits everywhere, and the errors of mismatched calls and absent ranks.
#include "plugin/collective/inproc_fabric.h"

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "tests/unit/test_util.h"

namespace lgreco::collective {
namespace {

using namespace std::chrono_literals;

// Runs body(rank, fabric) on n threads; returns each rank's error text ("" if none).
template <typename Body>
std::vector<std::string> on_ranks(int n, std::chrono::milliseconds timeout, Body body) {
  auto hub = std::make_shared<InProcHub>(n, timeout);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      try {
        body(r, fabric);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// The byte rank p sends to rank q at position i.
uint8_t byte_of(uint64_t seed, int p, int q, uint64_t i) { return static_cast<uint8_t>((seed + p * 131 + q * 17 + i * 7) >> 1); }

BOOST_AUTO_TEST_SUITE(inproc_fabric)

BOOST_AUTO_TEST_CASE(all_to_all_and_all_gather_deliver_every_byte) {
  const uint64_t seed = test::run_seed();
  for (int n : {1, 2, 3, 5}) {
    std::mt19937_64 rng(seed + n);
    std::vector<std::vector<uint64_t>> counts(n, std::vector<uint64_t>(n));
    for (auto& row : counts)
      for (auto& c : row) c = rng() % 3 == 0 ? 0 : rng() % 5000;
    std::vector<uint64_t> gather_counts(n);
    for (auto& c : gather_counts) c = rng() % 4000;
    const auto errors = on_ranks(n, 5000ms, [&](int me, Fabric& f) {
      std::vector<uint8_t> send;
      for (int q = 0; q < n; ++q)
        for (uint64_t i = 0; i < counts[me][q]; ++i) send.push_back(byte_of(seed, me, q, i));
      std::vector<uint64_t> recv_counts(n);
      uint64_t total = 0;
      for (int p = 0; p < n; ++p) total += recv_counts[p] = counts[p][me];
      std::vector<uint8_t> recv(total, 0xA5);
      f.all_to_all_v(send.data(), counts[me], recv.data(), recv_counts);
      uint64_t at = 0;
      for (int p = 0; p < n; ++p)
        for (uint64_t i = 0; i < counts[p][me]; ++i)
          if (recv[at++] != byte_of(seed, p, me, i)) throw std::runtime_error("all_to_all_v: wrong byte");

      std::vector<uint8_t> mine(gather_counts[me]);
      for (uint64_t i = 0; i < mine.size(); ++i) mine[i] = byte_of(seed, me, 99, i);
      std::vector<uint8_t> all(std::accumulate(gather_counts.begin(), gather_counts.end(), uint64_t{0}), 0xA5);
      f.all_gather_v(mine.data(), gather_counts, all.data());
      at = 0;
      for (int p = 0; p < n; ++p)
        for (uint64_t i = 0; i < gather_counts[p]; ++i)
          if (all[at++] != byte_of(seed, p, 99, i)) throw std::runtime_error("all_gather_v: wrong byte");
    });
    for (int r = 0; r < n; ++r) BOOST_TEST(errors[r] == "", "ranks " << n << ", rank " << r);
  }
}

BOOST_AUTO_TEST_CASE(sums_are_rank_ordered_and_identical) {
  const int n = 4;
  const size_t count = 1000;
  std::vector<std::vector<float>> in(n);
  std::mt19937_64 rng(test::run_seed());
  for (auto& v : in) v = test::draw(test::Dist::kMixedScales, count, rng, 7);
  std::vector<float> expected(count, 0.0f);
  for (int p = 0; p < n; ++p)
    for (size_t i = 0; i < count; ++i) expected[i] += in[p][i];
  std::vector<std::vector<float>> out(n);
  std::vector<std::vector<double>> out64(n);
  const auto errors = on_ranks(n, 5000ms, [&](int me, Fabric& f) {
    out[me] = in[me];
    f.all_reduce_sum(std::span<float>(out[me]));
    out64[me].assign(in[me].begin(), in[me].end());
    f.all_reduce_sum(std::span<double>(out64[me]));
  });
  for (int r = 0; r < n; ++r) {
    BOOST_TEST(errors[r] == "");
    BOOST_TEST(memcmp(out[r].data(), expected.data(), count * 4) == 0);
    BOOST_TEST(memcmp(out64[r].data(), out64[0].data(), count * 8) == 0);
  }
}

BOOST_AUTO_TEST_CASE(mismatches_fail_on_every_rank) {
  const auto errors = on_ranks(3, 5000ms, [&](int me, Fabric& f) {
    std::vector<float> v(me == 2 ? 5 : 4, 1.0f);
    f.all_reduce_sum(std::span<float>(v));
  });
  for (const std::string& e : errors) BOOST_TEST(test::contains(e, "reduce 4 and 5 elements"), e);

  const auto op_errors = on_ranks(2, 5000ms, [&](int me, Fabric& f) {
    std::vector<float> v(4, 1.0f);
    if (me == 0) {
      f.all_reduce_sum(std::span<float>(v));
    } else {
      std::vector<uint64_t> bytes(2, 0);
      f.all_gather_v(nullptr, bytes, nullptr);
    }
  });
  for (const std::string& e : op_errors) BOOST_TEST(test::contains(e, "called all_gather_v while rank 0 called"), e);

  const auto size_errors = on_ranks(2, 5000ms, [&](int me, Fabric& f) {
    std::vector<uint8_t> send(16), recv(16);
    const std::vector<uint64_t> sends{8, 8};
    const std::vector<uint64_t> recvs{8, me == 1 ? 4u : 8u};
    f.all_to_all_v(send.data(), sends, recv.data(), recvs);
  });
  // Every rank names the same pair, and none has copied from a buffer that a failing
  // rank may already have freed (ThreadSanitizer runs this too).
  for (const std::string& e : size_errors)
    BOOST_TEST(test::contains(e, "rank 1 expects 4 bytes from rank 1, which sends 8"), e);
}

BOOST_AUTO_TEST_CASE(an_absent_rank_times_out_and_breaks_the_hub) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_ranks(3, 300ms, [&](int me, Fabric& f) {
    std::vector<float> v(4, 1.0f);
    f.all_reduce_sum(std::span<float>(v));
    if (me == 1) return;  // "dies" before the second operation
    f.all_reduce_sum(std::span<float>(v));
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  BOOST_TEST(seconds < 5.0);
  BOOST_TEST(errors[1] == "");
  for (int r : {0, 2}) BOOST_TEST(test::contains(errors[r], "for rank(s) 1 (dead or stalled?)"), errors[r]);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace lgreco::collective
