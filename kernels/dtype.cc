#include "kernels/dtype.h"

namespace lgreco {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "invalid";
}

std::optional<DType> parse_dtype(std::string_view name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  return std::nullopt;
}

bool is_valid_dtype(uint32_t raw) { return raw <= static_cast<uint32_t>(DType::kBFloat16); }

}  // namespace lgreco
