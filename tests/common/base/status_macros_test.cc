#include "common/base/status_macros.h"

#include "common/base/check.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  KVCM_ASSIGN_OR_RETURN(int half, Half(x));
  KVCM_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x) {
  KVCM_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, PropagatesValuesAndErrors) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(CheckEven(4), IsOk());
  EXPECT_EQ(CheckEven(3).message(), "odd");
}

TEST(CheckDeathTest, AbortsWithConditionAndMessage) {
  int blocks = 3;
  EXPECT_DEATH(KVCM_CHECK(blocks == 4) << "blocks=" << blocks, "blocks == 4.*blocks=3");
  KVCM_CHECK(blocks == 3) << "never printed";
}

}  // namespace
}  // namespace kvcm
