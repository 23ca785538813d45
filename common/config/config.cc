#include "common/config/config.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/base/command_line.h"
#include "common/base/log.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "yaml-cpp/yaml.h"

extern char** environ;

ABSL_FLAG(std::string, config, "",
          "A YAML configuration file: a section per binary (cache_manager, router, executor, "
          "launch) of option: value. Flags and KVCM_<SECTION>_<OPTION> environment variables "
          "win over it (docs/operations.md, \"Configuration\").");
ABSL_FLAG(bool, print_config, false,
          "Print the effective configuration (as a section of a --config file) and exit.");

namespace kvcm::config {
namespace {

bool IsSection(std::string_view name) {
  return std::find(std::begin(kSections), std::end(kSections), name) != std::end(kSections);
}

std::string_view SourceName(Source source) {
  switch (source) {
    case Source::kDefault:
      return "default";
    case Source::kFile:
      return "file";
    case Source::kEnvironment:
      return "env";
    case Source::kCommandLine:
      return "flag";
  }
  return "";
}

std::string Quoted(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The option -> the Type of an Abseil flag, if it is one of ours.
bool FlagType(const absl::CommandLineFlag& flag, Type* type) {
  if (flag.IsOfType<bool>()) {
    *type = Type::kBool;
  } else if (flag.IsOfType<int32_t>()) {
    *type = Type::kInt32;
  } else if (flag.IsOfType<int64_t>()) {
    *type = Type::kInt64;
  } else if (flag.IsOfType<double>()) {
    *type = Type::kDouble;
  } else if (flag.IsOfType<std::string>()) {
    *type = Type::kString;
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::string EnvironmentVariable(std::string_view section, std::string_view option) {
  return absl::AsciiStrToUpper(
      absl::StrCat("KVCM_", std::string(section), "_", std::string(option)));
}

absl::StatusOr<SectionValues> ParseSection(std::string_view yaml, std::string_view file_name,
                                           std::string_view section) {
  const std::string file(file_name);
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not YAML: ", e.what()));
  }
  SectionValues values;
  if (root.IsNull()) return values;  // an empty file
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file,
                     ": expected a mapping of sections (cache_manager:, router:, "
                     "executor:, launch:) at the top level"));
  }
  for (const auto& entry : root) {
    const std::string name = entry.first.as<std::string>("");
    if (!IsSection(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown section \"", name, "\" in ", file, " (sections: ",
          absl::StrJoin(std::vector<std::string>(std::begin(kSections), std::end(kSections)), ", "),
          ")"));
    }
    if (name != section) continue;
    if (entry.second.IsNull()) continue;  // "router:" with nothing under it
    if (!entry.second.IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrCat("section ", name, " in ", file, ": expected a mapping of option: value"));
    }
    for (const auto& option : entry.second) {
      const std::string key = option.first.as<std::string>("");
      const YAML::Node& value = option.second;
      if (!value.IsScalar()) {
        return absl::InvalidArgumentError(
            absl::StrCat(key, " in section ", name, " of ", file, ": expected a scalar, got ",
                         value.IsNull()       ? "nothing (write \"\" for an empty string)"
                         : value.IsSequence() ? "a list"
                                              : "a mapping"));
      }
      if (!values.emplace(key, value.Scalar()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(key, " appears twice in section ", name, " of ", file));
      }
    }
  }
  return values;
}

absl::StatusOr<SectionValues> ReadSection(const std::string& path, std::string_view section) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --config ", path));
  return ParseSection(text.str(), path, section);
}

std::string_view TypeName(Type type) {
  switch (type) {
    case Type::kBool:
      return "bool";
    case Type::kInt32:
      return "int32";
    case Type::kInt64:
      return "int64";
    case Type::kDouble:
      return "double";
    case Type::kString:
      return "string";
  }
  return "";
}

