// PowerSGD on the GPU (lowrank_cuda.h): cuBLAS for the two large products, lgreco's own
// kernels for the rest. The host side (checks, scratch, launch tables) is
// lowrank_cuda_plan.cc; this file loads cuBLAS, launches, and holds the kernels.
//
// Arithmetic, against kernels/lowrank_ref.cc:
//  - P = M Q and Q = M^T P: cuBLAS SGEMM, float32 products and sums in cuBLAS's order
//    (the CPU sums float64 products and rounds once): close, not equal (docs/KERNELS.md).
//  - Gram-Schmidt, reconstruct, the residual, the statistics' norms: float64 with every
//    rounding spelled out (__dadd_rn, __dmul_rn, ...; the build also passes --fmad=false),
//    in the CPU's order where the CPU has one order per value (a product sum over the
//    rank: reconstruct and the residual are bit for bit the CPU's), and in a fixed tree
//    order where the CPU sums over rows or columns (Gram-Schmidt's dot products and norms,
//    ||M||^2: deterministic, within rounding of the CPU's).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda_launch.h"
#include "kernels/dtype.h"
#include "kernels/lowrank_cuda.h"
#include "kernels/lowrank_cuda_plan.h"
#include "kernels/philox.h"
#include "kernels/quant_math.h"

namespace lgreco::lowrank::cuda {
namespace {

using plan::Items;
using plan::Table;
using plan::TableLayer;
using quant::cuda::launch_kernel;

constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;
// Gram-Schmidt and the statistics reduce this many columns' sums at once.
constexpr uint32_t kGroup = 16;
constexpr uint32_t kMaxRank = PowersgdParams::kMaxRank;
// The counter's fourth word of Q0's Philox blocks (kernels/lowrank_ref.cc, docs/FORMAT.md):
// 0x7F000000 | (block >> 32).
constexpr uint32_t kInitialQStream = 0x7f000000u;
// Staging: at most this many blocks, grid-stride beyond.
constexpr uint64_t kStageBlocks = 8192;

static_assert(kThreads == plan::kQ0BlockElements && kThreads == plan::kSumThreads);
static_assert(plan::kTile * 8 == kThreads);

// ---------------------------------------------------------------------------------------
// cuBLAS, loaded at run time: liblgreco.so stays loadable where no cuBLAS is installed
// (only these operations need it), and in a process that already has one (torch's wheel
// ships its own) dlopen of the soname returns that copy instead of mapping a second.

#define LGRECO_LOWRANK_STR2(x) #x
#define LGRECO_LOWRANK_STR(x) LGRECO_LOWRANK_STR2(x)

struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetPointerMode_v2) set_pointer_mode = nullptr;
  decltype(&cublasGetVersion_v2) get_version = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  std::string error;  // why cuBLAS is unusable; empty when loaded
};

Cublas load_cublas() {
  Cublas api;
  const std::string soname = "libcublas.so." LGRECO_LOWRANK_STR(CUBLAS_VER_MAJOR);
  std::vector<std::string> names{soname};
#ifdef LGRECO_CUDA_LIB_DIR
  names.push_back(std::string(LGRECO_CUDA_LIB_DIR) + "/" + soname);  // the toolkit of the build
#endif
  void* library = nullptr;
  std::string tried;
  for (const std::string& name : names) {
    library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library) break;
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + (e ? std::string(e) : name);
  }
  if (!library) {
    api.error = "cuBLAS could not be loaded (" + tried + ")";
    return api;
  }
  // Kept loaded for the life of the process (never dlclosed).
  auto bind = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(library, symbol));
    if (!fn && api.error.empty()) api.error = std::string("cuBLAS (") + soname + ") has no " + symbol;
  };
  bind(api.create, "cublasCreate_v2");
  bind(api.destroy, "cublasDestroy_v2");
  bind(api.set_stream, "cublasSetStream_v2");
  bind(api.set_workspace, "cublasSetWorkspace_v2");
  bind(api.set_math_mode, "cublasSetMathMode");
  bind(api.set_pointer_mode, "cublasSetPointerMode_v2");
  bind(api.get_version, "cublasGetVersion_v2");
  bind(api.sgemm, "cublasSgemm_v2");
  bind(api.status_name, "cublasGetStatusName");
  bind(api.status_string, "cublasGetStatusString");
  return api;
}

