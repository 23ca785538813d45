#pragma once

// A minimal blocking HTTP/1.0 GET over a plain socket, enough to scrape /metrics and query
// Prometheus's HTTP API from tests without an HTTP library. Test support only.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcm::testing {

struct HttpResponse {
  int status = 0;       // e.g. 200
  std::string headers;  // raw header lines after the status line
  std::string body;
};

// GETs `url`, "http://HOST:PORT/PATH?QUERY" with HOST an IPv4 literal or "localhost", and
// reads until the server closes. Non-2xx statuses are returned, not errors.
// Errors: INVALID_ARGUMENT (url), UNAVAILABLE (connect, send or receive failed; the
// timeout applies to each of them), INTERNAL (not an HTTP response).
absl::StatusOr<HttpResponse> HttpGet(const std::string& url,
                                     absl::Duration timeout = absl::Seconds(10));

// Percent-encodes `text` for a URL query value (RFC 3986 unreserved characters kept).
std::string UrlEncode(std::string_view text);

}  // namespace kvcm::testing
