// Strict reading of JSON documents that people write by hand or generate with scripts
// (problem files, registration files): duplicate keys, unknown keys, NaN/Infinity and
// fractional counts are errors, and every error names the JSON path of the field
// ("buckets[2].layers[0] (fc.weight).numel: ...").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace lgreco::config {

// What every function here throws; the message names the field or the text position.
class JsonError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

using nlohmann::json;

inline constexpr int kMaxJsonDepth = 32;

// Parses a whole document. Syntax errors name the line, column and the key being read;
// a duplicate key is an error (nlohmann would keep the last value silently), and so is
// nesting deeper than kMaxJsonDepth.
json parse_strict_json(std::string_view text);

// "a.b" (or "b" at the root).
std::string json_path(const std::string& path, std::string_view key);

void expect_object(const json& value, const std::string& path);
// Rejects any key not in `allowed`, listing the allowed ones.
void expect_keys(const json& object, const std::string& path, std::initializer_list<std::string_view> allowed);

// Field readers: a missing field is an error unless a fallback is given. `expected` says
// what is accepted, for the message.
const json* find_field(const json& object, std::string_view key, const std::string& path, bool required);
double number_field(const json& object, std::string_view key, const std::string& path,
                    std::optional<double> fallback, const char* expected);
// A non-negative integer; 1234.0 is accepted (numpy floats print that way).
uint64_t unsigned_field(const json& object, std::string_view key, const std::string& path,
                        std::optional<uint64_t> fallback);
std::string string_field(const json& object, std::string_view key, const std::string& path,
                         std::optional<std::string> fallback);
const json& array_field(const json& object, std::string_view key, const std::string& path);

// A JSON value as a message quotes it.
std::string json_shown(const json& value);

}  // namespace lgreco::config
