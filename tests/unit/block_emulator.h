// A deterministic, single-threaded emulation of CUDA thread blocks, so that kernels
// written for it (kernels/topk_kernels.cuh) run unchanged on the CPU and can be compared
// with the CPU reference on a machine without a GPU.
//
// Include this header before the kernels: it defines the CUDA vocabulary they use
// (__global__, __shared__ as a function-local static, threadIdx/blockIdx/gridDim, uint2,
// __syncthreads, __syncthreads_or, __ballot_sync, __all_sync, __shfl_sync,
// __shfl_xor_sync, __shfl_up_sync, __popc, atomicAdd).
//
// BlockEmulator::launch runs a kernel's blocks one after another; within a block every
// thread is a ucontext with its own stack. A thread runs until it reaches a collective
// (a barrier, or a warp-wide vote or shuffle) and hands control back to the runner, which
// resolves each warp whose 32 lanes all wait at the same kind of warp collective, and a
// barrier once all the block's threads wait there. Threads always run in index order, so
// a run is reproducible. What the hardware would deadlock on or leave undefined throws
// BlockDivergence: lanes of one warp at different collectives (or some finished), a
// barrier that not every thread reaches, a partial mask. Shared memory is shared by all
// threads of the block (and, being a static, by later blocks: kernels must initialise it,
// as on the hardware). Atomics are plain read-modify-writes: threads switch only at
// collectives.
//
// Not emulated: memory ordering and races between threads (a thread runs alone between
// two collectives, which is one legal interleaving, not all of them), timing, partial
// warps (blocks are whole warps).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace lgreco::test {

class BlockDivergence : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

struct EmulatedDim3 {
  uint32_t x = 0, y = 0, z = 0;
};

class BlockEmulator {
 public:
  static constexpr uint32_t kLanes = 32;
  static constexpr uint32_t kMaxThreads = 256;
  static constexpr size_t kStackBytes = 256 * 1024;

  BlockEmulator() {
    page_ = 4096;
    const size_t total = kMaxThreads * (kStackBytes + page_);
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("block emulator: cannot map the thread stacks");
    stacks_ = static_cast<char*>(p);
    for (uint32_t t = 0; t < kMaxThreads; ++t) mprotect(stacks_ + t * (kStackBytes + page_), page_, PROT_NONE);
  }
  ~BlockEmulator() { munmap(stacks_, kMaxThreads * (kStackBytes + page_)); }
  BlockEmulator(const BlockEmulator&) = delete;
  BlockEmulator& operator=(const BlockEmulator&) = delete;

  // Runs kernel(params...) on `grid` blocks of `threads` threads (a multiple of 32, at most
  // kMaxThreads). Throws BlockDivergence or the first exception a thread threw.
  template <class... P>
  void launch(void (*kernel)(P...), uint32_t grid, uint32_t threads, const P&... params) {
    if (threads == 0 || threads % kLanes != 0 || threads > kMaxThreads)
      throw std::logic_error("block emulator: blocks of " + std::to_string(threads) + " threads");
    const std::function<void()> body = [&] { kernel(params...); };
    for (uint32_t b = 0; b < grid; ++b) run_block(body, b, grid, threads);
  }

  // The emulator whose block is running (kernels reach it through the CUDA vocabulary).
  static BlockEmulator& current() {
    if (current_ == nullptr) throw std::logic_error("block emulator: CUDA vocabulary used outside a launch");
    return *current_;
  }
  uint32_t thread() const { return running_; }
  uint32_t block() const { return block_; }
  uint32_t grid() const { return grid_; }
  uint32_t block_threads() const { return threads_; }

  enum class Kind : uint8_t { kRunning, kSync, kSyncOr, kBallot, kAll, kShfl, kShflXor, kShflUp, kFinished };

  // Called on a thread's stack: record, yield to the runner, return the resolved result.
  uint64_t collective(Kind kind, uint64_t value, int32_t arg, uint32_t mask) {
    Thread& me = threads_state_[running_];
    me.kind = kind;
    me.value = value;
    me.arg = arg;
    me.mask = mask;
    swapcontext(&me.context, &runner_);
    me.kind = Kind::kRunning;
    return me.result;
  }

 private:
  struct Thread {
    ucontext_t context;
    Kind kind = Kind::kRunning;
    uint64_t value = 0;
    int32_t arg = 0;
    uint32_t mask = 0;
    uint64_t result = 0;
    std::exception_ptr error;
  };

