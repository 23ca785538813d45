// IsOk and StatusIs (tests/support/status_matchers.h) on Status and StatusOr alike.

#include "tests/support/status_matchers.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// What a matcher says of a value it refuses.
template <typename M, typename T>
std::string Explain(const M& matcher, const T& value) {
  ::testing::StringMatchResultListener listener;
  EXPECT_FALSE(::testing::ExplainMatchResult(matcher, value, &listener));
  return listener.str();
}

TEST(StatusMatchersTest, IsOkAcceptsOkStatusesAndValuesAndRefusesErrors) {
  EXPECT_THAT(absl::OkStatus(), IsOk());
  EXPECT_THAT(absl::StatusOr<int>(7), IsOk());
  EXPECT_THAT(absl::NotFoundError("no block 9"), Not(IsOk()));
  EXPECT_THAT(absl::StatusOr<int>(absl::InternalError("x")), Not(IsOk()));
}

TEST(StatusMatchersTest, ARefusalNamesTheStatusCodeAndMessage) {
  const std::string why = Explain(IsOk(), absl::StatusOr<int>(absl::NotFoundError("no block 9")));
  EXPECT_THAT(why, HasSubstr("NOT_FOUND"));
  EXPECT_THAT(why, HasSubstr("no block 9"));
  EXPECT_THAT(Explain(StatusIs(absl::StatusCode::kNotFound), absl::InternalError("disk")),
              HasSubstr("INTERNAL: disk"));
}

TEST(StatusMatchersTest, StatusIsMatchesTheCodeAndTheMessage) {
  const absl::Status refused = absl::InvalidArgumentError("line 1: expected a value");
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1")));
  EXPECT_THAT(refused, Not(StatusIs(absl::StatusCode::kNotFound)));
  EXPECT_THAT(refused, Not(StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2"))));
  EXPECT_THAT(absl::StatusOr<int>(3), StatusIs(absl::StatusCode::kOk));
}

}  // namespace
}  // namespace kvcm