const Cublas& cublas_api() {
  static const Cublas api = load_cublas();
  return api;
}

void check_cublas(cublasStatus_t status, const char* call, const char* what, const std::string& where = "") {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const Cublas& api = cublas_api();
  throw CudaError(std::string("lgreco: ") + what + ": " + call + " failed" + where + ": " +
                  (api.status_name ? api.status_name(status) : "status " + std::to_string(static_cast<int>(status))) +
                  (api.status_string ? std::string(" (") + api.status_string(status) + ")" : std::string()));
}

std::string at_layer(const Layer& l) {
  return " (bucket layer " + std::to_string(l.layer) + ", " + std::to_string(l.rows) + " x " + std::to_string(l.cols) +
         ", rank " + std::to_string(l.rank) + ")";
}

// The handle on this stream with its workspace (cublasSetStream resets the workspace to
// cuBLAS's own pool, which would allocate).
cublasHandle_t bind(Handle& handle, Stream stream, const char* what) {
  const Cublas& api = cublas_api();
  const auto h = static_cast<cublasHandle_t>(handle.cublas());
  check_cublas(api.set_stream(h, stream), "cublasSetStream", what);
  check_cublas(api.set_workspace(h, handle.workspace(), handle.workspace_bytes()), "cublasSetWorkspace", what);
  return h;
}

// One SGEMM of lowrank_cuda_plan.h's shape (the transposes are worked out, and unit-tested
// against the CPU reference, there): C = op(A) op(B), alpha 1, beta 0.
void gemm(cublasHandle_t h, const plan::Gemm& g, const float* a, const float* b, float* c, const char* call,
          const char* what, const Layer& l) {
  const float one = 1.0f, zero = 0.0f;
  check_cublas(cublas_api().sgemm(h, g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  g.m, g.n, g.k, &one, a, g.lda, b, g.ldb, &zero, c, g.ldc),
               call, what, at_layer(l));
}

// P = M Q (P^T = Q^T M^T).
void gemm_project(cublasHandle_t h, const Layer& l, uint32_t rank, const float* m, const float* q, float* p,
                  const char* what) {
  gemm(h, plan::project_gemm(l.rows, l.cols, rank), q, m, p, "cublasSgemm (P = M Q)", what, l);
}

// Q = M^T P (Q^T = P^T M).
void gemm_back_project(cublasHandle_t h, const Layer& l, uint32_t rank, const float* m, const float* p, float* q,
                       const char* what) {
  gemm(h, plan::back_project_gemm(l.rows, l.cols, rank), p, m, q, "cublasSgemm (Q = M^T P)", what, l);
}

// ---------------------------------------------------------------------------------------
// Device helpers

// The table's layer holding work item `item`: the last whose item_begin <= item (every
// layer has at least one item, so item_begin strictly increases).
__device__ __forceinline__ uint32_t find_layer(const Table& t, uint32_t item) {
  uint32_t lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (t.layers[mid].item_begin <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <DType T>
__device__ __forceinline__ void store_as(void* base, uint64_t i, float v) {
  if constexpr (T == DType::kFloat32)
    static_cast<float*>(base)[i] = v;
  else if constexpr (T == DType::kFloat16)
    static_cast<uint16_t*>(base)[i] = float_to_half_rn(v);
  else
    static_cast<uint16_t*>(base)[i] = float_to_bf16_rn(v);
}

template <uint32_t G>
struct Reducer {
  double warp_sums[G][kWarps];
  double result[G];
};

// v[k] (k < g, g uniform across the block) becomes the block's sum of v[k], the same in
// every thread: each warp sums its lanes by a fixed shuffle tree (lane 0's result), then
// one thread per value adds the warps' sums in warp order. Deterministic; every thread of
// the block must call it.
template <uint32_t G>
__device__ __forceinline__ void block_sum(double (&v)[G], uint32_t g, Reducer<G>& r) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (uint32_t k = 0; k < G; ++k) {
    if (k < g) {
      double x = v[k];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) x = __dadd_rn(x, __shfl_down_sync(0xffffffffu, x, offset));
      if (lane == 0) r.warp_sums[k][warp] = x;
    }
  }
  __syncthreads();
  if (threadIdx.x < g) {
    double s = r.warp_sums[threadIdx.x][0];
    for (uint32_t w = 1; w < kWarps; ++w) s = __dadd_rn(s, r.warp_sums[threadIdx.x][w]);
    r.result[threadIdx.x] = s;
  }
  __syncthreads();
#pragma unroll
  for (uint32_t k = 0; k < G; ++k)
    if (k < g) v[k] = r.result[k];
}

