// CRC-32C (Castagnoli), as in iSCSI and ext4: the checksum of .lgc files.
#pragma once

#include <cstdint>
#include <span>

namespace lgreco {

// crc32c("123456789") == 0xE3069283. Pass a previous result as `crc` to continue.
uint32_t crc32c(std::span<const uint8_t> data, uint32_t crc = 0);

}  // namespace lgreco
