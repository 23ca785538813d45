#include "services/cache_manager/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvcm::cache_manager {
namespace {

std::string Errno() { return std::strerror(errno); }

// Creates `path` and its missing parents (parents get 0755, as mkdir -p would).
absl::Status MakeDirectory(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    const std::string parent = path.substr(0, slash);
    if (::mkdir(parent.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("cannot create ", parent, ": ", Errno()));
    }
  }
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("cannot create run directory ", path, ": ", Errno()));
  }
  // Opened without following a symbolic link, then checked and fixed through the
  // descriptor: a link planted at the path cannot make the cache manager use (or chmod)
  // another user's directory.
  UniqueFd dir(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.valid()) {
    struct stat link {};
    if ((errno == ELOOP || errno == ENOTDIR) && ::lstat(path.c_str(), &link) == 0 &&
        S_ISLNK(link.st_mode)) {
      return absl::PermissionDeniedError(
          absl::StrCat("run directory ", path,
                       " is a symbolic link: refused (it could lead into another "
                       "user's directory); give the real path"));
    }
    return absl::InternalError(
        absl::StrCat("run directory ", path, " cannot be opened: ", Errno()));
  }
  struct stat st {};
  if (::fstat(dir.get(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InternalError(absl::StrCat("run directory ", path, " is not a directory"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat("run directory ", path, " belongs to uid ",
                                                    st.st_uid, ", not to this user (uid ",
                                                    ::geteuid(), ")"));
  }
  // One that others could write may hold what they planted (a socket, a lock file, a link
  // under the names the clients open): refused, as the clients refuse it
  // (CheckIpcDirectory). Narrower modes are only made private.
  if ((st.st_mode & 022) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return absl::PermissionDeniedError(absl::StrCat(
        "run directory ", path, " (mode ", mode,
        ") can be written by other users, who could "
        "have planted files in it: refused; remove it (the cache manager creates it with mode "
        "0700) or check its contents and chmod 0700 it"));
  }
  if ((st.st_mode & 0777) != 0700 && ::fchmod(dir.get(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("cannot chmod 0700 ", path, ": ", Errno()));
  }
  return absl::OkStatus();
}

std::string ReadPid(int fd) {
  char buffer[32] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  if (n <= 0) return "unknown";
  int pid = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buffer)), &pid)) {
    return "unknown";
  }
  return absl::StrCat(pid);
}

}  // namespace

absl::StatusOr<RunDirectory> RunDirectory::Acquire(const std::string& path_in) {
  std::string path(absl::StripSuffix(path_in, "/"));
  if (path.empty() || path[0] != '/') {
    char cwd[4096];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) {
      return absl::InternalError(absl::StrCat("getcwd: ", Errno()));
    }
    path = path.empty() ? std::string(cwd) : absl::StrCat(cwd, "/", path);
  }
  const size_t longest = path.size() + 1 + sizeof(kRequestSocket);
  if (longest > sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("run directory ", path, " is too long: socket paths in it would exceed the ",
                     sizeof(sockaddr_un{}.sun_path) - 1, "-byte limit of Unix socket addresses"));
  }
  if (absl::Status made = MakeDirectory(path); !made.ok()) return made;

  const std::string lock_path = absl::StrCat(path, "/", kLockFile);
  UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock.valid()) {
    return absl::InternalError(absl::StrCat("cannot open ", lock_path, ": ", Errno()));
  }
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::AlreadyExistsError(absl::StrCat("kvcm-cache-manager is already running on ",
                                                   path, " (pid ", ReadPid(lock.get()), " holds ",
                                                   kLockFile, ")"));
    }
    return absl::InternalError(absl::StrCat("cannot lock ", lock_path, ": ", Errno()));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(lock.get(), 0) != 0 ||
      ::pwrite(lock.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return absl::InternalError(absl::StrCat("cannot write pid into ", lock_path, ": ", Errno()));
  }
  // Whoever held the lock before us is gone: its socket files are stale.
  for (const char* name : {kRequestSocket, kEventSocket, kFdChannelSocket, kTcpSecretFile}) {
    ::unlink(absl::StrCat(path, "/", name).c_str());
  }
  return RunDirectory(std::move(path), std::move(lock));
}

absl::StatusOr<std::string> RunDirectory::CreateTcpSecret() {
  uint8_t bytes[32];
  for (size_t got = 0; got < sizeof(bytes);) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("getrandom: ", Errno()));
    got += static_cast<size_t>(n);
  }
  std::string secret;
  for (uint8_t byte : bytes) absl::StrAppend(&secret, absl::Hex(byte, absl::kZeroPad2));
  const std::string path = File(kTcpSecretFile);
  ::unlink(path.c_str());
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return absl::InternalError(absl::StrCat("cannot create ", path, ": ", Errno()));
  const std::string line = secret + "\n";
  if (::write(fd.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", Errno()));
  }
  return secret;
}

RunDirectory::~RunDirectory() {
  if (!lock_.valid()) return;
  for (const char* name : {kRequestSocket, kEventSocket, kFdChannelSocket, kTcpSecretFile}) {
    ::unlink(File(name).c_str());
  }
  // Closing lock_ releases the flock. The lock file stays: unlinking it would let two
  // later instances lock two different files.
}

}  // namespace kvcm::cache_manager
