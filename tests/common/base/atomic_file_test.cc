// common/base/atomic_file.h: a file replaced whole (never seen in part, no temp file left,
// the mode asked for whatever the umask), errors naming the path, and bounded reads.

#include "common/base/atomic_file.h"

#include <sys/stat.h>

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

int Entries(const std::string& dir) {
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++entries;
  }
  return entries;
}

TEST(AtomicFileTest, WriteReplacesTheFileWholeAndLeavesNoTempFile) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-atomic-file-test");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/kvcm.json";
  ASSERT_THAT(WriteFileAtomically(path, "[]\n"), IsOk());
  EXPECT_EQ(ReadSmallFile(path, 100).value_or("?"), "[]\n");
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  ASSERT_THAT(WriteFileAtomically(path, "[{\"targets\": []}]\n"), IsOk());
  EXPECT_EQ(ReadSmallFile(path, 100).value_or("?"), "[{\"targets\": []}]\n");
  // A new file renamed over the old one (a reader holding the old one keeps it whole).
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_NE(st.st_ino, before.st_ino);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_EQ(Entries(dir->path()), 1);

  // A folder that does not exist: NOT_FOUND naming the path, and nothing made.
  const absl::Status missing = WriteFileAtomically(dir->path() + "/no/kvcm.json", "[]\n");
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("/no/kvcm.json"));
}

TEST(AtomicFileTest, TheModeAskedForIsTheModeGotWhateverTheUmask) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-atomic-file-test");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/private";
  const mode_t old_umask = ::umask(0077);
  const absl::Status written = WriteFileAtomically(path, "x", 0640);
  ::umask(old_umask);
  ASSERT_THAT(written, IsOk());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ASSERT_THAT(WriteFileAtomically(path, "y", 0600), IsOk());
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(AtomicFileTest, ReadSmallFileRefusesAMissingOrLargerFileNamingIt) {
  absl::StatusOr<testing::TempDir> dir = testing::TempDir::Create("kvcm-atomic-file-test");
  ASSERT_THAT(dir, IsOk());
  const std::string path = dir->path() + "/seq";
  const absl::StatusOr<std::string> missing = ReadSmallFile(path, 10);
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(path));

  const std::string big(10000, 'a');
  ASSERT_THAT(WriteFileAtomically(path, big), IsOk());
  EXPECT_EQ(ReadSmallFile(path, 10000).value_or(""), big);
  const absl::StatusOr<std::string> larger = ReadSmallFile(path, 9999);
  EXPECT_TRUE(absl::IsFailedPrecondition(larger.status())) << larger.status();
  EXPECT_THAT(std::string(larger.status().message()), HasSubstr(path));
}

}  // namespace
}  // namespace kvcm
