// The OpenAPI document the router serves (GET /openapi.json, services/router/openapi.json)
// against the route table the router dispatches on (HttpFrontend::Routes()): every route is
// an operation of the document with its method, and the document has no other; every
// "$ref" resolves; the bounds named by x-kvcm-maximum are served at the router's flags.
// That real responses match it is tests/services/router/openapi_stack_test.cc's.

#include <set>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace kvcm::router
