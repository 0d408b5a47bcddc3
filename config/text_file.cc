#include "config/text_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace lgreco::config {

TextFile read_text_file(const std::string& path, size_t max_bytes) {
  TextFile result;
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) {
    result.status = TextFile::Status::kCannotOpen;
    result.missing = errno == ENOENT || errno == ENOTDIR;
    result.error = strerror(errno);
    return result;
  }
  char chunk[1 << 16];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0 && result.text.size() <= max_bytes) result.text.append(chunk, n);
  const int read_errno = errno;
  const bool failed = ferror(f);
  fclose(f);
  if (failed) {
    result.status = TextFile::Status::kCannotRead;
    result.error = strerror(read_errno);  // EISDIR for a directory
  } else if (result.text.size() > max_bytes) {
    result.status = TextFile::Status::kTooLarge;
  }
  if (result.status != TextFile::Status::kOk) result.text.clear();
  return result;
}

}  // namespace lgreco::config
