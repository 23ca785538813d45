#include "tools/kvcmctl/flag_parser.h"

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcm::kvcmctl {
namespace {

const FlagSpec* FindSpec(absl::Span<const FlagSpec> specs, std::string_view name) {
  for (const FlagSpec& spec : specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

}  // namespace

std::optional<std::string> ParsedFlags::Get(std::string_view name) const {
  const auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<ParsedFlags> ParseFlags(absl::Span<const FlagSpec> specs,
                                       absl::Span<const std::string> args) {
  ParsedFlags parsed;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      parsed.positional_.insert(parsed.positional_.end(), args.begin() + i + 1, args.end());
      break;
    }
    std::string name;
    std::optional<std::string> inline_value;
    if (arg == "-h" && FindSpec(specs, "help") != nullptr) {
      name = "help";
    } else if (absl::StartsWith(arg, "--") && arg.size() > 2) {
      const std::string_view body = std::string_view(arg).substr(2);
      const size_t eq = body.find('=');
      name = std::string(body.substr(0, eq));
      if (eq != std::string_view::npos) inline_value = std::string(body.substr(eq + 1));
    } else if (absl::StartsWith(arg, "-") && arg.size() > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag \"", arg, "\"; flags are spelled --name"));
    } else {
      parsed.positional_.push_back(arg);
      continue;
    }

    const FlagSpec* spec = FindSpec(specs, name);
    if (spec == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (parsed.Has(name)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " given more than once"));
    }
    std::string value;
    if (spec->value_name.empty()) {
      if (inline_value.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", name, " takes no value, got \"", *inline_value, "\""));
      }
    } else if (inline_value.has_value()) {
      value = *inline_value;
    } else {
      if (i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value (--", name,
                                                       " ", std::string(spec->value_name), ")"));
      }
      value = args[++i];
    }
    parsed.values_.emplace(std::string(name), std::move(value));
  }
  return parsed;
}

std::string FlagHelp(absl::Span<const FlagSpec> specs) {
  size_t width = 0;
  for (const FlagSpec& spec : specs) {
    width = std::max(width, spec.name.size() + 1 + spec.value_name.size());
  }
  std::string out;
  for (const FlagSpec& spec : specs) {
    // std::string operations throughout: Debian's absl::StrCat takes no std::string_view.
    std::string left = "--" + std::string(spec.name);
    if (!spec.value_name.empty()) left += " " + std::string(spec.value_name);
    left.resize(std::max(left.size(), width + 4), ' ');
    out += "  " + left + std::string(spec.help) + "\n";
  }
  return out;
}

}  // namespace kvcm::kvcmctl