// ---------------------------------------------------------------------------------------
// Kernels

// M = input (+ residual unless the layer is flagged), float32, into the staging buffer;
// input and residual point at the layer's first element.
template <DType T>
__global__ void __launch_bounds__(kThreads) stage_kernel(const void* input, const float* residual,
                                                         const uint8_t* flags, uint32_t layer, float* m, uint64_t n) {
  const bool add = residual != nullptr && !(flags != nullptr && flags[layer] != 0);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < n; k += stride) {
    const float v = load_as_float<T>(input, k);
    m[k] = add ? __fadd_rn(v, residual[k]) : v;
  }
}

// Modified Gram-Schmidt, one block per layer, lowrank::orthonormalize's arithmetic in the
// right-looking order: once column c is final, every later column loses its component
// along it. Column d thus loses its components along columns 0, 1, ..., d - 1 in turn,
// each dot product taken with what is left of d, as the CPU's loop does. The columns live
// in float64 in the scratch, column-major (work[c rows + i]); thread t owns rows t, t +
// 256, ..., so only the sums need the block.
__global__ void __launch_bounds__(kThreads) orthonormalize_kernel(const __grid_constant__ Table table, float* p,
                                                                  double* work) {
  __shared__ Reducer<kGroup> red;
  __shared__ double original[kMaxRank];
  const TableLayer& l = table.layers[blockIdx.x];
  const uint64_t rows = l.rows;
  const uint32_t rank = l.rank;
  float* pl = p + l.p_offset;
  double* w = work + l.work_offset;
  const uint64_t n = rows * rank;
  for (uint64_t k = threadIdx.x; k < n; k += kThreads) w[(k % rank) * rows + k / rank] = pl[k];
  __syncthreads();

  double part[kGroup];
  // Each column's original squared length.
  for (uint32_t c0 = 0; c0 < rank; c0 += kGroup) {
    const uint32_t g = min(kGroup, rank - c0);
#pragma unroll
    for (uint32_t k = 0; k < kGroup; ++k) part[k] = 0.0;
    for (uint64_t i = threadIdx.x; i < rows; i += kThreads) {
#pragma unroll
      for (uint32_t k = 0; k < kGroup; ++k)
        if (k < g) {
          const double v = w[(c0 + k) * rows + i];
          part[k] = __dadd_rn(part[k], __dmul_rn(v, v));
        }
    }
    block_sum(part, g, red);
    if (threadIdx.x == 0) {
#pragma unroll
      for (uint32_t k = 0; k < kGroup; ++k)
        if (k < g) original[c0 + k] = part[k];
    }
  }

  for (uint32_t c = 0; c < rank; ++c) {
    double* wc = w + c * rows;
    part[0] = 0.0;
    for (uint64_t i = threadIdx.x; i < rows; i += kThreads) part[0] = __dadd_rn(part[0], __dmul_rn(wc[i], wc[i]));
    block_sum(part, 1, red);  // its syncs also publish original[] (thread 0's writes)
    const double norm = part[0];
    // What is left of a column in the span of the earlier ones is rounding noise: below
    // 1e-10 of its squared length, it becomes zero (the CPU's rule, word for word).
    const bool independent = norm > __dmul_rn(1e-10, original[c]) && norm > 0.0;
    const double inverse = independent ? __ddiv_rn(1.0, __dsqrt_rn(norm)) : 0.0;
    for (uint64_t i = threadIdx.x; i < rows; i += kThreads) wc[i] = __dmul_rn(wc[i], inverse);
    for (uint32_t d0 = c + 1; d0 < rank; d0 += kGroup) {
      const uint32_t g = min(kGroup, rank - d0);
#pragma unroll
      for (uint32_t k = 0; k < kGroup; ++k) part[k] = 0.0;
      for (uint64_t i = threadIdx.x; i < rows; i += kThreads) {
        const double b = wc[i];
#pragma unroll
        for (uint32_t k = 0; k < kGroup; ++k)
          if (k < g) part[k] = __dadd_rn(part[k], __dmul_rn(b, w[(d0 + k) * rows + i]));
      }
      block_sum(part, g, red);
      for (uint64_t i = threadIdx.x; i < rows; i += kThreads) {
        const double b = wc[i];
#pragma unroll
        for (uint32_t k = 0; k < kGroup; ++k)
          if (k < g) {
            double& v = w[(d0 + k) * rows + i];
            v = __dsub_rn(v, __dmul_rn(part[k], b));
          }
      }
    }
  }
  __syncthreads();
  for (uint64_t k = threadIdx.x; k < n; k += kThreads) pl[k] = __double2float_rn(w[(k % rank) * rows + k / rank]);
}

