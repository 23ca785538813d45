#pragma once

// A minimal blocking HTTP/1.0 client over a plain socket, enough to scrape /metrics, query
// Prometheus's HTTP API and post to the router from tests without an HTTP library. Test
// support only.

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

// POSTs `body` (as application/json) to `url`; the same rules and errors as HttpGet.
absl::StatusOr<HttpResponse> HttpPost(const std::string& url, std::string_view body,
                                      absl::Duration timeout = absl::Seconds(10));
// Any method; a body (with Content-Length) for all but GET.
absl::StatusOr<HttpResponse> HttpRequest(std::string_view method, const std::string& url,
                                         std::string_view body, absl::Duration timeout);

// Percent-encodes `text` for a URL query value (RFC 3986 unreserved characters kept).
std::string UrlEncode(std::string_view text);

}  // namespace kvcm::testing
