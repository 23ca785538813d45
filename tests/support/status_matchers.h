#pragma once
// gMock matchers for absl::Status and absl::StatusOr<T> (as Abseil's own status_matchers,
// which Abseil 20220623 does not ship):
//
//   ASSERT_THAT(ledger.Allocate(4), IsOk());
//   EXPECT_THAT(Parse("{"), StatusIs(absl::StatusCode::kInvalidArgument));
//   EXPECT_THAT(Parse("{"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1")));
//
// A failure prints the status (code and message), which `ASSERT_TRUE(x.ok()) << x.status()`
// had to be told to. Test support only.

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"

namespace kvcm {
namespace status_matchers_internal {

inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace status_matchers_internal

// The status (of a Status or a StatusOr) is OK.
MATCHER(IsOk, negation ? "is not OK" : "is OK") {
  const absl::Status& status = status_matchers_internal::StatusOf(arg);
  if (!status.ok()) *result_listener << "whose status is " << status;
  return status.ok();
}

// The status's code is `code`, and its message matches `message` (any, if not given).
MATCHER_P2(StatusIs, code, message,
           absl::StrCat(negation ? "has not " : "has ", "code ", absl::StatusCodeToString(code),
                        " and a message that ",
                        ::testing::DescribeMatcher<std::string>(message, negation))) {
  const absl::Status& status = status_matchers_internal::StatusOf(arg);
  *result_listener << "whose status is " << status;
  return status.code() == code && ::testing::Matches(::testing::SafeMatcherCast<const std::string&>(
                                      message))(std::string(status.message()));
}
inline auto StatusIs(absl::StatusCode code) { return StatusIs(code, ::testing::_); }

}  // namespace kvcm