struct TileArgs {
  const float* p;
  const float* q;
  float scale;
  // reconstruct: element e of the call at out[e - out_first]
  void* out;
  uint64_t out_first;
  // the residual (a table of one layer): M and the residual at the layer's first element
  const float* m;
  float* residual;
  const uint8_t* flags;
};

// One 32 x 32 tile of P Q^T per block, thread (tx, ty) computing column tx of rows ty,
// ty + 8, ty + 16, ty + 24: sum over c of float64(P[i][c]) x float64(Q[j][c]) in order of
// c, rounded once, as lowrank::reconstruct. The factors go through shared memory in chunks
// of 32 ranks. Then reconstruct writes scale x that, narrowed (NaN canonical); the residual
// becomes M - that (kResidual, scale 1), unless the layer is flagged.
template <DType T, bool kResidual>
__global__ void __launch_bounds__(kThreads) tile_kernel(const __grid_constant__ Table table,
                                                        const __grid_constant__ TileArgs a) {
  constexpr uint32_t kTile = plan::kTile;
  __shared__ float ps[kTile][kTile + 1];
  __shared__ float qs[kTile][kTile + 1];
  const uint32_t item = blockIdx.x;
  const TableLayer& l = table.layers[find_layer(table, item)];
  if (kResidual && a.flags != nullptr && a.flags[l.layer] != 0) return;  // the whole block
  const uint32_t t = item - l.item_begin;
  const uint64_t i0 = static_cast<uint64_t>(t / l.tiles_x) * kTile;
  const uint64_t j0 = static_cast<uint64_t>(t % l.tiles_x) * kTile;
  const uint32_t tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const uint32_t rank = l.rank;
  const float* p = a.p + l.p_offset;
  const float* q = a.q + l.q_offset;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (uint32_t c0 = 0; c0 < rank; c0 += kTile) {
    const uint32_t kc = min(kTile, rank - c0);
    __syncthreads();
    for (uint32_t k = threadIdx.x; k < kTile * kc; k += kThreads) {
      const uint32_t r = k / kc, c = k % kc;
      ps[r][c] = i0 + r < l.rows ? p[(i0 + r) * rank + c0 + c] : 0.0f;
      qs[r][c] = j0 + r < l.cols ? q[(j0 + r) * rank + c0 + c] : 0.0f;
    }
    __syncthreads();
    for (uint32_t c = 0; c < kc; ++c) {
      const double qv = qs[tx][c];
#pragma unroll
      for (uint32_t k = 0; k < 4; ++k) acc[k] = __dadd_rn(acc[k], __dmul_rn(static_cast<double>(ps[ty + 8 * k][c]), qv));
    }
  }
  const uint64_t j = j0 + tx;
  if (j >= l.cols) return;
#pragma unroll
  for (uint32_t k = 0; k < 4; ++k) {
    const uint64_t i = i0 + ty + 8 * k;
    if (i >= l.rows) break;
    const uint64_t e = i * l.cols + j;
    const float v = __double2float_rn(__dmul_rn(acc[k], static_cast<double>(a.scale)));
    if constexpr (kResidual)
      a.residual[e] = __fsub_rn(a.m[e], v);
    else
      store_as<T>(a.out, l.offset - a.out_first + e, quant::canonical_nan(v));
  }
}

