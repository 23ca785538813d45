// The wire forms of the library's enums (common/wire/convert.h): every value round-trips with
// its schema number, and a value outside the schema is refused.

#include "common/wire/convert.h"

#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

// The schema's numbers are the wire: a client and a cache manager built apart agree on them.
TEST(ConvertTest, EveryHashAlgorithmRoundTripsWithItsSchemaNumber) {
  const std::pair<HashAlgorithm, int> expected[] = {
      {HashAlgorithm::kSha256, 0},         {HashAlgorithm::kFast128, 1}, {HashAlgorithm::kXxh3, 2},
      {HashAlgorithm::kVllmSha256Cbor, 3}, {HashAlgorithm::kXxh3V2, 4},
  };
  for (const auto& [algorithm, number] : expected) {
    const wire::HashAlgorithm w = ToWire(algorithm);
    EXPECT_EQ(static_cast<int>(w), number) << HashAlgorithmName(algorithm);
    absl::StatusOr<HashAlgorithm> back = FromWire(w);
    ASSERT_THAT(back, IsOk());
    EXPECT_EQ(*back, algorithm);
  }
  EXPECT_EQ(static_cast<int>(wire::HashAlgorithm::MAX), 4);  // a new value needs a row above
}

TEST(ConvertTest, AHashAlgorithmOutsideTheSchemaIsRefused) {
  absl::StatusOr<HashAlgorithm> unknown = FromWire(static_cast<wire::HashAlgorithm>(5));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("5"), std::string_view::npos);
}

}  // namespace
}  // namespace kvcm
