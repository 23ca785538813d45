#include "tests/support/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcm::testing {
namespace {

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

absl::Status Errno(const std::string& what, const std::string& url) {
  return absl::UnavailableError(absl::StrCat(what, " ", url, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(const std::string& url, absl::Duration timeout) {
  return HttpRequest("GET", url, "", timeout);
}

absl::StatusOr<HttpResponse> HttpPost(const std::string& url, std::string_view body,
                                      absl::Duration timeout) {
  return HttpRequest("POST", url, body, timeout);
}

absl::StatusOr<HttpResponse> HttpRequest(std::string_view method, const std::string& url,
                                         std::string_view body, absl::Duration timeout) {
  constexpr absl::string_view kScheme = "http://";
  if (!absl::StartsWith(url, kScheme)) {
    return absl::InvalidArgumentError(absl::StrCat("not an http:// URL: ", url));
  }
  const std::string rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  const std::string target = slash == std::string::npos ? "/" : rest.substr(slash);
  const size_t colon = authority.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(authority.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("URL without a valid port: ", url));
  }
  std::string host = authority.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &address.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("URL host is not IPv4: ", url));
  }

  Socket socket_fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (socket_fd.fd() < 0) return Errno("socket for", url);
  const int64_t micros = absl::ToInt64Microseconds(timeout);
  timeval tv{};
  tv.tv_sec = micros / 1000000;
  tv.tv_usec = micros % 1000000;
  setsockopt(socket_fd.fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(socket_fd.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(socket_fd.fd(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    return Errno("connect to", url);
  }
  std::string request = absl::StrCat(std::string(method), " ", target,
                                     " HTTP/1.0\r\nHost: ", authority, "\r\nConnection: close\r\n");
  if (method != "GET") {
    absl::StrAppend(&request, "Content-Type: application/json\r\nContent-Length: ", body.size(),
                    "\r\n");
  }
  absl::StrAppend(&request, "\r\n", std::string(body));
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n =
        send(socket_fd.fd(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("send to", url);
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[16384];
  while (true) {
    const ssize_t n = recv(socket_fd.fd(), buffer, sizeof(buffer), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("receive from", url);
    }
    response.append(buffer, static_cast<size_t>(n));
  }

  const size_t header_end = response.find("\r\n\r\n");
  const size_t status_end = response.find("\r\n");
  HttpResponse result;
  // "HTTP/1.x NNN reason"
  if (header_end == std::string::npos || !absl::StartsWith(response, "HTTP/1.") ||
      status_end < 12 || !absl::SimpleAtoi(response.substr(9, 3), &result.status)) {
    return absl::InternalError(
        absl::StrCat("not an HTTP response from ", url, ": ", response.substr(0, 200)));
  }
  result.headers = response.substr(status_end + 2, header_end - status_end - 2);
  result.body = response.substr(header_end + 4);
  return result;
}

std::string UrlEncode(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(c);
    } else {
      absl::StrAppendFormat(&out, "%%%02X", static_cast<unsigned char>(c));
    }
  }
  return out;
}

}  // namespace kvcm::testing
