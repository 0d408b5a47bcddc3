#include "config/json_strict.h"

#include <cmath>
#include <set>
#include <vector>

namespace lgreco::config {

std::string json_path(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

// The value of a number as the message shows it.
// Arrays and objects by their type only, and long values cut: messages stay one line.
std::string json_shown(const json& value) {
  if (value.is_structured()) return std::string("an ") + value.type_name();
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

void expect_object(const json& value, const std::string& path) {
  if (!value.is_object())
    throw JsonError((path.empty() ? "the document" : path) + ": expected an object, got " + value.type_name());
}

void expect_keys(const json& object, const std::string& path, std::initializer_list<std::string_view> allowed) {
  for (const auto& item : object.items()) {
    bool known = false;
    for (std::string_view k : allowed) known = known || item.key() == k;
    if (!known) {
      std::string list;
      for (std::string_view k : allowed) list += (list.empty() ? "" : ", ") + std::string(k);
      throw JsonError(json_path(path, item.key()) + ": unknown key (expected one of: " + list + ")");
    }
  }
}

const json* find_field(const json& object, std::string_view key, const std::string& path, bool required) {
  const auto it = object.find(key);
  if (it == object.end()) {
    if (required) throw JsonError(json_path(path, key) + ": missing");
    return nullptr;
  }
  return &*it;
}

double number_field(const json& object, std::string_view key, const std::string& path, std::optional<double> fallback,
                 const char* expected) {
  const json* v = find_field(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (!v->is_number()) throw JsonError(json_path(path, key) + ": " + json_shown(*v) + "; expected " + expected);
  return v->get<double>();
}

uint64_t unsigned_field(const json& object, std::string_view key, const std::string& path,
                     std::optional<uint64_t> fallback) {
  const json* v = find_field(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (v->is_number_unsigned()) return v->get<uint64_t>();
  // 1234.0 is a whole number too (numpy floats print that way).
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d >= 0 && d <= 9007199254740992.0 && std::floor(d) == d) return static_cast<uint64_t>(d);
  }
  throw JsonError(json_path(path, key) + ": " + json_shown(*v) + "; expected a non-negative integer");
}

std::string string_field(const json& object, std::string_view key, const std::string& path,
                      std::optional<std::string> fallback) {
  const json* v = find_field(object, key, path, !fallback.has_value());
  if (!v) return *fallback;
  if (!v->is_string()) throw JsonError(json_path(path, key) + ": " + json_shown(*v) + "; expected a string");
  return v->get<std::string>();
}

const json& array_field(const json& object, std::string_view key, const std::string& path) {
  const json* v = find_field(object, key, path, true);
  if (!v->is_array()) throw JsonError(json_path(path, key) + ": expected an array, got " + v->type_name());
  return *v;
}

namespace {

// "line 3, column 17" for a byte offset, as an editor counts.
std::string position_text(std::string_view text, size_t byte) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

// The last "key": before offset `byte`, to name the field of a syntax error.
std::string key_before(std::string_view text, size_t byte) {
  const std::string_view before = text.substr(0, std::min(byte, text.size()));
  const size_t colon = before.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return "";
  const size_t close = before.find_last_not_of(" \t\r\n", colon - 1);
  if (close == std::string_view::npos || before[close] != '"' || close == 0) return "";
  const size_t open = before.rfind('"', close - 1);
  if (open == std::string_view::npos) return "";
  return std::string(text.substr(open + 1, close - open - 1));
}

}  // namespace

json parse_strict_json(std::string_view text) {
  // Duplicate keys would silently keep the last value.
  std::vector<std::set<std::string>> open_objects;
  const json::parser_callback_t reject_duplicates = [&](int depth, json::parse_event_t event, json& parsed) {
    // Nothing here nests deeply; a document that does is not one of ours, and deep
    // nesting costs stack elsewhere.
    if (depth > kMaxJsonDepth)
      throw JsonError("nested deeper than " + std::to_string(kMaxJsonDepth) + " levels; not a document lgreco reads");
    if (event == json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == json::parse_event_t::object_end) open_objects.pop_back();
    if (event == json::parse_event_t::key && !open_objects.back().insert(parsed.get<std::string>()).second)
      throw JsonError("duplicate key \"" + parsed.get<std::string>() + "\"");
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), reject_duplicates);
  } catch (const json::parse_error& e) {
    const size_t byte = e.byte > 0 ? e.byte - 1 : 0;
    std::string message = "not valid JSON at " + position_text(text, byte);
    const std::string key = key_before(text, byte);
    if (!key.empty()) message += " (the value of \"" + key + "\")";
    // The failing byte may sit inside the token: look a few bytes around it.
    const std::string_view near = text.substr(std::min(byte >= 9 ? byte - 9 : 0, text.size()), 20);
    for (std::string_view token : {"NaN", "Infinity", "nan", "inf"})
      if (near.find(token) != std::string_view::npos)
        throw JsonError(message + ": " + std::string(token) +
                           " is not a JSON number (Python's json.dumps writes it for a non-finite float); "
                           "every value must be finite");
    // nlohmann's text after its "[json.exception...] parse error at ...:" prefix.
    const std::string what = e.what();
    const size_t detail = what.find(": ");
    throw JsonError(message + ": " + (detail == std::string::npos ? what : what.substr(detail + 2)));
  } catch (const json::exception& e) {  // e.g. a number beyond double's range
    const std::string what = e.what();
    const size_t detail = what.find("] ");
    throw JsonError("not valid JSON: " + (detail == std::string::npos ? what : what.substr(detail + 2)));
  }
}


}  // namespace lgreco::config
