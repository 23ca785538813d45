#pragma once
// The evaluator behind ChatTemplate (common/chat/chat_template.h): renders a parsed template
// (common/chat/jinja_parser.h) over a context, with the semantics of Jinja's
// ImmutableSandboxedEnvironment as transformers configures it: its globals raise_exception,
// strftime_now, namespace, dict and range; its tojson filter; loop controls; Jinja's
// scoping (a for body is a new scope each iteration; if does not open one; macros see the
// template's top level and their arguments).
//
// Errors (absl::Status):
//   INVALID_ARGUMENT  "chat template L:C: ..." for what Jinja would raise (undefined
//                     attribute access, type errors, ...) and for constructs outside the
//                     subset (with the --chat-template way out); raise_exception(msg) gives
//                     exactly msg.
//   RESOURCE_EXHAUSTED a limit of RenderLimits was reached (the message names it).
//
// Thread safety: one Interpreter renders once, on one thread; many may render the same
// parsed template concurrently (the tree is immutable).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/chat/jinja_parser.h"
#include "common/chat/jinja_value.h"

namespace kvcm::jinja {

struct RenderLimits {
  int64_t max_output_bytes = 16 << 20;  // also the largest string a template may build
  int64_t max_steps = 20'000'000;       // statements, expressions, loop iterations, bytes/256
  int max_call_depth = 64;              // nested macro calls
};

class Interpreter {
 public:
  // `context`: the template's variables (messages, add_generation_prompt, ...).
  Interpreter(const RenderLimits& limits, Dict context);

  absl::StatusOr<std::string> Render(const Body& body);

  // For builtins and bound methods.
  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name, CallArgs& args);
  absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<Value> CallValue(const Value& callee, CallArgs& args);
  // Accounts for `bytes` of work; RESOURCE_EXHAUSTED past the limits.
  absl::Status Charge(int64_t steps);
  absl::Status CheckSize(size_t bytes);
  // raise_exception(msg): an error that reaches the caller with msg unchanged.
  absl::Status Raise(std::string message);
  const RenderLimits& limits() const { return limits_; }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  using Frame = absl::flat_hash_map<std::string, Value>;

  absl::StatusOr<Flow> ExecBody(const Body& body, std::string& out);
  absl::StatusOr<Flow> Exec(const Stmt& stmt, std::string& out);
  absl::StatusOr<Flow> ExecFor(const Stmt& stmt, std::string& out);
  absl::Status Assign(const Stmt& stmt, Value value);
  absl::StatusOr<Value> Eval(const Expr& expr);
  absl::StatusOr<Value> EvalInner(const Expr& expr);
  absl::StatusOr<Value> EvalBinary(const Expr& expr);
  absl::StatusOr<Value> EvalCompare(const Expr& expr);
  absl::StatusOr<CallArgs> EvalArgs(const Expr& expr);
  absl::StatusOr<Value> CallMacro(const Stmt& macro, CallArgs& args);
  Value Lookup(const std::string& name) const;
  // Adds "chat template L:C: " to an error from a builtin.
  absl::Status At(const Expr& expr, absl::Status status) const;

  RenderLimits limits_;
  Dict context_;
  Frame builtins_;
  std::vector<Frame> frames_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  bool raised_ = false;
};

// Attribute and item access with Jinja's sandboxed semantics (obj.name tries the attribute,
// then the item; obj[key] the item, then the attribute). Errors on undefined objects.
absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name);
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key);

// The names the interpreter implements, sorted: the keys of its tables of filters, tests and
// methods (each name maps to one small function in jinja_filters.cc, jinja_tests.cc or
// jinja_methods.cc; docs/chat-templates.md lists the same names, which jinja_tables_test
// checks). SupportedMethods takes the receiver's Python type name ("str", "dict") and gives {}
// for a type without supported methods.
std::vector<std::string_view> SupportedFilters();
std::vector<std::string_view> SupportedTests();
std::vector<std::string_view> SupportedMethods(std::string_view type);

}  // namespace kvcm::jinja
