#pragma once
// Configuration of the kvcm binaries beyond their command line: environment variables and
// an optional YAML file (docs/operations.md, "Configuration").
//
// Every option of a binary is a long flag (--num-blocks). It can also be set by
//   - the environment variable KVCM_<SECTION>_<OPTION>, upper-cased:
//     KVCM_CACHE_MANAGER_NUM_BLOCKS=4096, KVCM_ROUTER_PORT=8080, KVCM_LAUNCH_EXECUTORS=2;
//   - the file given with --config FILE: one YAML mapping with a section per binary
//     (cache_manager:, router:, executor:, launch:), each a mapping of the binary's options
//     (underscored, as the variables' suffixes) to scalars. A binary reads only its own
//     section; every section present must be one of the four.
// Precedence: command line > environment > file > the flag's default. Values from the file
// and the environment are checked against the option's type even where a flag overrides
// them; an unknown key (in the binary's section) or an unknown KVCM_<SECTION>_ variable is
// an error naming it.
//
// Resolve() is the pure part (tested alone); ApplyToFlags() feeds it a binary's Abseil
// flags and sets them. kvcm-launch, which has its own parser, uses Resolve() directly.
// Nothing here is read below main: main.cc builds its Options from the flags afterwards.
//
// Thread safety: ApplyToFlags() sets process-wide flags: call it from main, before any
// thread starts. The rest are pure functions.

#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace kvcm::config {

// The sections a configuration file may hold, one per binary.
inline constexpr std::string_view kSections[] = {"cache_manager", "router", "executor", "launch"};

// "KVCM_" + section + "_" + option, upper-cased: ("cache_manager", "num_blocks") ->
// "KVCM_CACHE_MANAGER_NUM_BLOCKS".
std::string EnvironmentVariable(std::string_view section, std::string_view option);

// One section of a configuration file: option -> the scalar as written ("" for `key: ""`).
using SectionValues = std::map<std::string, std::string, std::less<>>;

// Parses `yaml` (the text of file `file_name`, named in errors) and returns `section`
// (empty when the file has none). INVALID_ARGUMENT naming the file: not YAML; the top level
// not a mapping; a section not one of kSections, or not a mapping; a value that is not a
// scalar (a list, a mapping, or null: write "" for an empty string), naming the key.
absl::StatusOr<SectionValues> ParseSection(std::string_view yaml, std::string_view file_name,
                                           std::string_view section);
// The same for the file at `path`. NOT_FOUND when it cannot be read.
absl::StatusOr<SectionValues> ReadSection(const std::string& path, std::string_view section);

// An option's value types: those of the services' flags.
enum class Type { kBool, kInt32, kInt64, kDouble, kString };
std::string_view TypeName(Type type);  // "bool", "int32", "int64", "double", "string"
// Whether `text` is a value of `type` (bool: true/false, yes/no, 1/0, as Abseil's flags).
bool IsValid(Type type, std::string_view text);

// An option a binary takes.
struct Option {
  std::string name;  // underscored, e.g. "num_blocks"
  Type type = Type::kString;
  std::string default_value;  // as the flag prints it
  // The value after the command line: the default unless the option was given there.
  std::string current_value;
};

// Where an option's effective value came from.
enum class Source { kDefault, kFile, kEnvironment, kCommandLine };

// An option's effective value.
struct Setting {
  std::string name;
  Type type = Type::kString;
  std::string value;
  Source source = Source::kDefault;
  std::string origin;  // the file's path, or the environment variable's name; "" otherwise
};

struct Inputs {
  std::string section;                       // one of kSections
  std::vector<Option> options;               // every option the binary takes
  std::set<std::string, std::less<>> given;  // names given on the command line
  std::string file_path;                     // "" = no --config
  SectionValues file;                        // the file's section (ReadSection)
  std::vector<std::string> environment;      // "NAME=VALUE" entries, as environ
};

// The effective value of every option, in inputs.options' order. INVALID_ARGUMENT: a key
// of the file that is no option ("unknown key K in section S of FILE"), a variable
// KVCM_<SECTION>_X where X is no option, or a value of the wrong type ("K in FILE: expected
// int32, got \"x\""), whichever source would win.
absl::StatusOr<std::vector<Setting>> Resolve(const Inputs& inputs);

// The options a binary defines as Abseil flags in the file `defining_file` (pass __FILE__
// from main.cc), with their types and current values. Flags of other types are left out.
std::vector<Option> FlagOptions(std::string_view defining_file);

// For the binary whose flags are defined in `defining_file` (its main.cc's __FILE__):
// reads --config (if given) and the environment, resolves, and sets every flag whose value
// comes from the file or the environment. Call after ParseDashedCommandLine. Errors: those
// of ReadSection and Resolve.
absl::StatusOr<std::vector<Setting>> ApplyToFlags(std::string_view section,
                                                  std::string_view defining_file);

// Whether --print-config was given: print PrintableConfig() on stdout and exit 0.
bool PrintConfigRequested();

// What a service's main() runs: its binary's name (for its log line), its section, its
// usage message, the file defining its flags (main.cc's __FILE__) and its own Main.
struct MainSpec {
  std::string_view binary;   // "kvcm-router"
  std::string_view section;  // "router"
  const char* usage;
  std::string_view defining_file;
  int (*run)(const std::vector<Setting>& settings);
};

// The body of every service's main(): parses the dashed command line, applies --config and
// the environment (ApplyToFlags), prints the configuration for --print-config (0), else
// runs spec.run with the settings; 1 with the error on a line of its own if they do not
// resolve.
int RunMain(int argc, char** argv, const MainSpec& spec);

// Whether an option's value is a secret, never logged or exported: its name contains
// "secret" and does not end in "_file" or "_path" (a path to a secret is shown). No option
// holds a secret itself today; this keeps one from leaking when one does.
bool IsSecret(std::string_view option);

// The value shown for `setting` in logs and metrics: "<redacted>" for a secret.
std::string ShownValue(const Setting& setting);

// One log line: "configuration: backend=auto block_size=8 (file) num_blocks=64 (env
// KVCM_CACHE_MANAGER_NUM_BLOCKS) port=0 (flag) ..." with where each non-default came from,
// strings quoted when empty or holding spaces, secrets redacted; then " from FILE" when a
// file was read.
std::string Describe(const std::vector<Setting>& settings, std::string_view file_path);

// The settings as the section of a configuration file ("section:\n  key: value\n...";
// strings double-quoted), which ParseSection reads back to the same values.
std::string PrintableConfig(std::string_view section, const std::vector<Setting>& settings);

// Adds the gauge `metric_name` (e.g. "kvcm_router_config_info") to `registry`: value 1,
// one label per setting (its shown value), plus `config_file` (the --config path or "").
void ExportInfoMetric(prometheus::Registry& registry, const std::string& metric_name,
                      const std::vector<Setting>& settings, std::string_view file_path);

// The --config flag's value ("" when not given).
std::string ConfigFilePath();

}  // namespace kvcm::config
