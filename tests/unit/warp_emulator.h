// A deterministic, single-threaded emulation of one 32-lane CUDA warp, so that the warp
// programs of kernels/quant_warp.h (templates over a warp policy W) run unchanged on the
// CPU and can be compared with the CPU reference on a machine without a GPU.
//
// Each lane is a ucontext with its own stack. A lane runs until it reaches a collective
// (ballot or XOR-shuffle), records its contribution and passes control to the next lane;
// after lane 31 control returns to the runner, which checks that all 32 lanes wait at the
// same kind of collective with the same operands that must be uniform, computes every
// lane's result and starts the next round. Lanes always run in order 0..31, so a run is
// fully deterministic.
//
// What the hardware would make undefined or deadlock is reported as a WarpDivergence
// exception from run_warp(): lanes at different kinds of collective (or a float and a
// uint32 shuffle at once), shuffles with different masks or a mask outside 0..31, and
// some lanes finished while others wait at a collective. An exception thrown by the
// program inside a lane is caught in that lane (it must not unwind across swapcontext)
// and rethrown by run_warp() after the round.
//
// Not emulated: partial-warp masks (the programs always use the full mask) and anything
// about timing or memory ordering between lanes (the programs do not communicate through
// memory within a warp).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

namespace lgreco::test {

class WarpEmulator;

class WarpDivergence : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// The warp policy handed to the programs (the W of kernels/quant_warp.h).
class EmulatedWarp {
 public:
  EmulatedWarp(WarpEmulator* emulator, uint32_t lane) : emulator_(emulator), lane_(lane) {}
  uint32_t lane() const { return lane_; }
  uint32_t ballot(bool p) const;
  float shfl_xor(float v, int mask) const;
  uint32_t shfl_xor(uint32_t v, int mask) const;

 private:
  WarpEmulator* emulator_;
  uint32_t lane_;
};

class WarpEmulator {
 public:
  static constexpr uint32_t kLanes = 32;
  // Far more than the programs need (a few KiB at -O0); a guard page below each stack
  // turns an overflow into a crash instead of silent corruption of the next lane's stack.
  static constexpr size_t kStackBytes = 256 * 1024;

  WarpEmulator() {
    page_ = 4096;
    const size_t total = kLanes * (kStackBytes + page_);
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("warp emulator: cannot map the lane stacks");
    stacks_ = static_cast<char*>(p);
    for (uint32_t l = 0; l < kLanes; ++l) mprotect(stacks_ + l * (kStackBytes + page_), page_, PROT_NONE);
  }
  ~WarpEmulator() { munmap(stacks_, kLanes * (kStackBytes + page_)); }
  WarpEmulator(const WarpEmulator&) = delete;
  WarpEmulator& operator=(const WarpEmulator&) = delete;

  // Runs `program` on all 32 lanes to completion. Throws WarpDivergence (see above) or
  // the first exception (by lane) that the program threw.
  void run_warp(const std::function<void(const EmulatedWarp&)>& program) {
    program_ = &program;
    for (uint32_t l = 0; l < kLanes; ++l) {
      lanes_[l] = Lane{};
      getcontext(&lanes_[l].context);
      lanes_[l].context.uc_stack.ss_sp = stacks_ + l * (kStackBytes + page_) + page_;
      lanes_[l].context.uc_stack.ss_size = kStackBytes;
      lanes_[l].context.uc_link = nullptr;  // entry() never returns; it switches away
      // makecontext passes int arguments: the emulator's address in two halves.
      const auto self = reinterpret_cast<uintptr_t>(this);
      makecontext(&lanes_[l].context, reinterpret_cast<void (*)()>(&WarpEmulator::entry), 3,
                  static_cast<uint32_t>(self), static_cast<uint32_t>(uint64_t{self} >> 32), l);
    }
    for (uint64_t round = 0;; ++round) {
      swapcontext(&runner_, &lanes_[0].context);  // lanes 0..31 run one segment each
      for (const Lane& lane : lanes_)
        if (lane.error) std::rethrow_exception(lane.error);
      uint32_t finished = 0;
      for (const Lane& lane : lanes_) finished += lane.state == State::kFinished ? 1 : 0;
      if (finished == kLanes) return;
      if (finished > 0)
        fail(round, std::to_string(finished) + " lanes finished while " + std::to_string(kLanes - finished) +
                        " wait at a collective");
      resolve(round);
    }
  }

