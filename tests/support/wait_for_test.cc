// WaitFor: returns as soon as the condition holds, checks it once more after the deadline,
// and names what it waited for when it gives up.

#include "tests/support/wait_for.h"

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::testing {
namespace {

using ::testing::HasSubstr;

TEST(WaitForTest, ReturnsAtTheFirstCheckThatHolds) {
  int checks = 0;
  const absl::Status waited = WaitFor([&] { return ++checks == 3; }, absl::Seconds(60));
  EXPECT_THAT(waited, IsOk());
  EXPECT_EQ(checks, 3);
}

TEST(WaitForTest, ChecksOnceMoreAfterAPassedDeadline) {
  // A deadline already behind: one check, and it is the one that counts.
  int checks = 0;
  EXPECT_THAT(WaitFor([&] { return ++checks > 0; }, absl::InfinitePast()), IsOk());
  EXPECT_EQ(checks, 1);
}

TEST(WaitForTest, GivesUpAfterTheDeadlineNamingWhatItWaitedFor) {
  int checks = 0;
  const absl::Time start = absl::Now();
  const absl::Status waited =
      WaitFor([&] { return ++checks < 0; }, absl::Milliseconds(50), "a miracle");
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited)) << waited;
  EXPECT_THAT(waited.message(), HasSubstr("gave up waiting for a miracle after "));
  // Lower bounds only: a loaded machine makes the wait longer, never shorter.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_GE(checks, 2);  // the first at once, the last after the deadline
}

}  // namespace
}  // namespace kvcm::testing
