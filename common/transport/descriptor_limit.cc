#include "common/transport/descriptor_limit.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <limits>

namespace kvcm {

int DescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return -1;
  return static_cast<int>(std::min<rlim_t>(limit.rlim_cur, std::numeric_limits<int>::max()));
}

int OpenDescriptors(int proc_self_fd) {
  if (proc_self_fd < 0 || ::lseek(proc_self_fd, 0, SEEK_SET) != 0) return -1;
  alignas(8) char buffer[8192];
  int count = 0;
  while (true) {
    const long n = ::syscall(SYS_getdents64, proc_self_fd, buffer, sizeof(buffer));
    if (n < 0) return -1;
    if (n == 0) break;
    for (long offset = 0; offset < n;) {
      const auto* entry = reinterpret_cast<const dirent64*>(buffer + offset);
      if (entry->d_name[0] != '.') ++count;
      offset += entry->d_reclen;
    }
  }
  return count - 1;
}

std::optional<RaisedLimit> RaiseDescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) {
    return std::nullopt;
  }
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) return std::nullopt;
  return RaisedLimit{before, limit.rlim_cur};
}

}  // namespace kvcm