bool IsValid(Type type, std::string_view view) {
  const std::string text(view);
  switch (type) {
    case Type::kBool: {
      static constexpr std::string_view kWords[] = {"true", "false", "t", "f", "yes",
                                                    "no",   "y",     "n", "1", "0"};
      const std::string lower = absl::AsciiStrToLower(text);
      return std::find(std::begin(kWords), std::end(kWords), lower) != std::end(kWords);
    }
    case Type::kInt32: {
      int32_t v = 0;
      return absl::SimpleAtoi(text, &v);
    }
    case Type::kInt64: {
      int64_t v = 0;
      return absl::SimpleAtoi(text, &v);
    }
    case Type::kDouble: {
      double v = 0;
      return absl::SimpleAtod(text, &v);
    }
    case Type::kString:
      return true;
  }
  return false;
}

absl::StatusOr<std::vector<Setting>> Resolve(const Inputs& inputs) {
  std::map<std::string, const Option*, std::less<>> by_name;
  for (const Option& option : inputs.options) by_name[option.name] = &option;

  for (const auto& [key, value] : inputs.file) {
    auto it = by_name.find(key);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown key \"", key, "\" in section ",
                                                     inputs.section, " of ", inputs.file_path));
    }
    if (!IsValid(it->second->type, value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, " in section ", inputs.section, " of ", inputs.file_path, ": expected ",
                       std::string(TypeName(it->second->type)), ", got ", Quoted(value)));
    }
  }
  const std::string prefix = EnvironmentVariable(inputs.section, "");
  std::map<std::string, std::string, std::less<>> from_env;  // option -> value
  for (const std::string& entry : inputs.environment) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || !absl::StartsWith(entry, prefix)) continue;
    const std::string variable = entry.substr(0, eq);
    const std::string value = entry.substr(eq + 1);
    const std::string option = absl::AsciiStrToLower(variable.substr(prefix.size()));
    auto it = by_name.find(option);
    // Upper-cased names only: KVCM_ROUTER_port is not the variable of an option.
    if (it == by_name.end() || variable != EnvironmentVariable(inputs.section, option)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown environment variable ", variable, ": ", inputs.section,
                       " has no option \"", option, "\" (variables are ", prefix, "<OPTION>)"));
    }
    if (!IsValid(it->second->type, value)) {
      return absl::InvalidArgumentError(absl::StrCat(variable, ": expected ",
                                                     std::string(TypeName(it->second->type)),
                                                     ", got ", Quoted(value)));
    }
    from_env[option] = value;
  }

  std::vector<Setting> settings;
  settings.reserve(inputs.options.size());
  for (const Option& option : inputs.options) {
    Setting setting{option.name, option.type, option.current_value, Source::kDefault, ""};
    if (inputs.given.contains(option.name)) {
      setting.source = Source::kCommandLine;
    } else if (auto env = from_env.find(option.name); env != from_env.end()) {
      setting.value = env->second;
      setting.source = Source::kEnvironment;
      setting.origin = EnvironmentVariable(inputs.section, option.name);
    } else if (auto file = inputs.file.find(option.name); file != inputs.file.end()) {
      setting.value = file->second;
      setting.source = Source::kFile;
      setting.origin = inputs.file_path;
    }
    settings.push_back(std::move(setting));
  }
  return settings;
}

std::vector<Option> FlagOptions(std::string_view defining_file) {
  const std::string_view want = defining_file;
  std::vector<Option> options;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    // Abseil reports the file with its leading slashes removed.
    std::string_view file = want;
    while (!file.empty() && file.front() == '/') file.remove_prefix(1);
    if (flag->Filename() != file) continue;
    Option option;
    if (!FlagType(*flag, &option.type)) continue;
    option.name = std::string(name);
    option.default_value = flag->DefaultValue();
    option.current_value = flag->CurrentValue();
    options.push_back(std::move(option));
  }
  std::sort(options.begin(), options.end(),
            [](const Option& a, const Option& b) { return a.name < b.name; });
  return options;
}

std::string ConfigFilePath() { return absl::GetFlag(FLAGS_config); }

bool PrintConfigRequested() { return absl::GetFlag(FLAGS_print_config); }