// Block per (layer, column): the column of q becomes q_new's if that is usable (some
// value nonzero, none NaN or infinite), else q0's.
__global__ void __launch_bounds__(kThreads) keep_kernel(const __grid_constant__ Table table, const float* q_new,
                                                        const float* q0, float* q) {
  const uint32_t item = blockIdx.x;
  const TableLayer& l = table.layers[find_layer(table, item)];
  const uint64_t base = l.q_offset + (item - l.item_begin);
  bool usable = false, finite = true;
  for (uint64_t j = threadIdx.x; j < l.cols; j += kThreads) {
    const float v = q_new[base + j * l.rank];
    usable |= v != 0.0f;
    finite &= quant::is_finite_value(v);
  }
  usable = __syncthreads_or(usable);
  finite = __syncthreads_and(finite);
  const float* from = usable && finite ? q_new : q0;
  for (uint64_t j = threadIdx.x; j < l.cols; j += kThreads) q[base + j * l.rank] = from[base + j * l.rank];
}

struct Q0Args {
  uint64_t seed;
  uint64_t step;
  uint32_t layer_base;
  float* q0;
};

// Q0 (lowrank::initial_q): element (j, c) of a layer's cols x rank is word e mod 4 of the
// Philox block e / 4, e = j x 256 + c, as f32(word >> 8) x 2^-23 - 1 (exact: no rounding).
__global__ void __launch_bounds__(kThreads) initial_q_kernel(const __grid_constant__ Table table,
                                                             const __grid_constant__ Q0Args a) {
  const uint32_t item = blockIdx.x;
  const TableLayer& l = table.layers[find_layer(table, item)];
  const uint64_t k = static_cast<uint64_t>(item - l.item_begin) * plan::kQ0BlockElements + threadIdx.x;
  if (k >= static_cast<uint64_t>(l.cols) * l.rank) return;
  const uint64_t e = (k / l.rank) * kMaxRank + k % l.rank;
  const uint64_t block = e / 4;
  const PhiloxBlock words =
      philox4x32_10(static_cast<uint32_t>(block), a.layer_base + l.layer, static_cast<uint32_t>(a.step),
                    kInitialQStream | static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(a.seed),
                    static_cast<uint32_t>(a.seed >> 32));
  const uint32_t s = static_cast<uint32_t>(e % 4);
  const uint32_t word = s == 0 ? words.v[0] : s == 1 ? words.v[1] : s == 2 ? words.v[2] : words.v[3];
  a.q0[l.q_offset + k] = __fsub_rn(__fmul_rn(static_cast<float>(word >> 8), 0x1p-23f), 1.0f);
}

// The statistics, 1: per block, the sum of squares of its grid-stride share of M (float64)
// and whether all of it was finite.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const float* m, uint64_t n, double* partial,
                                                               uint32_t* nonfinite) {
  __shared__ Reducer<1> red;
  double part[1] = {0.0};
  bool finite = true;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t k = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; k < n; k += stride) {
    const double v = m[k];
    part[0] = __dadd_rn(part[0], __dmul_rn(v, v));
    finite &= quant::is_finite_value(m[k]);
  }
  block_sum(part, 1, red);
  const bool all_finite = __syncthreads_and(finite);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = part[0];
    nonfinite[blockIdx.x] = all_finite ? 0u : 1u;
  }
}

struct FinishArgs {
  const double* partial;
  const uint32_t* partial_nonfinite;
  uint32_t blocks;
  const float* b;  // cols x basis_rank, row-major: M^T P
  uint32_t cols;
  uint32_t basis_rank;
  uint32_t count;
  uint32_t ranks[kMaxMeasureRanks];
  uint32_t columns[kMaxMeasureRanks];
  uint32_t layer;
  uint32_t row_stride;
  double* squared;
  uint8_t* nonfinite;
  double weight;
};

