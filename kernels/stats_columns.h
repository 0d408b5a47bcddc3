// Where the error statistics of a batch of candidates go in the caller's table: the CUDA
// kernels of each family (quant_cuda.h, topk_cuda.h) can write their candidates into
// columns of rows that also hold other families' candidates (the engine's CUDA backend
// measures every family into one table). Host arithmetic, shared by those kernels' checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kernels/codec_spec.h"  // CodecError

namespace lgreco {

// One column per candidate, each below row_stride, no two the same; else CodecError
// prefixed with `what` ("<what>: 2 candidates but 1 columns", "<what>: candidate 0's
// column 3 is not below the row stride 3", "<what>: candidates 0 and 1 share column 1").
inline void check_stats_columns(std::span<const uint32_t> columns, size_t candidates, uint32_t row_stride,
                                const char* what) {
  if (columns.size() != candidates)
    throw CodecError(std::string(what) + ": " + std::to_string(candidates) + " candidates but " +
                     std::to_string(columns.size()) + " columns");
  for (size_t c = 0; c < columns.size(); ++c) {
    if (columns[c] >= row_stride)
      throw CodecError(std::string(what) + ": candidate " + std::to_string(c) + "'s column " +
                       std::to_string(columns[c]) + " is not below the row stride " + std::to_string(row_stride));
    for (size_t d = 0; d < c; ++d)
      if (columns[d] == columns[c])
        throw CodecError(std::string(what) + ": candidates " + std::to_string(d) + " and " + std::to_string(c) +
                         " share column " + std::to_string(columns[c]));
  }
}

}  // namespace lgreco
