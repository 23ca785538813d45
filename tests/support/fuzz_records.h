#pragma once
// The input of the fuzz targets that feed a service several messages (the cache manager's
// and the executor's): a sequence of records, each
//
//   [1 byte flags][2 bytes length, little-endian][length bytes: one message]
//
// What the flags mean is the target's (its header comment says). A last record cut short
// is dropped. The seeds are written by tests/services/fuzz_seeds.cc.
//
// Thread safety: plain functions.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvcm::fuzz {

struct Record {
  uint8_t flags = 0;
  std::span<const uint8_t> bytes;
};

inline std::vector<Record> SplitRecords(std::span<const uint8_t> input) {
  std::vector<Record> records;
  size_t at = 0;
  while (input.size() - at >= 3) {
    const size_t length = size_t{input[at + 1]} | size_t{input[at + 2]} << 8;
    if (input.size() - at - 3 < length) break;
    records.push_back({input[at], input.subspan(at + 3, length)});
    at += 3 + length;
  }
  return records;
}

// REQUIRES: bytes.size() < 65536.
inline void AppendRecord(uint8_t flags, std::span<const uint8_t> bytes, std::string* out) {
  out->push_back(static_cast<char>(flags));
  out->push_back(static_cast<char>(bytes.size() & 0xFF));
  out->push_back(static_cast<char>(bytes.size() >> 8));
  out->append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace kvcm::fuzz
