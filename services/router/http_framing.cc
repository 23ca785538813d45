#include "services/router/http_framing.h"

#include <event2/buffer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvcm::router {
namespace {

// A chunk's size line with its extensions; longer is refused.
constexpr size_t kMaxChunkLineBytes = 4096;

// RFC 9110's token: a method's and a field name's characters.
bool IsToken(std::string_view text) {
  if (text.empty()) return false;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    // (strchr would find a NUL: the terminator.)
    if (!absl::ascii_isalnum(c) &&
        std::string_view("!#$%&'*+-.^_`|~").find(ch) == std::string_view::npos) {
      return false;
    }
  }
  return true;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return absl::ascii_tolower(static_cast<unsigned char>(x)) ==
                  absl::ascii_tolower(static_cast<unsigned char>(y));
         });
}

bool IsDigits(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), absl::ascii_isdigit);
}

std::string_view TrimWhitespace(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  return text;
}

// A line of `text` up to its LF, without the LF and a CR before it.
std::string_view WithoutEol(std::string_view line) {
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

// The methods libevent 2.1.12 knows, and whether it reads a body of theirs
// (evhttp_method_may_have_body: not of HEAD and TRACE).
std::optional<bool> MayHaveBody(std::string_view method) {
  static constexpr std::pair<std::string_view, bool> kMethods[] = {
      {"GET", true},     {"POST", true},   {"HEAD", false},   {"PUT", true},  {"DELETE", true},
      {"OPTIONS", true}, {"TRACE", false}, {"CONNECT", true}, {"PATCH", true}};
  for (const auto& [name, body] : kMethods) {
    if (name == method) return body;
  }
  return std::nullopt;
}

// "HTTP/" DIGIT "." DIGIT (RFC 9112's HTTP-version).
bool IsHttpVersion(std::string_view version) {
  return version.size() == 8 && version.starts_with("HTTP/") && absl::ascii_isdigit(version[5]) &&
         version[6] == '.' && absl::ascii_isdigit(version[7]);
}

std::string BodyLimitMessage(size_t limit) {
  return absl::StrCat("the request body is over the router's limit of ", limit,
                      " bytes (--max-request-body-bytes)");
}

// Where the head that starts `window` ends (after its first empty line, LF or CRLF, as
// libevent reads lines), searching for line ends from `from`; npos if not in the window.
size_t HeadEnd(std::string_view window, size_t from) {
  for (size_t at = window.find('\n', from); at != std::string_view::npos;
       at = window.find('\n', at + 1)) {
    if (at + 1 < window.size() && window[at + 1] == '\n') return at + 2;
    if (at + 2 < window.size() && window[at + 1] == '\r' && window[at + 2] == '\n') {
      return at + 3;
    }
  }
  return std::string_view::npos;
}

// The path of the request line that starts `window` (without its query, at most 256
// bytes), for a refusal's shape; "" until the line is whole.
std::string PathOf(std::string_view window) {
  const size_t eol = window.find('\n');
  if (eol == std::string_view::npos) return "";
  const std::string_view line = WithoutEol(window.substr(0, eol + 1));
  const size_t a = line.find(' ');
  const size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
  if (b == std::string_view::npos) return "";
  std::string_view target = line.substr(a + 1, b - a - 1);
  target = target.substr(0, target.find('?'));
  return std::string(target.substr(0, 256));
}

// Why a request is refused: its status and message.
struct Problem {
  int status;
  std::string message;
};

struct RequestLine {
  std::string_view method;
  bool may_have_body = false;
};

// The request line: method SP request-target SP HTTP-version.
std::optional<Problem> ReadRequestLine(std::string_view line, RequestLine* out) {
  const size_t a = line.find(' ');
  const size_t b = a == std::string_view::npos ? a : line.find(' ', a + 1);
  if (b == std::string_view::npos || line.find(' ', b + 1) != std::string_view::npos) {
    return Problem{400, "malformed request line: it must be METHOD SP TARGET SP HTTP-VERSION"};
  }
  const std::string_view method = line.substr(0, a);
  const std::string_view target = line.substr(a + 1, b - a - 1);
  const std::string_view version = line.substr(b + 1);
  if (!IsToken(method) || target.empty() || !IsHttpVersion(version)) {
    return Problem{400, "malformed request line: it must be METHOD SP TARGET SP HTTP-VERSION"};
  }
  // origin-form ("/path?query") or "*": libevent 2.1 refuses, with its own page, some
  // absolute-form targets it cannot parse, and the router serves none.
  if (target != "*" && target.front() != '/') {
    return Problem{400, "malformed request line: the target must be a path (origin-form)"};
  }
  // libevent 2.1 reads a target that starts with "//" as a host and a path
  // ("//v1/completions" is host "v1", path "/completions"), and refuses with its own page
  // one whose host it cannot parse; the router serves no such path.
  if (target.starts_with("//")) {
    return Problem{400,
                   "malformed request line: the target must be a path that does not "
                   "start with \"//\""};
  }
  for (const char ch : target) {
    const auto c = static_cast<unsigned char>(ch);
    if (c <= 0x20 || c == 0x7f) {
      return Problem{400, "malformed request line: the target has a control character"};
    }
  }
  // libevent 2.1 refuses a major version over 1 itself (its own page), and answers any other
  // in the request's own version ("HTTP/1.9 200 OK").
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    return Problem{505, "HTTP version not supported: the router speaks HTTP/1.1 and HTTP/1.0"};
  }
  const std::optional<bool> may_have_body = MayHaveBody(method);
  if (!may_have_body.has_value()) {
    return Problem{
        501, absl::StrCat("method ", std::string(method.substr(0, 32)), " is not implemented")};
  }
  out->method = method;
  out->may_have_body = *may_have_body;
  return std::nullopt;
}

