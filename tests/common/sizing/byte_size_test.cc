#include "common/sizing/byte_size.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(ParseByteSizeTest, PlainBytes) {
  EXPECT_EQ(*ParseByteSize("123456"), 123456);
  EXPECT_EQ(*ParseByteSize("0"), 0);
  EXPECT_EQ(*ParseByteSize("42B"), 42);
  EXPECT_EQ(*ParseByteSize("  7 "), 7);
  EXPECT_EQ(*ParseByteSize("1.0"), 1);  // a zero fraction is still a whole byte
}

TEST(ParseByteSizeTest, BinaryUnits) {
  EXPECT_EQ(*ParseByteSize("1KiB"), 1024);
  EXPECT_EQ(*ParseByteSize("512MiB"), 536870912);  // 512 x 2^20
  EXPECT_EQ(*ParseByteSize("64GiB"), 64 * kGiB);   // 68719476736
  EXPECT_EQ(*ParseByteSize("2TiB"), int64_t{2} << 40);
  EXPECT_EQ(*ParseByteSize("1.5TiB"), 1649267441664);  // 1.5 x 2^40
}

TEST(ParseByteSizeTest, BareLettersAreBinary) {
  EXPECT_EQ(*ParseByteSize("64G"), 64 * kGiB);
  EXPECT_EQ(*ParseByteSize("4K"), 4096);
  EXPECT_EQ(*ParseByteSize("3M"), 3 * 1048576);
  EXPECT_EQ(*ParseByteSize("1T"), int64_t{1} << 40);
}

TEST(ParseByteSizeTest, DecimalUnits) {
  EXPECT_EQ(*ParseByteSize("80GB"), 80'000'000'000);
  EXPECT_EQ(*ParseByteSize("1KB"), 1000);
  EXPECT_EQ(*ParseByteSize("5MB"), 5'000'000);
  EXPECT_EQ(*ParseByteSize("1.3GB"), 1'300'000'000);
  EXPECT_EQ(*ParseByteSize("2TB"), 2'000'000'000'000);
}

TEST(ParseByteSizeTest, UnitsAreCaseInsensitiveAndMayFollowASpace) {
  EXPECT_EQ(*ParseByteSize("64gib"), 64 * kGiB);
  EXPECT_EQ(*ParseByteSize("64 GiB"), 64 * kGiB);
  EXPECT_EQ(*ParseByteSize("80gb"), 80'000'000'000);
}

TEST(ParseByteSizeTest, FractionsRoundDown) {
  EXPECT_EQ(*ParseByteSize("1.1KiB"), 1126);  // 1126.4
  EXPECT_EQ(*ParseByteSize(".5KiB"), 512);
  EXPECT_EQ(*ParseByteSize("0.25GiB"), kGiB / 4);
}

TEST(ParseByteSizeTest, Limits) {
  EXPECT_EQ(*ParseByteSize("9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(*ParseByteSize("8388607TiB"), 9223370937343148032);  // (2^23 - 1) x 2^40
}

TEST(ParseByteSizeTest, RejectsBadInput) {
  for (const char* text : {"", "  ", "-1", "-1GiB", "+5", "abc", "GiB", ".", "12XB", "1e9", "0x10",
                           "1.2.3", "1 2", "1.5", "64GiBs", "1_000"}) {
    const absl::StatusOr<int64_t> bytes = ParseByteSize(text);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument) << "\"" << text << "\"";
  }
  EXPECT_THAT(ParseByteSize("-1GiB").status().message(), HasSubstr("negative"));
  EXPECT_THAT(ParseByteSize("12XB").status().message(), HasSubstr("unknown unit \"XB\""));
}

TEST(ParseByteSizeTest, RejectsOverflow) {
  for (const char* text : {"9223372036854775808", "8388608TiB",  // 2^63
                           "99999999999999999999999", "10000000TB"}) {
    const absl::StatusOr<int64_t> bytes = ParseByteSize(text);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(bytes.status().message(), HasSubstr("too large")) << text;
  }
}

TEST(FormatBytesTest, PicksBinaryUnit) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(2097152), "2.00 MiB");
  EXPECT_EQ(FormatBytes(64 * kGiB), "64.00 GiB");
  EXPECT_EQ(FormatBytes(1649267441664), "1.50 TiB");
  EXPECT_EQ(FormatBytes(-2048), "-2.00 KiB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<int64_t>::min()), "-8.00 EiB");
}

TEST(ExactBytesTest, AddsUnitFromOneKiB) {
  EXPECT_EQ(ExactBytes(0), "0 B");
  EXPECT_EQ(ExactBytes(1023), "1023 B");
  EXPECT_EQ(ExactBytes(131072), "131072 B (128.00 KiB)");
  EXPECT_EQ(ExactBytes(64 * kGiB), "68719476736 B (64.00 GiB)");
}

TEST(FormatBytesTest, RoundTripsThroughParse) {
  for (int64_t bytes : {int64_t{1024}, int64_t{3} << 20, 64 * kGiB}) {
    EXPECT_EQ(*ParseByteSize(FormatBytes(bytes)), bytes) << FormatBytes(bytes);
  }
}

}  // namespace
}  // namespace kvcm
