#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/lowrank.h"
#include "kernels/philox.h"
#include "kernels/quant_math.h"

namespace lgreco::lowrank {
namespace {

// The counter's rank word for Q0 is this | (block >> 32) (below 2^8: a layer holds at most
// 2^34 elements): no rank's rounding noise (ranks below 2^24, re-encodings
// 0x80000000 | owner) uses these words.
constexpr uint32_t kInitialQStream = 0x7f000000u;

void check_buffer(uint64_t have, uint64_t need, const char* what) {
  if (have < need)
    throw CodecError(std::string(what) + ": buffer of " + std::to_string(have) + " bytes, needs " +
                     std::to_string(need));
}

Shape shape_for(const PowersgdParams& p, uint64_t count, const char* what) {
  p.validate();
  if (p.rows == 0)
    throw CodecError(std::string(what) + ": powersgd needs the matrix shape: give rows=N in the spec (lgreco-codec "
                                         "--shape NxM does) or register the layer's shape");
  return shape_of(count, p.rows, what);
}

std::vector<float> values_of(DType dtype, const Slice& input, const float* residual, bool* finite) {
  std::vector<float> x(input.count);
  *finite = true;
  for (uint64_t i = 0; i < input.count; ++i) {
    const float v = load_as_float(input.data, dtype, i);
    x[i] = residual ? v + residual[i] : v;
    if (!quant::is_finite_value(x[i])) *finite = false;
  }
  return x;
}

void read_floats(const uint8_t* in, uint64_t n, std::vector<float>* out) {
  out->resize(n);
  if (n) memcpy(out->data(), in, 4 * n);
}

}  // namespace

Shape shape_of(uint64_t count, uint64_t rows, const char* what) {
  if (rows == 0 || count % rows != 0)
    throw CodecError(std::string(what) + ": " + std::to_string(count) + " values are not a matrix of " +
                     std::to_string(rows) + " rows");
  return Shape{rows, count / rows};
}

void initial_q(const NoiseKey& key, uint64_t cols, uint32_t rank, float* q) {
  for (uint64_t j = 0; j < cols; ++j)
    for (uint32_t c = 0; c < rank; ++c) {
      const uint64_t e = j * PowersgdParams::kMaxRank + c;
      const uint64_t block = e / 4;
      const PhiloxBlock words =
          philox4x32_10(static_cast<uint32_t>(block), key.layer, static_cast<uint32_t>(key.step),
                        kInitialQStream | static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(key.seed),
                        static_cast<uint32_t>(key.seed >> 32));
      q[j * rank + c] = static_cast<float>(words.v[e % 4] >> 8) * 0x1p-23f - 1.0f;
    }
}

void project(const float* x, const Shape& s, const float* q, uint32_t rank, float* p) {
  std::vector<double> row(rank);
  for (uint64_t i = 0; i < s.rows; ++i) {
    std::fill(row.begin(), row.end(), 0.0);
    const float* xi = x + i * s.cols;
    for (uint64_t j = 0; j < s.cols; ++j) {
      const double v = xi[j];
      const float* qj = q + j * rank;
      for (uint32_t c = 0; c < rank; ++c) row[c] += v * qj[c];
    }
    for (uint32_t c = 0; c < rank; ++c) p[i * rank + c] = static_cast<float>(row[c]);
  }
}

void orthonormalize(float* p, uint64_t rows, uint32_t rank) {
  std::vector<double> basis(rows * rank, 0.0), v(rows);
  for (uint32_t c = 0; c < rank; ++c) {
    double original = 0;
    for (uint64_t i = 0; i < rows; ++i) {
      v[i] = p[i * rank + c];
      original += v[i] * v[i];
    }
    for (uint32_t d = 0; d < c; ++d) {
      double dot = 0;
      for (uint64_t i = 0; i < rows; ++i) dot += basis[i * rank + d] * v[i];
      for (uint64_t i = 0; i < rows; ++i) v[i] -= dot * basis[i * rank + d];
    }
    double norm = 0;
    for (uint64_t i = 0; i < rows; ++i) norm += v[i] * v[i];
    // What is left of a column in the span of the earlier ones is rounding noise: below
    // 1e-10 of its squared length (about float32's resolution squared), drop it.
    const bool independent = norm > 1e-10 * original && norm > 0;
    const double inverse = independent ? 1.0 / std::sqrt(norm) : 0.0;
    for (uint64_t i = 0; i < rows; ++i) basis[i * rank + c] = v[i] * inverse;
  }
  for (uint64_t k = 0; k < rows * rank; ++k) p[k] = static_cast<float>(basis[k]);
}

void back_project(const float* x, const Shape& s, const float* p, uint32_t rank, float* q) {
  std::vector<double> acc(s.cols * rank, 0.0);
  for (uint64_t i = 0; i < s.rows; ++i) {
    const float* xi = x + i * s.cols;
    const float* pi = p + i * rank;
    for (uint64_t j = 0; j < s.cols; ++j) {
      const double v = xi[j];
      for (uint32_t c = 0; c < rank; ++c) acc[j * rank + c] += v * pi[c];
    }
  }
  for (uint64_t k = 0; k < s.cols * rank; ++k) q[k] = static_cast<float>(acc[k]);
}

void reconstruct(const float* p, const float* q, const Shape& s, uint32_t rank, float scale, float* out) {
  for (uint64_t i = 0; i < s.rows; ++i)
    for (uint64_t j = 0; j < s.cols; ++j) {
      double v = 0;
      for (uint32_t c = 0; c < rank; ++c) v += double(p[i * rank + c]) * double(q[j * rank + c]);
      out[i * s.cols + j] = static_cast<float>(v * scale);
    }
}

EncodeReport encode(const PowersgdParams& params, const NoiseKey& key, DType dtype, const Slice& input,
                    float* residual, std::span<uint8_t> out) {
  const Shape s = shape_for(params, input.count, "powersgd encode");
  const uint32_t r = params.rank;
  check_buffer(out.size(), encoded_bytes(s, r), "powersgd encode");
  bool finite = true;
  const std::vector<float> x = values_of(dtype, input, residual, &finite);
  std::vector<float> q(s.cols * r), p(s.rows * r);
  EncodeReport report;
  if (!finite) {
    // NaN factors decode to NaN everywhere: an overflow step stays visible.
    std::fill(p.begin(), p.end(), quant::canonical_nan(std::numeric_limits<float>::quiet_NaN()));
    std::fill(q.begin(), q.end(), quant::canonical_nan(std::numeric_limits<float>::quiet_NaN()));
    report.nonfinite_buckets = 1;
  } else {
    initial_q(key, s.cols, r, q.data());
    project(x.data(), s, q.data(), r, p.data());
    orthonormalize(p.data(), s.rows, r);
    back_project(x.data(), s, p.data(), r, q.data());
    if (residual) {
      std::vector<float> approx(input.count);
      reconstruct(p.data(), q.data(), s, r, 1.0f, approx.data());
      for (uint64_t i = 0; i < input.count; ++i) residual[i] = x[i] - approx[i];
    }
  }
  memcpy(out.data(), p.data(), 4 * p.size());
  memcpy(out.data() + 4 * p.size(), q.data(), 4 * q.size());
  return report;
}

void decode(const PowersgdParams& params, std::span<const uint8_t> in, uint64_t count, DType out_dtype, void* out) {
  const Shape s = shape_for(params, count, "powersgd decode");
  const uint32_t r = params.rank;
  check_buffer(in.size(), encoded_bytes(s, r), "powersgd decode");
  std::vector<float> p, q, values(count);
  read_floats(in.data(), s.rows * r, &p);
  read_floats(in.data() + 4 * s.rows * r, s.cols * r, &q);
  reconstruct(p.data(), q.data(), s, r, 1.0f, values.data());
  for (uint64_t i = 0; i < count; ++i) store_from_float(out, out_dtype, i, quant::canonical_nan(values[i]));
}

void decode_accumulate(const PowersgdParams& params, std::span<const uint8_t> in, uint64_t count, float* acc) {
  std::vector<float> values(count);
  decode(params, in, count, DType::kFloat32, values.data());
  for (uint64_t i = 0; i < count; ++i) acc[i] = quant::canonical_nan(acc[i] + values[i]);
}

bool squared_errors(const float* x, const Shape& s, const float* basis, uint32_t basis_rank,
                    std::span<const uint32_t> ranks, std::span<double> out) {
  double total = 0;
  bool finite = true;
  for (uint64_t k = 0; k < s.rows * s.cols; ++k) {
    if (!quant::is_finite_value(x[k])) finite = false;
    total += double(x[k]) * double(x[k]);
  }
  if (!finite) {
    for (size_t i = 0; i < ranks.size(); ++i) out[i] = std::numeric_limits<double>::infinity();
    return false;
  }
  std::vector<float> p(s.rows * basis_rank), b(s.cols * basis_rank);
  project(x, s, basis, basis_rank, p.data());
  orthonormalize(p.data(), s.rows, basis_rank);
  back_project(x, s, p.data(), basis_rank, b.data());  // column c: p_c^T M
  // captured[r] = sum over the first r columns of ||p_c^T M||^2.
  std::vector<double> captured(basis_rank + 1, 0.0);
  for (uint32_t c = 0; c < basis_rank; ++c) {
    double sum = 0;
    for (uint64_t j = 0; j < s.cols; ++j) sum += double(b[j * basis_rank + c]) * double(b[j * basis_rank + c]);
    captured[c + 1] = captured[c] + sum;
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] > basis_rank)
      throw CodecError("powersgd squared_errors: rank " + std::to_string(ranks[i]) + " above the basis' " +
                       std::to_string(basis_rank));
    out[i] = std::max(0.0, total - captured[ranks[i]]);
  }
  return true;
}

}  // namespace lgreco::lowrank
