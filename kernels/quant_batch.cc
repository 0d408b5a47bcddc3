#include "kernels/quant_batch.h"

#include <algorithm>
#include <string>

#include "kernels/quant.h"
#include "kernels/stats_columns.h"

namespace lgreco::quant::cuda {
namespace {

std::string job_name(const char* what, size_t index) { return std::string(what) + ": job " + std::to_string(index); }

// Appends job `job` (already checked) with `bucket`-element buckets to the last table, or
// to a new one when the last is full.
void add_to_tables(std::vector<warp::JobTable>& tables, const Job& job, uint32_t bucket, int bits, bool stochastic) {
  const uint64_t buckets = ceil_div(job.count, bucket);
  // Work item indices are 32-bit: a table holds fewer than 2^31 of them. One job has at
  // most 2^34 / 32 = 2^29 buckets, so it always fits in a table of its own.
  constexpr uint64_t kMaxWork = (uint64_t{1} << 31) - 1;
  if (tables.empty() || tables.back().count == warp::kMaxJobsPerLaunch ||
      tables.back().total_work + buckets > kMaxWork) {
    tables.emplace_back();
    tables.back() = warp::JobTable{};
  }
  warp::JobTable& t = tables.back();
  warp::KernelJob& k = t.jobs[t.count++];
  k = warp::KernelJob{};
  k.element_offset = job.element_offset;
  k.byte_offset = job.byte_offset;
  k.count = job.count;
  k.first_bucket = static_cast<uint32_t>(job.first_element / bucket);
  k.work_begin = t.total_work;
  k.layer = job.layer;
  k.bucket = bucket;
  k.bits = static_cast<uint8_t>(bits);
  k.stochastic = stochastic ? 1 : 0;
  t.total_work += static_cast<uint32_t>(buckets);
}

void check_slice(const Job& job, uint32_t bucket, const std::string& name) {
  if (job.first_element % bucket != 0)
    throw CodecError(name + ": first element " + std::to_string(job.first_element) +
                     " is not on a bucket boundary (bucket=" + std::to_string(bucket) + ")");
  if (job.count > kMaxLayerElements || job.first_element > kMaxLayerElements - job.count)
    throw CodecError(name + ": elements " + std::to_string(job.first_element) + " + " + std::to_string(job.count) +
                     " exceed the 2^34 elements a layer may hold");
}

}  // namespace

std::vector<warp::JobTable> codec_tables(std::span<const Job> jobs, const char* what) {
  std::vector<warp::JobTable> tables;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    const std::string name = job_name(what, i);
    try {
      job.params.validate();
    } catch (const CodecError& e) {
      throw CodecError(name + ": " + e.what());
    }
    check_slice(job, job.params.bucket, name);
    if (job.byte_offset % 4 != 0)
      throw CodecError(name + ": payload offset " + std::to_string(job.byte_offset) +
                       " is not a multiple of 4 (code words are 32-bit)");
    if (job.count == 0) continue;
    add_to_tables(tables, job, job.params.bucket, job.params.bits, job.params.rounding == Rounding::kStochastic);
  }
  return tables;
}

