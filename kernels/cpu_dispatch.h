// Runtime CPU dispatch for the hot loops of the CPU reference codecs.
//
// The library is built for baseline x86-64 (SSE2), so it loads on any x86-64 machine a
// cluster may have. Functions marked LGRECO_MULTIVERSION are compiled twice, for AVX2 and
// for the baseline, and the dynamic loader picks one at load time (GCC target_clones,
// resolved through an ifunc). Both clones give identical bits: the code uses only
// correctly rounded operations (add, sub, mul, div, floor, conversions), and FMA
// contraction is off (-ffp-contract=off), so wider vectors change speed, never results.
#pragma once

#if defined(__x86_64__) && !defined(LGRECO_NO_MULTIVERSION)
#define LGRECO_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define LGRECO_MULTIVERSION
#endif

// Loops called from a LGRECO_MULTIVERSION function must be inlined into it to be compiled
// for the clone's target; a separately emitted copy would run baseline code in both.
#define LGRECO_CLONE_INLINE inline __attribute__((always_inline))

// Which version of the hot loops this process runs, for benchmark and log headers.
inline const char* cpu_code_path() {
#if defined(__x86_64__) && !defined(LGRECO_NO_MULTIVERSION)
  return __builtin_cpu_supports("avx2") ? "AVX2 clone" : "baseline x86-64 clone";
#else
  return "single build, no runtime dispatch";
#endif
}
