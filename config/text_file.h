// Reading a whole file that a user wrote (a parameter file, a registration file), with a
// size limit so that a wrong path (a device, a huge log) cannot exhaust memory.
#pragma once

#include <cstddef>
#include <string>

namespace lgreco::config {

struct TextFile {
  enum class Status { kOk, kCannotOpen, kCannotRead, kTooLarge };
  Status status = Status::kOk;
  bool missing = false;  // kCannotOpen because it does not exist
  std::string error;     // strerror() text for kCannotOpen and kCannotRead
  std::string text;      // kOk
};

TextFile read_text_file(const std::string& path, size_t max_bytes);

}  // namespace lgreco::config
