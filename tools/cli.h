// Small helpers shared by the command-line tools: strict number parsing, whole-file I/O
// with errors that name the file, and the usage/error exit convention
// (0 success, 1 runtime error, 2 usage error).
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lgreco::cli {

// A mistake in the command line: reported with a hint to --help, exit code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Walks argv: `while (args.next())` visits each argument; value() takes the one after an
// option that needs a value, or reports that it is missing.
class Args {
 public:
  Args(int argc, char** argv, int first) : argc_(argc), argv_(argv), next_(first) {}
  bool next() {
    if (next_ >= argc_) return false;
    current_ = argv_[next_++];
    return true;
  }
  const std::string& arg() const { return current_; }
  bool is_help() const { return current_ == "--help" || current_ == "-h"; }
  std::string value() {
    if (next_ >= argc_) throw UsageError(current_ + " needs a value");
    return argv_[next_++];
  }

 private:
  int argc_;
  char** argv_;
  int next_;
  std::string current_;
};

// Decimal or 0x-hex unsigned integer, the whole string, no sign, no overflow.
inline uint64_t parse_u64(std::string_view option, const std::string& text) {
  const char* s = text.c_str();
  if (text.empty() || text[0] == '-' || text[0] == '+' || text[0] == ' ')
    throw UsageError(std::string(option) + " expects an unsigned integer, got '" + text + "'");
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = strtoull(s, &end, 0);
  if (errno != 0 || end == s || *end != '\0')
    throw UsageError(std::string(option) + " expects an unsigned integer, got '" + text + "'");
  return v;
}

inline uint32_t parse_u32(std::string_view option, const std::string& text) {
  const uint64_t v = parse_u64(option, text);
  if (v > UINT32_MAX) throw UsageError(std::string(option) + " is out of range (at most 4294967295): " + text);
  return static_cast<uint32_t>(v);
}

// An int in [min, max].
inline int parse_int(std::string_view option, const std::string& text, int min, int max) {
  const uint64_t v = parse_u64(option, text);
  if (v < static_cast<uint64_t>(min) || v > static_cast<uint64_t>(max))
    throw UsageError(std::string(option) + " must be between " + std::to_string(min) + " and " +
                     std::to_string(max) + ", got " + text);
  return static_cast<int>(v);
}

// A byte count with an optional K, M or G suffix (powers of 1024), at most `max_bytes`.
inline uint64_t parse_size(std::string_view option, const std::string& text, uint64_t max_bytes) {
  uint64_t scale = 1;
  std::string digits = text;
  if (!text.empty()) {
    const char s = text.back();
    scale = s == 'K' || s == 'k' ? 1ull << 10 : s == 'M' || s == 'm' ? 1ull << 20 : s == 'G' || s == 'g' ? 1ull << 30 : 1;
    if (scale != 1) digits.pop_back();
  }
  const uint64_t v = parse_u64(option, digits);
  if (v > max_bytes / scale || v * scale > max_bytes)
    throw UsageError(std::string(option) + " is too large (at most " + std::to_string(max_bytes >> 30) + "G): " + text);
  return v * scale;
}

// Everything left in an open stream; `name` is for the error message.
inline std::vector<uint8_t> read_all(FILE* f, const std::string& name) {
  std::vector<uint8_t> data;
  uint8_t chunk[1 << 16];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) data.insert(data.end(), chunk, chunk + n);
  if (ferror(f)) throw std::runtime_error("cannot read " + name + ": " + strerror(errno));
  return data;
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open '" + path + "': " + strerror(errno));
  try {
    std::vector<uint8_t> data = read_all(f, "'" + path + "'");
    fclose(f);
    return data;
  } catch (...) {
    fclose(f);
    throw;
  }
}

inline void write_file(const std::string& path, const void* data, size_t size) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot create '" + path + "': " + strerror(errno));
  const bool ok = (size == 0 || fwrite(data, 1, size, f) == size);
  const int saved = errno;
  if (fclose(f) != 0 || !ok) {
    remove(path.c_str());
    throw std::runtime_error("cannot write '" + path + "': " + strerror(ok ? errno : saved));
  }
}

// A raw little-endian float32 file.
inline std::vector<float> read_f32(const std::string& path) {
  const std::vector<uint8_t> bytes = read_file(path);
  if (bytes.size() % 4 != 0)
    throw std::runtime_error("'" + path + "': size " + std::to_string(bytes.size()) +
                             " bytes is not a multiple of 4 (raw little-endian float32 expected)");
  std::vector<float> values(bytes.size() / 4);
  if (!bytes.empty()) memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

// "25,557,032": a count with thousands separators, for tables people read.
inline std::string thousands(uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string s;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s.push_back(',');
    s.push_back(digits[i]);
  }
  return s;
}

// Monotonic wall-clock seconds, for timing.
inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs a tool's body and turns exceptions into the exit convention: a UsageError prints
// a hint to --help and exits 2, anything else prints "error: ..." and exits 1.
template <typename Body>
int guarded_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    fprintf(stderr, "%s: %s\nTry '%s --help'.\n", program, e.what(), program);
    return 2;
  } catch (const std::bad_alloc&) {
    fprintf(stderr, "%s: error: out of memory\n", program);
    return 1;
  } catch (const std::exception& e) {
    fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace lgreco::cli