std::vector<StatsLaunch> stats_launches(std::span<const Job> jobs, std::span<const CodecSpec> candidates,
                                        const char* what) {
  if (candidates.size() > kMaxStatsCandidates)
    throw CodecError(std::string(what) + ": " + std::to_string(candidates.size()) + " candidates, at most " +
                     std::to_string(kMaxStatsCandidates) + " per call");
  std::vector<uint32_t> buckets;
  bool has_none = false;
  for (size_t c = 0; c < candidates.size(); ++c) {
    switch (candidates[c].family()) {
      case CodecFamily::kNone: has_none = true; break;
      case CodecFamily::kQuant:
        candidates[c].quant_params().validate();
        buckets.push_back(candidates[c].quant_params().bucket);
        break;
      default:
        throw CodecError(std::string(what) + ": candidate " + std::to_string(c) + " (" + candidates[c].str() +
                         ") is not measured by the quantization kernels");
    }
  }
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  // `none` has no buckets; it rides along the first launch (or has one of its own, split
  // like the default quant bucket, when no quant candidate is measured).
  if (buckets.empty() && has_none) buckets.push_back(QuantParams{}.bucket);

  std::vector<StatsLaunch> launches;
  for (size_t l = 0; l < buckets.size(); ++l) {
    StatsLaunch launch;
    launch.bucket = buckets[l];
    for (size_t c = 0; c < candidates.size(); ++c) {
      const CodecSpec& spec = candidates[c];
      if (spec.family() == CodecFamily::kNone && l == 0) {
        launch.candidates.push_back(warp::StatsCandidate{0, 0});
        launch.columns.push_back(static_cast<uint32_t>(c));
      } else if (spec.family() == CodecFamily::kQuant && spec.quant_params().bucket == launch.bucket) {
        const QuantParams& p = spec.quant_params();
        launch.candidates.push_back(
            warp::StatsCandidate{static_cast<uint8_t>(p.bits), p.rounding == Rounding::kStochastic ? uint8_t{1} : uint8_t{0}});
        launch.columns.push_back(static_cast<uint32_t>(c));
        launch.has_quant = true;
      }
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      const std::string name = job_name(what, i);
      check_slice(jobs[i], launch.has_quant ? launch.bucket : 1, name);
      if (jobs[i].count == 0) continue;
      add_to_tables(launch.tables, jobs[i], launch.bucket, 0, false);
    }
    launches.push_back(std::move(launch));
  }
  return launches;
}

namespace {
void check_first(std::span<const Job> jobs, uint64_t first, const char* array, const char* what) {
  for (size_t i = 0; i < jobs.size(); ++i)
    if (jobs[i].count > 0 && jobs[i].element_offset < first)
      throw CodecError(job_name(what, i) + ": element offset " + std::to_string(jobs[i].element_offset) + " is before " +
                       array + "'s first element " + std::to_string(first));
}
}  // namespace

warp::EncodeArgs encode_args(const EncodeBatch& b, const char* what) {
  check_first(b.jobs, b.input_first, "input", what);
  if (b.residual) check_first(b.jobs, b.residual_first, "residual", what);
  return warp::EncodeArgs{b.input,         b.input_first, b.residual, b.residual_first, b.skip_residual,
                          b.payload,       b.noise,       b.nonfinite_buckets};
}

warp::DecodeArgs decode_args(const DecodeBatch& b, const char* what) {
  check_first(b.jobs, b.output_first, "output", what);
  return warp::DecodeArgs{b.payload, b.output, b.output_first};
}

warp::StatsArgs stats_args(const StatsBatch& b, const StatsLaunch& launch, double* partial, const char* what) {
  check_first(b.jobs, b.input_first, "input", what);
  if (b.residual) check_first(b.jobs, b.residual_first, "residual", what);
  warp::StatsArgs args{};
  args.input = b.input;
  args.input_first = b.input_first;
  args.residual = b.residual;
  args.residual_first = b.residual_first;
  args.nonfinite = b.nonfinite;
  args.partial = partial;
  args.candidate_count = static_cast<uint32_t>(launch.candidates.size());
  args.has_quant = launch.has_quant;
  for (size_t c = 0; c < launch.candidates.size(); ++c) args.candidates[c] = launch.candidates[c];
  return args;
}

StatsOutput stats_output(const StatsBatch& b, const StatsLaunch& launch, const char* what) {
  StatsOutput out;
  if (b.columns.empty()) {
    out.row_stride = static_cast<uint32_t>(b.candidates.size());
    for (size_t c = 0; c < launch.candidates.size(); ++c) out.columns[c] = launch.columns[c];
    return out;
  }
  check_stats_columns(b.columns, b.candidates.size(), b.row_stride, what);
  out.row_stride = b.row_stride;
  for (size_t c = 0; c < launch.candidates.size(); ++c) out.columns[c] = b.columns[launch.columns[c]];
  return out;
}

uint64_t stats_scratch_bytes(const std::vector<StatsLaunch>& launches) {
  uint64_t bytes = 0;
  for (const StatsLaunch& launch : launches)
    for (const warp::JobTable& t : launch.tables)
      bytes = std::max<uint64_t>(bytes, uint64_t{t.total_work} * launch.candidates.size() * sizeof(double));
  return bytes;
}

}  // namespace lgreco::quant::cuda
