// The OpenAPI document the router serves (GET /openapi.json, services/router/openapi.json)
// against the route table the router dispatches on (HttpFrontend::Routes()): every route is
// an operation of the document with its method, and the document has no other; every
// "$ref" resolves; the bounds named by x-kvcm-maximum are served at the router's flags;
// each TGI route's responses require every member TGI's own document requires
// (tests/openapi/tgi_required_fields.json; docs/router.md, "TGI's schema").
// That real responses match it is tests/services/router/openapi_stack_test.cc's.

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/router/http_frontend.h"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

json Document(const HttpFrontend::Options& options = {}) {
  return json::parse(HttpFrontend::OpenApiDocument(options));
}

// Every "$ref" under `node`.
void CollectRefs(const json& node, std::vector<std::string>* refs) {
  if (node.is_object()) {
    for (const auto& [key, value] : node.items()) {
      if (key == "$ref" && value.is_string()) refs->push_back(value.get<std::string>());
      CollectRefs(value, refs);
    }
  } else if (node.is_array()) {
    for (const json& value : node) CollectRefs(value, refs);
  }
}

// Every object under `node` with an x-kvcm-maximum.
void CollectBounds(const json& node, std::vector<json>* bounds) {
  if (node.is_object() && node.contains("x-kvcm-maximum")) bounds->push_back(node);
  if (node.is_structured()) {
    for (const json& value : node) CollectBounds(value, bounds);
  }
}

TEST(OpenApiDocumentTest, DocumentsExactlyTheRoutesTheRouterServes) {
  const json document = Document();
  EXPECT_EQ(document["openapi"], "3.1.0");
  std::set<std::string> served;
  for (const HttpRoute& route : HttpFrontend::Routes()) {
    std::string method(route.method);
    for (char& c : method) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const std::string path(route.path);
    EXPECT_TRUE(served.insert(absl::StrCat(std::string(route.method), " ", path)).second)
        << "two routes for " << method << " " << path;
    ASSERT_TRUE(document["paths"].contains(path)) << path << " is served, not documented";
    const json& operations = document["paths"][path];
    EXPECT_EQ(operations.size(), 1u) << path << ": one method per route";
    ASSERT_TRUE(operations.contains(method)) << route.method << " " << path << " is not documented";
    const json& responses = operations[method]["responses"];
    EXPECT_TRUE(responses.contains("200")) << path;
    // Another method is answered 405 (http_frontend.cc, Route()).
    EXPECT_TRUE(responses.contains("405")) << path;
  }
  EXPECT_GE(served.size(), 13u);
  for (const auto& [path, operations] : document["paths"].items()) {
    for (const auto& [method, operation] : operations.items()) {
      std::string upper = method;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      EXPECT_TRUE(served.count(absl::StrCat(upper, " ", path)))
          << upper << " " << path << " is documented, the router does not serve it";
    }
  }
}

TEST(OpenApiDocumentTest, EveryReferenceResolves) {
  const json document = Document();
  std::vector<std::string> refs;
  CollectRefs(document, &refs);
  EXPECT_GT(refs.size(), 20u);
  for (const std::string& ref : refs) {
    ASSERT_EQ(ref.rfind("#/", 0), 0u) << ref;
    EXPECT_TRUE(document.contains(json::json_pointer(ref.substr(1)))) << ref;
  }
}

TEST(OpenApiDocumentTest, TheRoutersFlagsBoundTheParameters) {
  HttpFrontend::Options options;
  options.max_total_tokens = 77;
  options.max_input_tokens = 33;
  options.max_top_n_tokens = 3;
  options.max_best_of = 2;
  const json document = Document(options);
  std::vector<json> bounds;
  CollectBounds(document, &bounds);
  std::set<std::string> named;
  for (const json& bound : bounds) {
    const std::string flag = bound["x-kvcm-maximum"].get<std::string>();
    named.insert(flag);
    const int64_t want = flag == "max_total_tokens"   ? 77
                         : flag == "max_input_tokens" ? 33
                         : flag == "max_top_n_tokens" ? 3
                         : flag == "max_best_of"      ? 2
                                                      : -1;
    EXPECT_EQ(bound["maximum"], want) << bound.dump();
  }
  EXPECT_EQ(named, (std::set<std::string>{"max_total_tokens", "max_input_tokens",
                                          "max_top_n_tokens", "max_best_of"}));
  const json& tgi = document["components"]["schemas"]["GenerateParameters"]["properties"];
  EXPECT_EQ(tgi["max_new_tokens"]["maximum"], 77);
  EXPECT_EQ(tgi["best_of"]["maximum"], 2);
  EXPECT_EQ(document["info"]["version"], "0.1.0");
}

// Walks the router's document along TGI's required members (tgi_required_fields.json),
// collecting where the document does not require one.
class TgiRequiredInDocument {
 public:
  TgiRequiredInDocument(const json& document, const json& lists)
      : document_(document), lists_(lists) {}