 private:
  friend class EmulatedWarp;
  enum class State : uint8_t { kRunning, kBallot, kShflFloat, kShflU32, kFinished };
  struct Lane {
    ucontext_t context;
    State state = State::kRunning;
    int mask = 0;           // shuffles
    uint32_t value = 0;     // this lane's operand (bits of a float)
    uint32_t result = 0;
    std::exception_ptr error;
  };

  static const char* state_name(State s) {
    switch (s) {
      case State::kRunning: return "running";
      case State::kBallot: return "ballot";
      case State::kShflFloat: return "shfl_xor(float)";
      case State::kShflU32: return "shfl_xor(uint32)";
      case State::kFinished: return "finished";
    }
    return "?";
  }

  [[noreturn]] static void fail(uint64_t round, const std::string& what) {
    throw WarpDivergence("warp emulator: divergence at collective " + std::to_string(round) + ": " + what);
  }

  // The lane that runs after `lane` within a round, or the runner after the last.
  ucontext_t* next_after(uint32_t lane) { return lane + 1 < kLanes ? &lanes_[lane + 1].context : &runner_; }

  static void entry(uint32_t self_low, uint32_t self_high, uint32_t lane) {
    auto* self = reinterpret_cast<WarpEmulator*>(uintptr_t{self_low} | uintptr_t{self_high} << 32);
    try {
      (*self->program_)(EmulatedWarp(self, lane));
    } catch (...) {
      self->lanes_[lane].error = std::current_exception();
    }
    self->lanes_[lane].state = State::kFinished;
    // Never resumed: run_warp() either returns or throws once a lane has finished.
    setcontext(self->next_after(lane));
  }

  // Called on a lane's stack: record the contribution, let the other lanes run, and
  // return this lane's result once the runner has resolved the collective.
  uint32_t collective(uint32_t lane, State kind, uint32_t value, int mask) {
    Lane& me = lanes_[lane];
    me.state = kind;
    me.value = value;
    me.mask = mask;
    swapcontext(&me.context, next_after(lane));
    me.state = State::kRunning;
    return me.result;
  }

  void resolve(uint64_t round) {
    const Lane& first = lanes_[0];
    for (uint32_t l = 1; l < kLanes; ++l) {
      if (lanes_[l].state != first.state)
        fail(round, std::string("lane 0 is at ") + state_name(first.state) + ", lane " + std::to_string(l) +
                        " at " + state_name(lanes_[l].state));
      if (first.state != State::kBallot && lanes_[l].mask != first.mask)
        fail(round, "shuffle masks differ: lane 0 " + std::to_string(first.mask) + ", lane " + std::to_string(l) +
                        " " + std::to_string(lanes_[l].mask));
    }
    if (first.state == State::kBallot) {
      uint32_t bits = 0;
      for (uint32_t l = 0; l < kLanes; ++l) bits |= (lanes_[l].value & 1u) << l;
      for (Lane& lane : lanes_) lane.result = bits;
    } else {
      if (first.mask < 0 || first.mask >= static_cast<int>(kLanes))
        fail(round, "shuffle mask " + std::to_string(first.mask) + " outside 0..31");
      for (uint32_t l = 0; l < kLanes; ++l) lanes_[l].result = lanes_[l ^ static_cast<uint32_t>(first.mask)].value;
    }
  }

  char* stacks_ = nullptr;
  size_t page_ = 0;
  Lane lanes_[kLanes];
  ucontext_t runner_;
  const std::function<void(const EmulatedWarp&)>* program_ = nullptr;
};

inline uint32_t EmulatedWarp::ballot(bool p) const {
  return emulator_->collective(lane_, WarpEmulator::State::kBallot, p ? 1u : 0u, 0);
}
inline float EmulatedWarp::shfl_xor(float v, int mask) const {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);  // NaN payloads travel unchanged, as on the hardware
  bits = emulator_->collective(lane_, WarpEmulator::State::kShflFloat, bits, mask);
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}
inline uint32_t EmulatedWarp::shfl_xor(uint32_t v, int mask) const {
  return emulator_->collective(lane_, WarpEmulator::State::kShflU32, v, mask);
}

// One emulator per thread, created on first use (its 8 MiB of stacks are reused).
inline void run_warp(const std::function<void(const EmulatedWarp&)>& program) {
  thread_local WarpEmulator emulator;
  emulator.run_warp(program);
}

}  // namespace lgreco::test
