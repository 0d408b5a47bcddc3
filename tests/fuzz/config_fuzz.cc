// libFuzzer target for the parsers that read what users write: registration files,
// parameter files and values, codec specs, and the bucket matcher (fed by a parsed
// registration, and by call sequences decoded from the input). The first byte picks the
// target: '0' registration, '1' parameters, '2' codec spec, '3' call sequence. Built and run by `make fuzz` (and briefly by `make test`); any input
// that crashed it once lives in tests/fuzz/corpus/ and is replayed every run.
//
// Every parser must either succeed with a result that keeps its invariants or throw its
// documented error type; anything else (a crash, another exception, a sanitizer report)
// is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "config/bucket_matcher.h"
#include "config/params.h"
#include "config/registration.h"

namespace {

using namespace lgreco;

[[noreturn]] void fail(const char* what) {
  fprintf(stderr, "config_fuzz: invariant broken: %s\n", what);
  abort();
}

void fuzz_registration(std::string_view text) {
  config::Registration r;
  try {
    r = config::parse_registration(text, "fuzz.json");
  } catch (const config::RegistrationError&) {
    return;
  }
  config::validate(r);  // must not throw for a parsed file
  for (const config::RegisteredBucket& b : r.buckets) {
    uint64_t next = 0;
    for (const config::RegisteredLayer& l : b.layers) {
      if (l.offset != next || l.numel == 0) fail("layers not contiguous");
      next += l.numel;
      config::layer_policy(l);
      config::low_rank_pays_off(l, 4);
    }
    if (next != b.count) fail("layers do not cover the bucket");
  }
  // Drive a matcher with calls derived from the buckets: two steps, addresses by index.
  auto shared = std::make_shared<const config::Registration>(r);
  config::BucketMatcher matcher(shared, config::MatcherSettings{});
  for (int step = 0; step < 3; ++step)
    for (size_t b = 0; b < r.buckets.size() && b < 64; ++b) {
      const config::Match m = matcher.match({0x1000 + b * 64, r.buckets[b].count, r.buckets[b].dtype});
      if (m.kind == config::Match::Kind::kRegistered && (m.bucket >= r.buckets.size() || !m.layout))
        fail("matched bucket out of range");
      if (m.kind == config::Match::Kind::kPassThrough && !m.reason) fail("pass-through without a reason");
    }
}

void fuzz_params(std::string_view text) {
  // The first line is an environment (NAME=VALUE;NAME=VALUE), the rest a parameter file.
  const size_t newline = text.find('\n');
  const std::string env_line(text.substr(0, newline));
  const std::string file(newline == std::string_view::npos ? "" : text.substr(newline + 1));
  config::ParamSources sources;
  for (size_t begin = 0; begin <= env_line.size();) {
    size_t end = env_line.find(';', begin);
    if (end == std::string::npos) end = env_line.size();
    const std::string item = env_line.substr(begin, end - begin);
    const size_t eq = item.find('=');
    if (eq != std::string::npos) sources.environment.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    begin = end + 1;
  }
  sources.home = "/home/fuzz";
  sources.read_file = [&](const std::string& path, bool* missing, std::string*) -> std::optional<std::string> {
    if (path == "/home/fuzz/.lgreco.conf") return file;
    *missing = true;
    return std::nullopt;
  };
  const config::Params p = config::load_params(sources);
  if (p.entries.size() != config::param_table().size()) fail("entries do not match the table");
  if (p.candidates.empty()) fail("no candidates");
  bool has_default = false;
  for (const CodecSpec& c : p.candidates) has_default = has_default || c == p.codec;
  if (!has_default) fail("the default codec is not a candidate");
  std::string path, error;
  config::expand_path_pattern(std::string(text.substr(0, 64)), "hpr", 3, &path, &error);
}

// Calls decoded from the bytes (two per call: buffer and size), through an auto-mode
// matcher and a registered-mode one, checking what every Match promises.
void fuzz_matcher(std::string_view bytes) {
  const uint64_t sizes[] = {2048, 3000, 4096, 5000, 8192, 8192 + 1024, 70000, 1};
  auto registration = std::make_shared<config::Registration>();
  for (uint64_t count : {4096, 8192, 4096, 70000}) {
    config::RegisteredBucket b;
    b.count = count;
    b.layers.push_back({"l" + std::to_string(registration->buckets.size()), 0, count, {count}, true, {}});
    registration->buckets.push_back(b);
  }
  config::MatcherSettings settings;
  settings.min_bytes = 8192;
  settings.segment_bytes = 4096;
  config::BucketMatcher automatic(nullptr, settings), registered(registration, settings);
  uint64_t last_auto = 0, last_registered = 0;
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    const config::CallKey call{0x1000u + (static_cast<uint8_t>(bytes[i]) % 16) * 0x100u,
                               sizes[static_cast<uint8_t>(bytes[i + 1]) % 8], DType::kFloat32};
    for (auto* m : {&automatic, &registered}) {
      const config::Match r = m->match(call);
      uint64_t& last = m == &automatic ? last_auto : last_registered;
      if (r.step < last) fail("step went backwards");
      last = r.step;
      if (r.kind == config::Match::Kind::kPassThrough) {
        if (!r.reason || r.layout) fail("pass-through without a reason, or with a layout");
        continue;
      }
      if (!r.layout || r.layout->count != call.count || r.layout->dtype != call.dtype) fail("layout of another size");
      if (r.kind == config::Match::Kind::kRegistered && r.layout != &registration->buckets[r.bucket])
        fail("registered layout is not the bucket's");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: fuzz_registration(text); break;
    case 1: fuzz_params(text); break;
    case 2:
      try {
        CodecSpec::parse(text);
      } catch (const CodecError&) {
      }
      break;
    case 3: fuzz_matcher(text); break;
  }
  return 0;
}
