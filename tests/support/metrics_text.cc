#include "tests/support/metrics_text.h"

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvcm::testing {
namespace {

absl::Status BadLine(int line_number, absl::string_view line, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("metrics line ", line_number, " (", std::string(why), "): ", std::string(line)));
}

bool IsNameChar(char c) { return absl::ascii_isalnum(c) || c == '_' || c == ':'; }

// Parses `{a="x",b="y"}` at the start of `rest`, advancing past it.
bool ParseLabels(absl::string_view& rest, MetricLabels& labels) {
  if (!absl::ConsumePrefix(&rest, "{")) return true;  // no labels
  while (true) {
    if (absl::ConsumePrefix(&rest, "}")) return true;
    size_t name_end = 0;
    while (name_end < rest.size() && IsNameChar(rest[name_end])) ++name_end;
    if (name_end == 0) return false;
    std::string name(rest.substr(0, name_end));
    rest.remove_prefix(name_end);
    if (!absl::ConsumePrefix(&rest, "=\"")) return false;
    std::string value;
    while (true) {
      if (rest.empty()) return false;
      const char c = rest.front();
      rest.remove_prefix(1);
      if (c == '"') break;
      if (c == '\\') {
        if (rest.empty()) return false;
        const char escaped = rest.front();
        rest.remove_prefix(1);
        value.push_back(escaped == 'n' ? '\n' : escaped);
      } else {
        value.push_back(c);
      }
    }
    labels.emplace(std::move(name), std::move(value));
    absl::ConsumePrefix(&rest, ",");
  }
}

}  // namespace

std::vector<MetricSample> MetricsText::Samples(std::string_view name) const {
  std::vector<MetricSample> found;
  for (const MetricSample& sample : samples) {
    if (sample.name == name) found.push_back(sample);
  }
  return found;
}

absl::StatusOr<double> MetricsText::Value(std::string_view name, const MetricLabels& labels) const {
  const MetricSample* match = nullptr;
  for (const MetricSample& sample : samples) {
    if (sample.name != name || sample.labels != labels) continue;
    if (match != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("two samples of ", std::string(name)));
    }
    match = &sample;
  }
  if (match == nullptr) {
    std::string wanted;
    for (const auto& [key, value] : labels) absl::StrAppend(&wanted, key, "=", value, " ");
    return absl::NotFoundError(absl::StrCat("no sample ", std::string(name), " ", wanted));
  }
  return match->value;
}

absl::StatusOr<MetricsText> ParseMetricsText(std::string_view text) {
  MetricsText parsed;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_number;
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "#")) {
      line = absl::StripLeadingAsciiWhitespace(line);
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 2));
      if (parts.size() == 3 && parts[0] == "TYPE") {
        parsed.types[std::string(parts[1])] = std::string(parts[2]);
      } else if (parts.size() >= 2 && parts[0] == "HELP") {
        parsed.helps[std::string(parts[1])] = parts.size() == 3 ? std::string(parts[2]) : "";
      }
      continue;  // other comments are allowed
    }
    MetricSample sample;
    absl::string_view rest = line;
    size_t name_end = 0;
    while (name_end < rest.size() && IsNameChar(rest[name_end])) ++name_end;
    if (name_end == 0) return BadLine(line_number, line, "no metric name");
    sample.name = std::string(rest.substr(0, name_end));
    rest.remove_prefix(name_end);
    if (!ParseLabels(rest, sample.labels)) return BadLine(line_number, line, "bad labels");
    rest = absl::StripLeadingAsciiWhitespace(rest);
    // The value, then an optional timestamp.
    const std::string value(rest.substr(0, rest.find(' ')));
    char* end = nullptr;
    sample.value = std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size()) {
      return BadLine(line_number, line, "bad value");
    }
    parsed.samples.push_back(std::move(sample));
  }
  return parsed;
}

}  // namespace kvcm::testing