// The statistics, 2 (one block): ||M||^2 from the partial sums in block order, each
// column's ||B[:, c]||^2, their prefix sums in column order (lowrank::squared_errors), and
// weight x max(0, ||M||^2 - captured[r]) added to each rank's column (+inf when M was not
// finite).
__global__ void __launch_bounds__(kThreads) measure_finish_kernel(const __grid_constant__ FinishArgs a) {
  __shared__ Reducer<kGroup> red;
  __shared__ double captured[kMaxRank + 1];
  double part[kGroup];
  part[0] = 0.0;
  bool nonfinite = false;
  for (uint32_t k = threadIdx.x; k < a.blocks; k += kThreads) {
    part[0] = __dadd_rn(part[0], a.partial[k]);
    nonfinite |= a.partial_nonfinite[k] != 0;
  }
  block_sum(part, 1, red);
  const double total = part[0];
  nonfinite = __syncthreads_or(nonfinite);
  const uint32_t r = a.basis_rank;
  for (uint32_t c0 = 0; c0 < r; c0 += kGroup) {
    const uint32_t g = min(kGroup, r - c0);
#pragma unroll
    for (uint32_t k = 0; k < kGroup; ++k) part[k] = 0.0;
    for (uint64_t j = threadIdx.x; j < a.cols; j += kThreads) {
#pragma unroll
      for (uint32_t k = 0; k < kGroup; ++k)
        if (k < g) {
          const double x = a.b[j * r + c0 + k];
          part[k] = __dadd_rn(part[k], __dmul_rn(x, x));
        }
    }
    block_sum(part, g, red);
    if (threadIdx.x == 0) {
#pragma unroll
      for (uint32_t k = 0; k < kGroup; ++k)
        if (k < g) captured[c0 + k + 1] = part[k];
    }
  }
  if (threadIdx.x != 0) return;
  captured[0] = 0.0;
  for (uint32_t c = 0; c < r; ++c) captured[c + 1] = __dadd_rn(captured[c], captured[c + 1]);
  for (uint32_t k = 0; k < a.count; ++k) {
    double e = __longlong_as_double(0x7ff0000000000000LL);  // +inf
    if (!nonfinite) {
      const double left = __dsub_rn(total, captured[a.ranks[k]]);
      e = 0.0 < left ? left : 0.0;  // std::max(0.0, left)
    }
    double& out = a.squared[static_cast<uint64_t>(a.layer) * a.row_stride + a.columns[k]];
    out = __dadd_rn(out, __dmul_rn(a.weight, e));
  }
  if (nonfinite) a.nonfinite[a.layer] = 1;
}

// ---------------------------------------------------------------------------------------
// Host

template <class T>
T* at_bytes(void* base, uint64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// M of a layer as float32 on the device: the input itself (float32, no residual), else a
// copy in `staging` made on the stream.
const float* matrix_of(const Layer& l, const Source& s, float* staging, cudaStream_t stream) {
  const void* input = static_cast<const char*>(s.input) + (l.offset - s.input_first) * dtype_size(s.input_dtype);
  if (!plan::staged(s.input_dtype, s.residual != nullptr)) return static_cast<const float*>(input);
  const float* residual = s.residual ? s.residual + (l.offset - s.residual_first) : nullptr;
  const uint8_t* flags = s.flags;
  const uint32_t layer = l.layer;
  const uint64_t n = l.rows * l.cols;
  const dim3 grid(static_cast<uint32_t>(std::min<uint64_t>((n + kThreads - 1) / kThreads, kStageBlocks)));
  const char* name = "the powersgd staging kernel";
  switch (s.input_dtype) {
    case DType::kFloat32:
      launch_kernel(stage_kernel<DType::kFloat32>, grid, kThreads, stream, name, input, residual, flags, layer, staging, n);
      break;
    case DType::kFloat16:
      launch_kernel(stage_kernel<DType::kFloat16>, grid, kThreads, stream, name, input, residual, flags, layer, staging, n);
      break;
    case DType::kBFloat16:
      launch_kernel(stage_kernel<DType::kBFloat16>, grid, kThreads, stream, name, input, residual, flags, layer, staging,
                    n);
      break;
  }
  return staging;
}

void launch_orthonormalize(std::span<const Layer> layers, float* p, double* work, cudaStream_t stream) {
  for (const Table& t : plan::tables(layers, Items::kLayers))
    launch_kernel(orthonormalize_kernel, dim3(t.count), kThreads, stream, "the powersgd Gram-Schmidt kernel", t, p,
                  work);
}

void launch_initial_q(std::span<const Layer> layers, const Q0Args& args, cudaStream_t stream) {
  for (const Table& t : plan::tables(layers, Items::kQ0Blocks))
    launch_kernel(initial_q_kernel, dim3(t.items), kThreads, stream, "the powersgd Q0 kernel", t, args);
}

template <DType T, bool kResidual>
void launch_tiles(const Table& t, const TileArgs& args, cudaStream_t stream) {
  launch_kernel(tile_kernel<T, kResidual>, dim3(t.items), kThreads, stream,
                kResidual ? "the powersgd residual kernel" : "the powersgd reconstruct kernel", t, args);
}

}  // namespace

