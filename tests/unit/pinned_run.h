// Ranks of the engine as threads over the in-process fabric and the CPU backend, with the
// compression error of every call computed here in float64 from what the engines held
// before it: the output minus the exact reduction of what was encoded, every rank's input
// plus its residual (ncclAvg: their mean) plus the owner residual of each element's owner
// under sra (docs/CONTROLLER.md, "Which error"). No engine code computes it: the residuals
// come from Engine::residual_snapshot and owner_residual_snapshot.
#pragma once

#include <barrier>
#include <cstring>
#include <limits>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/collective/cpu_backend.h"
#include "plugin/collective/engine.h"
#include "plugin/collective/inproc_fabric.h"

namespace lgreco::test {

struct PinnedRun {
  int ranks = 4;
  std::vector<collective::BucketLayout> buckets;  // float32
  std::function<collective::EngineOptions(int rank)> options;
  std::function<std::vector<float>(int rank, uint64_t step, uint32_t bucket)> input;
  uint64_t steps = 1;
  collective::ReduceOp op = collective::ReduceOp::kSum;
  // After every call, on rank 0's thread while every rank waits: the call's error per
  // element (float64) and rank 0's engine.
  std::function<void(uint64_t step, uint32_t bucket, const std::vector<double>& error, const collective::Engine&)>
      on_call;
};

struct PinnedResult {
  // error[step][bucket][layer]: the call's squared compression error per layer; and the
  // same for the output against the exact sum of the inputs (no residuals).
  std::vector<std::vector<std::vector<double>>> error, output_error;
  std::vector<uint64_t> encoded_bytes;  // rank 0's counter after each step
  std::vector<std::string> failures;    // calls that did not complete, outputs that differ between ranks
};

inline PinnedResult run_pinned(const PinnedRun& run) {
  using namespace collective;
  const int n = run.ranks;
  auto hub = std::make_shared<InProcHub>(n, std::chrono::milliseconds(60000));
  std::barrier<> sync(n);
  struct RankData {
    std::vector<float> in, out, residual;
    std::pair<uint64_t, std::vector<float>> owner;
  };
  std::vector<RankData> data(n);
  PinnedResult result;
  result.error.assign(run.steps, std::vector<std::vector<double>>(run.buckets.size()));
  result.output_error = result.error;
  result.encoded_bytes.assign(run.steps, 0);
  std::mutex failures;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      InProcFabric fabric(hub, r);
      CpuBackend backend;
      Engine engine(run.options(r), run.buckets, fabric, backend);
      RankData& mine = data[r];
      for (uint64_t step = 0; step < run.steps; ++step) {
        for (uint32_t b = 0; b < run.buckets.size(); ++b) {
          const BucketLayout& layout = run.buckets[b];
          mine.in = run.input(r, step, b);
          mine.residual = engine.residual_snapshot(b);
          mine.owner = engine.owner_residual_snapshot(b);
          mine.out.assign(layout.count, std::numeric_limits<float>::quiet_NaN());  // poisoned
          const CallOutcome outcome =
              engine.allreduce({b, step, mine.in.data(), mine.out.data(), layout.count, DType::kFloat32, run.op});
          if (outcome.kind != CallOutcome::Kind::kDone) {
            std::lock_guard<std::mutex> lock(failures);
            result.failures.push_back("rank " + std::to_string(r) + " step " + std::to_string(step) + ": " +
                                      outcome.message);
          }
          sync.arrive_and_wait();
          if (r == 0) {
            const double w = run.op == ReduceOp::kAvg ? 1.0 / n : 1.0;
            std::vector<double> error(layout.count);
            for (uint64_t i = 0; i < layout.count; ++i) {
              double encoded = 0;
              for (const RankData& q : data) {
                encoded += w * (q.in[i] + (q.residual.empty() ? 0.0 : q.residual[i]));
                if (i >= q.owner.first && i - q.owner.first < q.owner.second.size())
                  encoded += q.owner.second[i - q.owner.first];
              }
              error[i] = data[0].out[i] - encoded;
              for (int q = 1; q < n; ++q)
                if (std::memcmp(&data[q].out[i], &data[0].out[i], sizeof(float)) != 0) {
                  result.failures.push_back("step " + std::to_string(step) + " bucket " + std::to_string(b) +
                                            ": rank " + std::to_string(q) + "'s output differs at " +
                                            std::to_string(i));
                  break;
                }
            }
            std::vector<double>& per_layer = result.error[step][b];
            std::vector<double>& per_layer_output = result.output_error[step][b];
            for (const LayerLayout& l : layout.layers) {
              double e = 0, o = 0;
              for (uint64_t i = l.offset; i < l.offset + l.numel; ++i) {
                e += error[i] * error[i];
                double exact = 0;
                for (const RankData& q : data) exact += w * q.in[i];
                o += (data[0].out[i] - exact) * (data[0].out[i] - exact);
              }
              per_layer.push_back(e);
              per_layer_output.push_back(o);
            }
            if (run.on_call) run.on_call(step, b, error, engine);
          }
          sync.arrive_and_wait();
        }
        if (r == 0) result.encoded_bytes[step] = engine.counters().encoded_bytes;
      }
    });
  for (auto& t : threads) t.join();
  return result;
}

}  // namespace lgreco::test
