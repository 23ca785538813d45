#pragma once
// Which HTTP API a request came through: TGI's or OpenAI's (docs/router.md, "HTTP API
// (TGI-compatible)" and "HTTP API (OpenAI-compatible)"). The one tag every layer of the
// router shares: the parsed request and its error (generation.h), the metrics' `api` label
// (router_metrics.h), the core's submissions and the dashboard (router_core.h), the route
// table's error shapes (http_server.h). Plain: no code.

#include <cstdint>

namespace kvcm::router {

enum class Api : uint8_t { kTgi, kOpenAi, kCount };
inline constexpr int kApis = static_cast<int>(Api::kCount);

// The router's name and version: /info's `router` and `version`, the OpenAPI document's
// info.version, OpenAI's system_fingerprint.
inline constexpr char kRouterName[] = "kvcm-router";
inline constexpr char kRouterVersion[] = "0.1.0";

}  // namespace kvcm::router
