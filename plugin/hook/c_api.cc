// The comm hook's C ABI (plugin/hook/lgreco_hook.h), exported by liblgreco.so for
// python/lgreco/torch.py (ctypes). Thin: every call is plugin/hook/session.h's, with its
// exceptions and messages turned into return codes and the caller's message buffer.
#include "plugin/hook/lgreco_hook.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "config/params.h"
#include "plugin/collective/engine.h"
#include "plugin/hook/session.h"

namespace {

// No std::to_string here: its inline digit table would become a unique global symbol of
// this object, which is linked into the library directly and so exported
// (library_test's list of exports catches it).
std::string number(long long v) {
  char text[32];
  snprintf(text, sizeof text, "%lld", v);
  return text;
}

void set_message(char* buf, size_t len, const std::string& text) {
  if (!buf || len == 0) return;
  const size_t n = text.size() < len - 1 ? text.size() : len - 1;
  memcpy(buf, text.data(), n);
  buf[n] = '\0';
}

}  // namespace

struct lgreco_hook_session {
  std::unique_ptr<lgreco::hook::Session> session;
};

extern "C" {

LGRECO_HOOK_API int lgreco_hook_abi_version(void) { return LGRECO_HOOK_ABI_VERSION; }

LGRECO_HOOK_API lgreco_hook_session* lgreco_hook_open(int rank, int world_size, const char* master_host,
                                                      int master_port, const char* layout_json, char* message,
                                                      size_t message_len) {
  try {
    if (!master_host || !layout_json) throw std::runtime_error("null master_host or layout_json");
    if (master_port < 1 || master_port > 65535)
      throw std::runtime_error("rendezvous port " + number(master_port) + " is not a port");
    const lgreco::config::Params& params = lgreco::config::params();
    lgreco::hook::SessionOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.master_host = master_host;
    o.master_port = static_cast<uint16_t>(master_port);
    o.timeout = std::chrono::seconds(params.timeout_seconds);
    o.layout_json = layout_json;
    auto* handle = new lgreco_hook_session{lgreco::hook::Session::open(o, params)};
    set_message(message, message_len, "");
    return handle;
  } catch (const std::exception& e) {
    set_message(message, message_len, e.what());
  } catch (...) {
    set_message(message, message_len, "unknown error");
  }
  return nullptr;
}

LGRECO_HOOK_API int lgreco_hook_allreduce_mean(lgreco_hook_session* s, uint32_t bucket, uint64_t step, void* data,
                                               uint64_t count, int dtype, char* message, size_t message_len) {
  if (!s || !data) {
    set_message(message, message_len, "null session or data");
    return LGRECO_HOOK_ERROR;
  }
  if (dtype < 0 || dtype > 2) {
    set_message(message, message_len, "dtype " + number(dtype) + " (0 float32, 1 float16, 2 bfloat16)");
    return LGRECO_HOOK_ERROR;
  }
  try {
    std::string text;
    const auto r = s->session->allreduce_mean(bucket, step, data, count, static_cast<lgreco::DType>(dtype), &text);
    set_message(message, message_len, text);
    return static_cast<int>(r);
  } catch (const std::exception& e) {  // the engine does not throw; a bad_alloc might
    set_message(message, message_len, e.what());
  }
  return LGRECO_HOOK_ERROR;
}

LGRECO_HOOK_API int lgreco_hook_summary(lgreco_hook_session* s, char* text, size_t text_len) {
  if (!s) return -1;
  set_message(text, text_len, s->session->summary());
  return 0;
}

LGRECO_HOOK_API int lgreco_hook_counters(lgreco_hook_session* s, uint64_t* values, size_t n) {
  if (!s) return -1;
  const auto c = s->session->counters();
  const uint64_t all[6] = {c.calls, c.compressed_calls, c.passed_through, c.uncompressed_bytes, c.encoded_bytes,
                           c.wire_bytes_sent};
  for (size_t i = 0; i < n && i < 6 && values; ++i) values[i] = all[i];
  return 6;
}

LGRECO_HOOK_API void lgreco_hook_close(lgreco_hook_session* s) { delete s; }

}  // extern "C"
