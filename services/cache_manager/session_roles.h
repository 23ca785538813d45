#pragma once
// A session's role as the cache manager counts it (SessionRole) and as the protocol names it
// (wire::Role), and its name for logs. Included by the service's .cc files only: the
// service's header includes no generated code.

#include <optional>

#include "schemas/kvcm_protocol_generated.h"
#include "services/cache_manager/cache_manager_metrics.h"

namespace kvcm::cache_manager {

inline std::optional<SessionRole> SessionRoleOf(wire::Role role) {
  switch (role) {
    case wire::Role::Router:
      return SessionRole::kRouter;
    case wire::Role::Executor:
      return SessionRole::kExecutor;
    case wire::Role::Control:
      return SessionRole::kControl;
    default:
      return std::nullopt;
  }
}

inline wire::Role WireRoleOf(SessionRole role) {
  switch (role) {
    case SessionRole::kRouter:
      return wire::Role::Router;
    case SessionRole::kExecutor:
      return wire::Role::Executor;
    case SessionRole::kControl:
      return wire::Role::Control;
    default:
      return wire::Role::Unknown;
  }
}

// Role name for logs ("router", "executor", "control", "unknown").
inline const char* RoleName(wire::Role role) {
  switch (role) {
    case wire::Role::Router:
      return "router";
    case wire::Role::Executor:
      return "executor";
    case wire::Role::Control:
      return "control";
    default:
      return "unknown";
  }
}

}  // namespace kvcm::cache_manager