  // The schema `node` (of the router's document) against TGI's `type`.
  void Check(const json& node, std::string type, const std::string& where) {
    if (absl::EndsWith(type, "|null")) type.resize(type.size() - 5);
    const json& schemas = lists_["schemas"];
    if (absl::EndsWith(type, "[]")) {
      const json items = Items(node);
      if (items.is_null()) return Fail(where, "is not an array of items");
      return Check(items, type.substr(0, type.size() - 2), absl::StrCat(where, "[]"));
    }
    if (!schemas.contains(type)) return;  // a JSON type: the stack test checks values
    std::set<std::string> required;
    json properties = json::object();
    Collect(node, schemas[type]["required"], &required, &properties);
    for (const auto& [member, member_type] : schemas[type]["required"].items()) {
      const std::string at = absl::StrCat(where, ".", member);
      if (!required.count(member) && !Excepted(type, member)) {
        Fail(at, absl::StrCat("is not required (TGI's ", type, " requires it)"));
      }
      if (properties.contains(member)) Check(properties[member], member_type, at);
    }
    if (schemas[type].contains("optional")) {
      for (const auto& [member, member_type] : schemas[type]["optional"].items()) {
        if (properties.contains(member)) {
          Check(properties[member], member_type, absl::StrCat(where, ".", member));
        }
      }
    }
  }

  // The schema of `route`'s 200 for `media` ("METHOD /path"), the JSON of an event for a
  // stream.
  json Response(const std::string& route, const std::string& media) const {
    const size_t space = route.find(' ');
    std::string method = route.substr(0, space);
    for (char& c : method) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const json& content =
        document_["paths"][route.substr(space + 1)][method]["responses"]["200"]["content"];
    if (!content.contains(media)) return json();
    json schema = Resolve(content[media]["schema"]);
    if (media != "text/event-stream") return schema;
    const json& data = schema["properties"]["data"];
    return Resolve(data.contains("contentSchema") ? data["contentSchema"]
                                                  : data["else"]["contentSchema"]);
  }

  const std::vector<std::string>& failures() const { return failures_; }

 private:
  // /tokenize's start and stop are left out when the tokenizer normalizes the text
  // (docs/router.md, "TGI's schema"): documented, not required.
  static bool Excepted(const std::string& type, const std::string& member) {
    return type == "SimpleToken" && (member == "start" || member == "stop");
  }

  json Resolve(const json& node) const {
    if (node.is_object() && node.contains("$ref")) {
      return Resolve(document_.at(json::json_pointer(node["$ref"].get<std::string>().substr(1))));
    }
    return node;
  }
  json Items(const json& node) const {
    const json resolved = Resolve(node);
    if (resolved.contains("items")) return Resolve(resolved["items"]);
    for (const char* key : {"oneOf", "anyOf", "allOf"}) {
      if (!resolved.contains(key)) continue;
      for (const json& branch : resolved[key]) {
        json items = Items(branch);
        if (!items.is_null()) return items;
      }
    }
    return json();
  }
  // The required members and properties of the object `node` describes: allOf's every
  // branch; of oneOf's and anyOf's, the object branches with one of TGI's members (not an
  // error's or null's).
  void Collect(const json& node, const json& tgi_required, std::set<std::string>* required,
               json* properties) const {
    const json resolved = Resolve(node);
    if (resolved.contains("required")) {
      for (const json& name : resolved["required"]) required->insert(name.get<std::string>());
    }
    if (resolved.contains("properties")) {
      for (const auto& [name, schema] : resolved["properties"].items()) {
        if (!properties->contains(name)) (*properties)[name] = schema;
      }
    }
    if (resolved.contains("allOf")) {
      for (const json& branch : resolved["allOf"]) {
        Collect(branch, tgi_required, required, properties);
      }
    }
    for (const char* key : {"oneOf", "anyOf"}) {
      if (!resolved.contains(key)) continue;
      for (const json& branch : resolved[key]) {
        std::set<std::string> branch_required;
        json branch_properties = json::object();
        Collect(branch, tgi_required, &branch_required, &branch_properties);
        bool tgi_object = false;
        for (const auto& [member, type] : tgi_required.items()) {
          tgi_object = tgi_object || branch_properties.contains(member);
        }
        if (!tgi_object) continue;
        required->insert(branch_required.begin(), branch_required.end());
        for (const auto& [name, schema] : branch_properties.items()) {
          if (!properties->contains(name)) (*properties)[name] = schema;
        }
      }
    }
  }
  void Fail(const std::string& where, const std::string& what) {
    failures_.push_back(absl::StrCat(where, " ", what));
  }

  const json& document_;
  const json& lists_;
  std::vector<std::string> failures_;
};

TEST(OpenApiDocumentTest, TgiRoutesRequireWhatTgiRequires) {
  std::ifstream file(KVCM_SOURCE_DIR "/tests/openapi/tgi_required_fields.json");
  ASSERT_TRUE(file.good());
  const json lists = json::parse(file, nullptr, false);
  ASSERT_TRUE(lists.is_object());
  const json document = Document();
  TgiRequiredInDocument check(document, lists);
  size_t responses = 0;
  for (const auto& [route, media_types] : lists["paths"].items()) {
    for (const auto& [media, type] : media_types.items()) {
      json schema = check.Response(route, media);
      std::string tgi_type = type.get<std::string>();
      // OpenAI's list, each entry TGI's ModelInfo (docs/router.md, "TGI's schema").
      if (route == "GET /v1/models") {
        schema = schema["properties"]["data"];
        tgi_type += "[]";
      }
      EXPECT_FALSE(schema.is_null()) << route << " has no " << media << " 200";
      if (schema.is_null()) continue;
      check.Check(schema, tgi_type, absl::StrCat(route, " ", media));
      ++responses;
    }
  }
  EXPECT_GE(responses, 12u);
  std::string failures;
  for (const std::string& failure : check.failures()) absl::StrAppend(&failures, failure, "\n");
  EXPECT_TRUE(check.failures().empty()) << failures;
}

}  // namespace
}  // namespace kvcm::router
