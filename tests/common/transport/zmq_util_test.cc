// AlignFrame: a frame whose data is not 8-byte aligned is replaced by an aligned copy with
// the same bytes; an aligned one is left where it is.

#include "common/transport/zmq_util.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(AlignFrameTest, MisalignedFrameIsCopiedToAnAlignedOne) {
  // A zero-copy frame over bytes 3.. of a buffer, as libzmq's decoder can hand out.
  alignas(8) static uint8_t buffer[128];
  for (size_t i = 0; i < sizeof(buffer); ++i) buffer[i] = static_cast<uint8_t>(i * 7);
  zmq::message_t frame(buffer + 3, 100, /*ffn=*/nullptr);
  ASSERT_NE(reinterpret_cast<uintptr_t>(frame.data()) % 8, 0u);
  AlignFrame(frame);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(frame.data()) % 8, 0u);
  ASSERT_EQ(frame.size(), 100u);
  EXPECT_EQ(std::memcmp(frame.data(), buffer + 3, 100), 0);
}

TEST(AlignFrameTest, AlignedFrameStaysInPlace) {
  alignas(8) static uint8_t buffer[64] = {1, 2, 3};
  zmq::message_t frame(buffer, sizeof(buffer), /*ffn=*/nullptr);
  AlignFrame(frame);
  EXPECT_EQ(frame.data(), static_cast<void*>(buffer));
}

}  // namespace
}  // namespace kvcm
