// Host side of the CUDA quantization kernels: checks a batch's jobs and splits them into
// launches (job tables passed by value, warp::JobTable). Pure C++, no CUDA: the checks and
// the split are unit-tested on any machine, and the launchers in quant_cuda.cu only
// launch what this produces.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/codec_spec.h"
#include "kernels/quant_cuda.h"
#include "kernels/quant_warp.h"

namespace lgreco::quant::cuda {

// The job tables of an encode or decode batch: jobs in order, empty ones dropped, at most
// warp::kMaxJobsPerLaunch per table. Throws CodecError naming the job and what is wrong
// (`what` prefixes the message, e.g. "quant cuda encode").
std::vector<warp::JobTable> codec_tables(std::span<const Job> jobs, const char* what);

// One launch of the statistics: the candidates sharing one bucket size (plus every `none`
// candidate, in the first launch only), their columns in the output rows, and its tables.
struct StatsLaunch {
  uint32_t bucket = 0;
  std::vector<warp::StatsCandidate> candidates;
  std::vector<uint32_t> columns;  // candidates[i] is column columns[i] of the output rows
  bool has_quant = false;
  std::vector<warp::JobTable> tables;
};
// Throws CodecError on an invalid candidate, more than kMaxStatsCandidates, a family the
// kernels do not measure, or a job not on a bucket boundary of every candidate.
std::vector<StatsLaunch> stats_launches(std::span<const Job> jobs, std::span<const CodecSpec> candidates,
                                        const char* what);
// The kernels' arguments for a batch (what quant_cuda.cu launches with and the emulation
// tests run). Throw CodecError when a job's elements lie before an array's *_first.
warp::EncodeArgs encode_args(const EncodeBatch& batch, const char* what);
warp::DecodeArgs decode_args(const DecodeBatch& batch, const char* what);
// `partial` is the batch's scratch, reused by every launch.
warp::StatsArgs stats_args(const StatsBatch& batch, const StatsLaunch& launch, double* partial, const char* what);

// Where a launch's candidates go in the output rows: the batch's columns (or the candidates'
// own indices when it gives none) and its row stride. Throws CodecError when the columns
// are not one distinct value below row_stride per candidate.
struct StatsOutput {
  uint32_t row_stride = 0;
  uint32_t columns[warp::kMaxCandidates] = {};
};
StatsOutput stats_output(const StatsBatch& batch, const StatsLaunch& launch, const char* what);

// Scratch the launches need: the largest (work items x candidates) double array of any table.
uint64_t stats_scratch_bytes(const std::vector<StatsLaunch>& launches);

}  // namespace lgreco::quant::cuda