struct BodyFraming {
  bool chunked = false;
  uint64_t length = 0;  // Content-Length's
};

// The header lines (`lines`, up to and with the head's empty line): name ":" OWS value OWS,
// and the body's framing they give. RFC 9112 wants 400 for a name with whitespace before
// its colon and for framing two readers may read two ways: libevent takes the first of
// several Content-Lengths, a "+48" as 48, a "-0" as 0 and "Transfer-Encoding :" as another
// header, so a proxy in front reading the other framing would see another request where
// libevent sees a body, or the reverse (request smuggling).
std::optional<Problem> ReadBodyFraming(std::string_view lines, const RequestLine& request,
                                       size_t max_body_bytes, BodyFraming* out) {
  std::optional<std::string_view> length;
  int encodings = 0;
  for (size_t at = 0; at < lines.size();) {
    const size_t eol = lines.find('\n', at);
    const std::string_view line = WithoutEol(lines.substr(at, eol + 1 - at));
    at = eol + 1;
    if (line.empty()) break;
    if (line.front() == ' ' || line.front() == '\t') {
      return Problem{400,
                     "ambiguous framing: a header line folded onto the one before "
                     "(obs-fold)"};
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || !IsToken(line.substr(0, colon))) {
      return Problem{400,
                     "ambiguous framing: a header name must be a token, with no "
                     "whitespace before its colon"};
    }
    const std::string_view name = line.substr(0, colon);
    const std::string_view value = TrimWhitespace(line.substr(colon + 1));
    if (value.find('\r') != std::string_view::npos || value.find('\0') != std::string_view::npos) {
      return Problem{400, "malformed header: a value has a CR or NUL"};
    }
    if (EqualsIgnoreCase(name, "Content-Length")) {
      if (!IsDigits(value)) return Problem{400, "ambiguous framing: Content-Length must be digits"};
      if (length.has_value() && *length != value) {
        return Problem{400, "ambiguous framing: the request has Content-Lengths that differ"};
      }
      length = value;
    } else if (EqualsIgnoreCase(name, "Expect")) {
      // libevent answers any other expectation itself (417, its own page).
      if (!EqualsIgnoreCase(value, "100-continue")) {
        return Problem{417, "the only expectation met is Expect: 100-continue"};
      }
    } else if (EqualsIgnoreCase(name, "Transfer-Encoding")) {
      if (++encodings > 1 || !EqualsIgnoreCase(value, "chunked")) {
        return Problem{400, "ambiguous framing: Transfer-Encoding must be one \"chunked\""};
      }
    }
  }
  if (encodings > 0 && length.has_value()) {
    return Problem{400,
                   "ambiguous framing: the request has both Transfer-Encoding and "
                   "Content-Length"};
  }
  if (length.has_value()) {
    std::string_view digits = *length;
    while (digits.size() > 1 && digits.front() == '0') digits.remove_prefix(1);
    if (digits.size() > 18) return Problem{413, BodyLimitMessage(max_body_bytes)};
    for (const char c : digits) out->length = out->length * 10 + static_cast<uint64_t>(c - '0');
  }
  if (!request.may_have_body && (out->length > 0 || encodings > 0)) {
    // libevent reads no body of these: it would be read as the next request.
    return Problem{400, absl::StrCat("ambiguous framing: a ", std::string(request.method),
                                     " request has a body, which would be read as another "
                                     "request")};
  }
  if (out->length > max_body_bytes) return Problem{413, BodyLimitMessage(max_body_bytes)};
  out->chunked = encodings > 0;
  return std::nullopt;
}

}  // namespace