  static const char* kind_name(Kind k) {
    switch (k) {
      case Kind::kRunning: return "running";
      case Kind::kSync: return "__syncthreads";
      case Kind::kSyncOr: return "__syncthreads_or";
      case Kind::kBallot: return "__ballot_sync";
      case Kind::kAll: return "__all_sync";
      case Kind::kShfl: return "__shfl_sync";
      case Kind::kShflXor: return "__shfl_xor_sync";
      case Kind::kShflUp: return "__shfl_up_sync";
      case Kind::kFinished: return "finished";
    }
    return "?";
  }
  static bool is_warp(Kind k) { return k == Kind::kBallot || k == Kind::kAll || k == Kind::kShfl || k == Kind::kShflXor || k == Kind::kShflUp; }
  static bool is_barrier(Kind k) { return k == Kind::kSync || k == Kind::kSyncOr; }

  [[noreturn]] void fail(const std::string& what) const {
    throw BlockDivergence("block emulator: block " + std::to_string(block_) + " of " + std::to_string(grid_) + ": " + what);
  }

  static void entry(uint32_t self_low, uint32_t self_high) {
    auto* self = reinterpret_cast<BlockEmulator*>(uintptr_t{self_low} | uintptr_t{self_high} << 32);
    Thread& me = self->threads_state_[self->running_];
    try {
      (*self->body_)();
    } catch (...) {
      me.error = std::current_exception();
    }
    me.kind = Kind::kFinished;
    setcontext(&self->runner_);  // never resumed
  }

  void run_block(const std::function<void()>& body, uint32_t block, uint32_t grid, uint32_t threads) {
    body_ = &body;
    block_ = block;
    grid_ = grid;
    threads_ = threads;
    threads_state_.assign(threads, Thread{});
    const auto self = reinterpret_cast<uintptr_t>(this);
    for (uint32_t t = 0; t < threads; ++t) {
      Thread& th = threads_state_[t];
      getcontext(&th.context);
      th.context.uc_stack.ss_sp = stacks_ + t * (kStackBytes + page_) + page_;
      th.context.uc_stack.ss_size = kStackBytes;
      th.context.uc_link = nullptr;
      makecontext(&th.context, reinterpret_cast<void (*)()>(&BlockEmulator::entry), 2, static_cast<uint32_t>(self),
                  static_cast<uint32_t>(uint64_t{self} >> 32));
    }
    BlockEmulator* previous = current_;
    current_ = this;
    struct Restore {
      BlockEmulator*& slot;
      BlockEmulator* value;
      ~Restore() { slot = value; }
    } restore{current_, previous};
    for (;;) {
      for (uint32_t t = 0; t < threads; ++t) {
        if (threads_state_[t].kind != Kind::kRunning) continue;
        running_ = t;
        swapcontext(&runner_, &threads_state_[t].context);
        if (threads_state_[t].error) std::rethrow_exception(threads_state_[t].error);
      }
      if (!resolve()) return;  // every thread finished
    }
  }

  // Resolves what can be; false when every thread has finished. Throws on a deadlock.
  bool resolve() {
    const uint32_t threads = threads_;
    bool progress = false;
    uint32_t finished = 0, at_barrier = 0;
    for (uint32_t w = 0; w < threads / kLanes; ++w) {
      Thread* lanes = &threads_state_[w * kLanes];
      const Kind k = lanes[0].kind;
      bool any_warp = false;
      for (uint32_t l = 0; l < kLanes; ++l) any_warp = any_warp || is_warp(lanes[l].kind);
      if (any_warp) {
        for (uint32_t l = 0; l < kLanes; ++l) {
          if (lanes[l].kind != k)
            fail("warp " + std::to_string(w) + ": lane 0 at " + kind_name(k) + ", lane " + std::to_string(l) + " at " +
                 kind_name(lanes[l].kind));
          if (lanes[l].mask != 0xffffffffu) fail("warp " + std::to_string(w) + ": a partial mask in " + kind_name(k));
        }
        resolve_warp(lanes, k, w);
        progress = true;
      }
      for (uint32_t l = 0; l < kLanes; ++l) {
        finished += lanes[l].kind == Kind::kFinished;
        at_barrier += is_barrier(lanes[l].kind);
      }
    }
    if (progress) return true;
    if (finished == threads) return false;
    if (at_barrier == threads) {
      const Kind k = threads_state_[0].kind;
      uint64_t any = 0;
      for (uint32_t t = 0; t < threads; ++t) {
        if (threads_state_[t].kind != k)
          fail(std::string("thread 0 at ") + kind_name(k) + ", thread " + std::to_string(t) + " at " +
               kind_name(threads_state_[t].kind));
        any |= threads_state_[t].value != 0;
      }
      for (uint32_t t = 0; t < threads; ++t) {
        threads_state_[t].result = any;
        threads_state_[t].kind = Kind::kRunning;
      }
      return true;
    }
    fail(std::to_string(finished) + " threads finished, " + std::to_string(at_barrier) + " wait at a barrier and " +
         std::to_string(threads - finished - at_barrier) + " elsewhere: a barrier not every thread reaches");
  }