bool available() { return true; }
std::string cublas_problem() { return cublas_api().error; }

Handle Handle::create(void* workspace, uint64_t workspace_bytes) {
  const char* what = "powersgd cuda Handle::create";
  plan::check_workspace(workspace, workspace_bytes, what);
  const Cublas& api = cublas_api();
  if (!api.error.empty()) throw CudaError(std::string("lgreco: ") + what + ": " + api.error);
  cublasHandle_t h = nullptr;
  check_cublas(api.create(&h), "cublasCreate", what);
  Handle out;
  out.cublas_ = h;  // destroyed by out's destructor if a step below throws
  out.workspace_ = workspace;
  out.workspace_bytes_ = workspace_bytes;
  // Float32 products and sums: no TF32 tensor cores, no BF16x9 emulation (those need
  // CUBLAS_TF32_TENSOR_OP_MATH / CUBLAS_FP32_EMULATED_BF16X9_MATH or a _FAST compute type).
  check_cublas(api.set_math_mode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode", what);
  check_cublas(api.set_pointer_mode(h, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode", what);
  check_cublas(api.set_workspace(h, workspace, workspace_bytes), "cublasSetWorkspace", what);
  check_cublas(api.get_version(h, &out.version_), "cublasGetVersion", what);
  return out;
}

void Handle::reset() {
  if (cublas_) {
    const Cublas& api = cublas_api();
    if (api.destroy) api.destroy(static_cast<cublasHandle_t>(cublas_));  // an error here cannot be acted on
  }
  cublas_ = nullptr;
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  version_ = 0;
}

void project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* q, float* p,
             const Scratch& scratch, Stream stream) {
  const char* what = "powersgd cuda project";
  if (!plan::check_project(handle, layers, source, q, p, scratch)) return;
  const cublasHandle_t h = bind(handle, stream, what);
  auto* staging = static_cast<float*>(scratch.data);
  for (const Layer& l : layers) {
    const float* m = matrix_of(l, source, staging, stream);
    gemm_project(h, l, l.rank, m, q + l.q_offset, p + l.p_offset, what);
  }
}

void orthonormalize(std::span<const Layer> layers, float* p, const Scratch& scratch, Stream stream) {
  if (!plan::check_orthonormalize(layers, p, scratch)) return;
  launch_orthonormalize(layers, p, static_cast<double*>(scratch.data), stream);
}

void back_project(Handle& handle, std::span<const Layer> layers, const Source& source, const float* p, float* q,
                  const Scratch& scratch, Stream stream) {
  const char* what = "powersgd cuda back_project";
  if (!plan::check_back_project(handle, layers, source, p, q, scratch)) return;
  const cublasHandle_t h = bind(handle, stream, what);
  auto* staging = static_cast<float*>(scratch.data);
  for (const Layer& l : layers) {
    const float* m = matrix_of(l, source, staging, stream);
    gemm_back_project(h, l, l.rank, m, p + l.p_offset, q + l.q_offset, what);
    if (!source.residual) continue;
    // M is staged (there is a residual); the flag is read on the device.
    const std::vector<Table> t = plan::tables(std::span<const Layer>(&l, 1), Items::kTiles);
    const TileArgs args{p, q, 1.0f, nullptr, 0, m, source.residual + (l.offset - source.residual_first), source.flags};
    launch_tiles<DType::kFloat32, true>(t.front(), args, stream);
  }
}

void reconstruct(std::span<const Layer> layers, const float* p, const float* q, float scale, const Output& out,
                 Stream stream) {
  if (!plan::check_reconstruct(layers, p, q, out)) return;
  const TileArgs args{p, q, scale, out.data, out.first, nullptr, nullptr, nullptr};
  for (const Table& t : plan::tables(layers, Items::kTiles)) {
    switch (out.dtype) {
      case DType::kFloat32: launch_tiles<DType::kFloat32, false>(t, args, stream); break;
      case DType::kFloat16: launch_tiles<DType::kFloat16, false>(t, args, stream); break;
      case DType::kBFloat16: launch_tiles<DType::kBFloat16, false>(t, args, stream); break;
    }
  }
}

void keep(std::span<const Layer> layers, const float* q_new, const float* q0, float* q, Stream stream) {
  if (!plan::check_keep(layers, q_new, q0, q)) return;
  for (const Table& t : plan::tables(layers, Items::kColumns))
    launch_kernel(keep_kernel, dim3(t.items), kThreads, stream, "the powersgd keep kernel", t, q_new, q0, q);
}

void initial_q(std::span<const Layer> layers, uint64_t seed, uint64_t step, uint32_t layer_base, float* q0,
               Stream stream) {
  if (!plan::check_initial_q(layers, q0)) return;
  launch_initial_q(layers, Q0Args{seed, step, layer_base, q0}, stream);
}

void squared_errors(Handle& handle, std::span<const Layer> layers, const Source& source, const Measure& m,
                    const Scratch& scratch, Stream stream) {
  const char* what = "powersgd cuda squared_errors";
  uint32_t basis_rank = 0;
  if (!plan::check_squared_errors(handle, layers, source, m, scratch, &basis_rank)) return;
  const cublasHandle_t h = bind(handle, stream, what);
  const bool is_staged = plan::staged(source.input_dtype, source.residual != nullptr);
  FinishArgs finish{};
  finish.count = static_cast<uint32_t>(m.ranks.size());
  std::copy(m.ranks.begin(), m.ranks.end(), finish.ranks);
  std::copy(m.columns.begin(), m.columns.end(), finish.columns);
  finish.row_stride = m.row_stride;
  finish.squared = m.squared;
  finish.nonfinite = m.nonfinite;
  finish.weight = m.weight;
  finish.basis_rank = basis_rank;
  for (const Layer& measured : plan::measured_layers(layers, m)) {
    // The layer at rank R, its factors at the start of their scratch pieces.
    Layer l = measured;
    l.rank = basis_rank;
    l.p_offset = 0;
    l.q_offset = 0;
    const std::span<const Layer> one(&l, 1);
    const plan::MeasureLayout x = plan::measure_layout(l, basis_rank, is_staged);
    float* basis = at_bytes<float>(scratch.data, x.basis);
    float* p = at_bytes<float>(scratch.data, x.p);
    float* b = at_bytes<float>(scratch.data, x.b);
    double* partial = at_bytes<double>(scratch.data, x.partial);
    uint32_t* partial_nonfinite = at_bytes<uint32_t>(scratch.data, x.flags);

    const float* mm = matrix_of(l, source, at_bytes<float>(scratch.data, x.m), stream);
    launch_initial_q(one, Q0Args{m.seed, m.step, m.layer_base, basis}, stream);
    gemm_project(h, l, basis_rank, mm, basis, p, what);
    launch_orthonormalize(one, p, at_bytes<double>(scratch.data, x.work), stream);
    gemm_back_project(h, l, basis_rank, mm, p, b, what);

    const uint64_t n = l.rows * l.cols;
    const uint32_t blocks = plan::sum_blocks(n);
    launch_kernel(sum_squares_kernel, dim3(blocks), plan::kSumThreads, stream, "the powersgd sum-of-squares kernel", mm,
                  n, partial, partial_nonfinite);
    finish.partial = partial;
    finish.partial_nonfinite = partial_nonfinite;
    finish.blocks = blocks;
    finish.b = b;
    finish.cols = static_cast<uint32_t>(l.cols);
    finish.layer = l.layer;
    launch_kernel(measure_finish_kernel, dim3(1), kThreads, stream, "the powersgd statistics kernel", finish);
  }
}

}  // namespace lgreco::lowrank::cuda