size_t RequestFraming::WindowWanted() const {
  switch (state_) {
    case State::kHead:
      return limits_.max_head_bytes + 1;
    case State::kChunkLine:
      return kMaxChunkLineBytes + 1;
    case State::kChunkEnd:
      return 2;
    case State::kTrailers:
      return limits_.max_head_bytes + 1;
    case State::kBody:
    case State::kChunkData:
    case State::kRefused:
      return 0;
  }
  return 0;
}

FramingStep RequestFraming::Next(std::string_view window, size_t available) {
  FramingStep step;
  switch (state_) {
    case State::kHead:
      return Head(window);
    case State::kBody:
    case State::kChunkData:
      if (available == 0) return step;
      step.kind = FramingStep::Kind::kPass;
      step.length = static_cast<size_t>(std::min<uint64_t>(left_, available));
      left_ -= step.length;
      if (left_ == 0) state_ = state_ == State::kBody ? State::kHead : State::kChunkEnd;
      return step;
    case State::kChunkLine:
      return ChunkLine(window);
    case State::kChunkEnd:
      return ChunkEnd(window);
    case State::kTrailers:
      return Trailer(window);
    case State::kRefused:
      step.kind = FramingStep::Kind::kRefuse;
      return step;
  }
  return step;
}

FramingStep RequestFraming::Refuse(int status, std::string message) {
  FramingStep step;
  step.kind = FramingStep::Kind::kRefuse;
  step.refusal = {status, std::move(message), path_};
  // What libevent is in the middle of reading ends, so that it dispatches the request whose
  // handler answers the refusal: a head refused is read as kRefusedHead (a request of its
  // own); a chunked body refused ends with its last chunk, after an empty line that
  // libevent skips where it expects a size line.
  switch (state_) {
    case State::kHead:
      step.replacement = kRefusedHead;
      ++heads_;
      break;
    case State::kChunkLine:
    case State::kChunkEnd:
      step.replacement = "\r\n0\r\n\r\n";
      break;
    case State::kTrailers:
      step.replacement = "\r\n";
      break;
    case State::kBody:
    case State::kChunkData:
    case State::kRefused:
      break;
  }
  state_ = State::kRefused;
  return step;
}