  void resolve_warp(Thread* lanes, Kind k, uint32_t w) {
    uint64_t result[kLanes];
    if (k == Kind::kBallot || k == Kind::kAll) {
      uint32_t bits = 0;
      for (uint32_t l = 0; l < kLanes; ++l) bits |= static_cast<uint32_t>(lanes[l].value != 0) << l;
      for (uint32_t l = 0; l < kLanes; ++l) result[l] = k == Kind::kBallot ? bits : (bits == 0xffffffffu ? 1 : 0);
    } else {
      for (uint32_t l = 0; l < kLanes; ++l) {
        const int32_t a = lanes[l].arg;
        uint32_t src = l;
        if (k == Kind::kShfl) {
          src = static_cast<uint32_t>(a) % kLanes;
        } else if (k == Kind::kShflXor) {
          if (a < 0 || a >= static_cast<int32_t>(kLanes)) fail("warp " + std::to_string(w) + ": xor mask out of range");
          src = l ^ static_cast<uint32_t>(a);
        } else if (l >= static_cast<uint32_t>(a)) {
          src = l - static_cast<uint32_t>(a);  // shfl_up: lanes below delta keep their own
        }
        result[l] = lanes[src].value;
      }
    }
    for (uint32_t l = 0; l < kLanes; ++l) {
      lanes[l].result = result[l];
      lanes[l].kind = Kind::kRunning;
    }
  }

  char* stacks_ = nullptr;
  size_t page_ = 0;
  std::vector<Thread> threads_state_;
  ucontext_t runner_;
  const std::function<void()>* body_ = nullptr;
  uint32_t running_ = 0, block_ = 0, grid_ = 0, threads_ = 0;
  static inline BlockEmulator* current_ = nullptr;
};

}  // namespace lgreco::test

// ---------------------------------------------------------------------------------------
// The CUDA vocabulary, for kernels compiled by the host compiler.

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

// CUDA's layout (vector_types.h): two unsigned ints, 8-byte aligned.
struct alignas(8) uint2 {
  unsigned int x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }

#define threadIdx (::lgreco::test::EmulatedDim3{::lgreco::test::BlockEmulator::current().thread(), 0, 0})
#define blockIdx (::lgreco::test::EmulatedDim3{::lgreco::test::BlockEmulator::current().block(), 0, 0})
#define gridDim (::lgreco::test::EmulatedDim3{::lgreco::test::BlockEmulator::current().grid(), 1, 1})
#define blockDim (::lgreco::test::EmulatedDim3{::lgreco::test::BlockEmulator::current().block_threads(), 1, 1})

namespace lgreco::test::emulated {
using K = BlockEmulator::Kind;
inline uint64_t call(K kind, uint64_t value, int32_t arg, uint32_t mask) {
  return BlockEmulator::current().collective(kind, value, arg, mask);
}
template <class V>
uint64_t bits_of(V v) {
  static_assert(sizeof(V) <= 8);
  uint64_t b = 0;
  memcpy(&b, &v, sizeof v);
  return b;
}
template <class V>
V from_bits(uint64_t b) {
  V v;
  memcpy(&v, &b, sizeof v);
  return v;
}
}  // namespace lgreco::test::emulated

inline void __syncthreads() { lgreco::test::emulated::call(lgreco::test::emulated::K::kSync, 0, 0, 0xffffffffu); }
inline int __syncthreads_or(int p) {
  return static_cast<int>(lgreco::test::emulated::call(lgreco::test::emulated::K::kSyncOr, p != 0, 0, 0xffffffffu));
}
inline uint32_t __ballot_sync(uint32_t mask, int p) {
  return static_cast<uint32_t>(lgreco::test::emulated::call(lgreco::test::emulated::K::kBallot, p != 0, 0, mask));
}
inline int __all_sync(uint32_t mask, int p) {
  return static_cast<int>(lgreco::test::emulated::call(lgreco::test::emulated::K::kAll, p != 0, 0, mask));
}
template <class V>
V __shfl_sync(uint32_t mask, V v, int lane) {
  namespace e = lgreco::test::emulated;
  return e::from_bits<V>(e::call(e::K::kShfl, e::bits_of(v), lane, mask));
}
template <class V>
V __shfl_xor_sync(uint32_t mask, V v, int lane_mask) {
  namespace e = lgreco::test::emulated;
  return e::from_bits<V>(e::call(e::K::kShflXor, e::bits_of(v), lane_mask, mask));
}
template <class V>
V __shfl_up_sync(uint32_t mask, V v, uint32_t delta) {
  namespace e = lgreco::test::emulated;
  return e::from_bits<V>(e::call(e::K::kShflUp, e::bits_of(v), static_cast<int32_t>(delta), mask));
}
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
inline uint32_t atomicAdd(uint32_t* p, uint32_t v) {
  const uint32_t old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
