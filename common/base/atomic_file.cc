#include "common/base/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/unique_fd.h"

namespace kvcm {
namespace {

// Writes all of `content` to `fd`; false with errno set on failure.
bool WriteAll(int fd, std::string_view content) {
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

std::string Folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, std::string_view content, mode_t mode) {
  const std::string temp = absl::StrCat(path, ".tmp-", ::getpid());
  // Removes the temp file and reports errno (saved first: unlink may change it).
  auto fail = [&temp](const std::string& what) {
    const int error = errno;
    ::unlink(temp.c_str());
    return absl::ErrnoToStatus(error, what);
  };
  {
    UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode));
    if (!fd.valid()) return absl::ErrnoToStatus(errno, absl::StrCat("create ", temp));
    // open() applied the umask; the file gets exactly `mode`.
    if (::fchmod(fd.get(), mode) != 0) return fail("chmod " + temp);
    if (!WriteAll(fd.get(), content)) return fail("write " + temp);
    if (::fsync(fd.get()) != 0) return fail("fsync " + temp);
    if (::close(fd.release()) != 0) return fail("close " + temp);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    return fail(absl::StrCat("rename ", temp, " to ", path));
  }
  const std::string folder = Folder(path);
  UniqueFd dir(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid() || ::fsync(dir.get()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("fsync ", folder, " after writing ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  std::string content;
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("read ", path));
    if (n == 0) break;
    content.append(buffer, static_cast<size_t>(n));
    if (content.size() > max_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is larger than ", max_bytes, " bytes"));
    }
  }
  return content;
}

}  // namespace kvcm