FramingStep RequestFraming::Head(std::string_view window) {
  FramingStep step;
  // Empty lines before a request line are skipped (RFC 9112, 2.2), as some clients send one
  // after a body.
  if (window.starts_with("\n") || window.starts_with("\r\n")) {
    step.kind = FramingStep::Kind::kReplace;
    step.length = window[0] == '\n' ? 1 : 2;
    scanned_ = 0;
    return step;
  }
  const size_t end = HeadEnd(window, scanned_);
  path_ = PathOf(window);
  if (end == std::string_view::npos && window.size() <= limits_.max_head_bytes) {
    scanned_ = window.size() < 3 ? 0 : window.size() - 3;
    return step;  // not whole yet
  }
  scanned_ = 0;
  if (end == std::string_view::npos || end > limits_.max_head_bytes) {
    return Refuse(431, absl::StrCat("the request line and headers are over the router's limit "
                                    "of ",
                                    limits_.max_head_bytes, " bytes (--max-request-header-bytes)"));
  }
  const std::string_view head = window.substr(0, end);
  const size_t line_end = head.find('\n');
  RequestLine line;
  if (std::optional<Problem> problem =
          ReadRequestLine(WithoutEol(head.substr(0, line_end + 1)), &line)) {
    return Refuse(problem->status, std::move(problem->message));
  }
  BodyFraming body;
  if (std::optional<Problem> problem =
          ReadBodyFraming(head.substr(line_end + 1), line, limits_.max_body_bytes, &body)) {
    return Refuse(problem->status, std::move(problem->message));
  }
  ++heads_;
  step.kind = FramingStep::Kind::kPass;
  step.length = end;
  if (body.chunked) {
    state_ = State::kChunkLine;
    body_bytes_ = 0;
    trailer_bytes_ = 0;
  } else if (body.length > 0) {
    state_ = State::kBody;
    left_ = body.length;
  }
  return step;
}

FramingStep RequestFraming::ChunkLine(std::string_view window) {
  FramingStep step;
  const size_t eol = window.find('\n');
  if (eol == std::string_view::npos) {
    if (window.size() > kMaxChunkLineBytes) {
      return Refuse(400, "malformed chunked body: a chunk's size line is too long");
    }
    return step;
  }
  if (eol == 0 || window[eol - 1] != '\r') {
    return Refuse(400, "malformed chunked body: a chunk's size line must end with CRLF");
  }
  // chunk-size [ BWS ";" chunk-ext ] CRLF: hexadecimal digits, then extensions, which are
  // read and left out (libevent 2.1 refuses them).
  const std::string_view line = window.substr(0, eol - 1);
  size_t digits = 0;
  size_t significant = 0;  // digits after leading zeros: 15 hold any size a limit allows
  uint64_t size = 0;
  while (digits < line.size() && absl::ascii_isxdigit(static_cast<unsigned char>(line[digits]))) {
    const char c = absl::ascii_tolower(static_cast<unsigned char>(line[digits]));
    if (significant > 0 || c != '0') ++significant;
    if (significant > 15) return Refuse(413, BodyLimitMessage(limits_.max_body_bytes));
    size = size * 16 + static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
    ++digits;
  }
  if (digits == 0) return Refuse(400, "malformed chunked body: a chunk's size is not hexadecimal");
  std::string_view rest = TrimWhitespace(line.substr(digits));
  if (!rest.empty()) {
    if (rest.front() != ';') {
      return Refuse(400, "malformed chunked body: a chunk's size is not hexadecimal");
    }
    for (const char ch : rest) {
      const auto c = static_cast<unsigned char>(ch);
      if ((c < 0x20 && c != '\t') || c == 0x7f) {
        return Refuse(400, "malformed chunked body: a chunk extension has a control character");
      }
    }
  }
  if (size > limits_.max_body_bytes - std::min<uint64_t>(body_bytes_, limits_.max_body_bytes)) {
    return Refuse(413, BodyLimitMessage(limits_.max_body_bytes));
  }
  body_bytes_ += size;
  step.kind = FramingStep::Kind::kReplace;
  step.length = eol + 1;
  if (size == 0) {
    step.replacement = "0\r\n";
    state_ = State::kTrailers;
  } else {
    char hex[20];
    step.replacement =
        std::string(hex, static_cast<size_t>(std::snprintf(hex, sizeof(hex), "%llx\r\n",
                                                           static_cast<unsigned long long>(size))));
    state_ = State::kChunkData;
    left_ = size;
  }
  return step;
}