absl::StatusOr<std::vector<Setting>> ApplyToFlags(std::string_view section,
                                                  std::string_view defining_file) {
  Inputs inputs;
  inputs.section = std::string(section);
  inputs.options = FlagOptions(defining_file);
  for (const Option& option : inputs.options) {
    if (FlagGiven(option.name)) inputs.given.insert(option.name);
  }
  inputs.file_path = ConfigFilePath();
  if (!inputs.file_path.empty()) {
    absl::StatusOr<SectionValues> file = ReadSection(inputs.file_path, section);
    if (!file.ok()) return file.status();
    inputs.file = *std::move(file);
  }
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    inputs.environment.emplace_back(*entry);
  }
  absl::StatusOr<std::vector<Setting>> settings = Resolve(inputs);
  if (!settings.ok()) return settings.status();
  for (const Setting& setting : *settings) {
    if (setting.source != Source::kFile && setting.source != Source::kEnvironment) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(setting.name);
    std::string error;
    if (flag == nullptr || !flag->ParseFrom(setting.value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(setting.name, " from ", setting.origin, ": ", error));
    }
  }
  return settings;
}

bool IsSecret(std::string_view view) {
  const std::string option(view);
  return absl::StrContains(option, "secret") && !absl::EndsWith(option, "_file") &&
         !absl::EndsWith(option, "_path");
}

std::string ShownValue(const Setting& setting) {
  return IsSecret(setting.name) ? "<redacted>" : setting.value;
}

std::string Describe(const std::vector<Setting>& settings, std::string_view file_path) {
  std::vector<std::string> parts;
  for (const Setting& setting : settings) {
    std::string value = ShownValue(setting);
    if (setting.type == Type::kString &&
        (value.empty() || value.find_first_of(" \t\"") != std::string::npos)) {
      value = Quoted(value);
    }
    std::string part = absl::StrCat(setting.name, "=", value);
    if (setting.source == Source::kEnvironment) {
      absl::StrAppend(&part, " (env ", setting.origin, ")");
    } else if (setting.source != Source::kDefault) {
      absl::StrAppend(&part, " (", std::string(SourceName(setting.source)), ")");
    }
    parts.push_back(std::move(part));
  }
  std::string line = absl::StrCat("configuration: ", absl::StrJoin(parts, " "));
  if (!file_path.empty()) absl::StrAppend(&line, " from ", std::string(file_path));
  return line;
}

std::string PrintableConfig(std::string_view section, const std::vector<Setting>& settings) {
  std::string out = absl::StrCat(std::string(section), ":\n");
  for (const Setting& setting : settings) {
    const std::string value = ShownValue(setting);
    absl::StrAppend(&out, "  ", setting.name, ": ",
                    setting.type == Type::kString ? Quoted(value) : value, "\n");
  }
  return out;
}

void ExportInfoMetric(prometheus::Registry& registry, const std::string& metric_name,
                      const std::vector<Setting>& settings, std::string_view file_path) {
  std::map<std::string, std::string> labels;
  for (const Setting& setting : settings) labels[setting.name] = ShownValue(setting);
  labels["config_file"] = std::string(file_path);
  auto& family = prometheus::BuildGauge()
                     .Name(metric_name)
                     .Help(
                         "Always 1; the labels are the effective configuration, one per "
                         "option (secrets redacted), and the --config file read (\"\" for "
                         "none).")
                     .Register(registry);
  family.Add(labels).Set(1);
}

int RunMain(int argc, char** argv, const MainSpec& spec) {
  absl::SetProgramUsageMessage(spec.usage);
  ParseDashedCommandLine(argc, argv);
  // Environment and --config for the flags not on the command line.
  absl::StatusOr<std::vector<Setting>> settings = ApplyToFlags(spec.section, spec.defining_file);
  if (!settings.ok()) {
    LogLine(spec.binary, absl::StrCat("error: ", settings.status().message()));
    return 1;
  }
  if (PrintConfigRequested()) {
    std::fputs(PrintableConfig(spec.section, *settings).c_str(), stdout);
    return 0;
  }
  return spec.run(*settings);
}

}  // namespace kvcm::config
