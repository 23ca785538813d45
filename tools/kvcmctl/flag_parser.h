#pragma once

// A small parser for one subcommand's flags. Each command declares its flags in a table in
// the .cc that owns them; nothing is global, so `kvcmctl plan` does not accept `watch`'s
// flags and the other way round.
//
// Accepted forms: "--name value", "--name=value", and "--name" for a boolean flag. "--"
// ends the flags; later words are positional. "-h" is an alias of "--help" when the table
// declares "help".
//
// Thread safety: none needed; plain values.

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvcm::kvcmctl {

struct FlagSpec {
  std::string_view name;        // without the dashes, e.g. "kv-heads"
  std::string_view value_name;  // shown in help, e.g. "N" or "BYTES"; empty: a boolean flag
  std::string_view help;        // one line, says the default
};

// The flags found on one command line.
class ParsedFlags {
 public:
  // True when the flag appeared (boolean or with a value).
  bool Has(std::string_view name) const { return values_.find(name) != values_.end(); }

  // The flag's value as written; nullopt when the flag did not appear.
  std::optional<std::string> Get(std::string_view name) const;

  const std::vector<std::string>& positional() const { return positional_; }

 private:
  friend absl::StatusOr<ParsedFlags> ParseFlags(absl::Span<const FlagSpec> specs,
                                                absl::Span<const std::string> args);

  std::map<std::string, std::string, std::less<>> values_;  // boolean flags map to ""
  std::vector<std::string> positional_;
};

// INVALID_ARGUMENT naming the flag for: an unknown flag, a flag given twice, a missing
// value (the next word is absent or itself starts with "--"), or a value given to a boolean
// flag.
absl::StatusOr<ParsedFlags> ParseFlags(absl::Span<const FlagSpec> specs,
                                       absl::Span<const std::string> args);

// One line per flag, aligned: "  --kv-heads N        KV heads per layer ...".
std::string FlagHelp(absl::Span<const FlagSpec> specs);

}  // namespace kvcm::kvcmctl