FramingStep RequestFraming::ChunkEnd(std::string_view window) {
  FramingStep step;
  if (window.starts_with("\r\n")) {
    step.kind = FramingStep::Kind::kPass;
    step.length = 2;
    state_ = State::kChunkLine;
    return step;
  }
  if (window.empty() || window == "\r") return step;
  return Refuse(400, "malformed chunked body: a chunk's data is not followed by CRLF");
}

FramingStep RequestFraming::Trailer(std::string_view window) {
  FramingStep step;
  const size_t eol = window.find('\n');
  if (eol == std::string_view::npos) {
    if (trailer_bytes_ + window.size() > limits_.max_head_bytes) {
      return Refuse(431,
                    "malformed chunked body: its trailers are over the header limit "
                    "(--max-request-header-bytes)");
    }
    return step;
  }
  trailer_bytes_ += eol + 1;
  if (trailer_bytes_ > limits_.max_head_bytes) {
    return Refuse(431,
                  "malformed chunked body: its trailers are over the header limit "
                  "(--max-request-header-bytes)");
  }
  const std::string_view line = WithoutEol(window.substr(0, eol + 1));
  step.kind = FramingStep::Kind::kReplace;
  step.length = eol + 1;
  if (line.empty()) {  // the end of the body: the next request's head follows
    step.replacement = "\r\n";
    state_ = State::kHead;
    return step;
  }
  // A trailer field is read and left out (the router reads none).
  const size_t colon = line.find(':');
  if (line.front() == ' ' || line.front() == '\t' || colon == std::string_view::npos ||
      !IsToken(line.substr(0, colon))) {
    return Refuse(400, "malformed chunked body: a trailer line is not a field");
  }
  return step;
}

FramedInput::FramedInput(FramingLimits limits)
    : framing_(limits), raw_(evbuffer_new()), framed_(evbuffer_new()) {}

FramedInput::~FramedInput() {
  evbuffer_free(raw_);
  evbuffer_free(framed_);
}

void FramedInput::Frame(evbuffer* input, size_t added) {
  // What libevent has still to read stays in front; the new bytes join what waits.
  evbuffer_remove_buffer(input, framed_, evbuffer_get_length(input) - added);
  evbuffer_add_buffer(raw_, input);
  while (!framing_.refused()) {
    const size_t available = evbuffer_get_length(raw_);
    const size_t wanted = std::min(available, framing_.WindowWanted());
    const char* window =
        wanted == 0
            ? ""
            : reinterpret_cast<const char*>(evbuffer_pullup(raw_, static_cast<ev_ssize_t>(wanted)));
    const FramingStep step = framing_.Next({window, wanted}, available);
    if (step.kind == FramingStep::Kind::kNeedMore) break;
    if (step.kind == FramingStep::Kind::kPass) {
      evbuffer_remove_buffer(raw_, framed_, step.length);
      continue;
    }
    evbuffer_drain(raw_, step.length);
    evbuffer_add(framed_, step.replacement.data(), step.replacement.size());
    if (step.kind == FramingStep::Kind::kRefuse) {
      refusal_ = step.refusal;
      refused_request_ = framing_.heads();
    }
  }
  if (framing_.refused()) evbuffer_drain(raw_, evbuffer_get_length(raw_));
  evbuffer_add_buffer(input, framed_);
}

}  // namespace kvcm::router
