#pragma once

// Status propagation helpers (Abseil 20220623 ships none).
//
//   KVCM_RETURN_IF_ERROR(DoThing());
//   KVCM_ASSIGN_OR_RETURN(auto plan, PlanThing());

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVCM_STATUS_CONCAT_INNER(a, b) a##b
#define KVCM_STATUS_CONCAT(a, b) KVCM_STATUS_CONCAT_INNER(a, b)

#define KVCM_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status kvcm_status_ = (expr);        \
    if (!kvcm_status_.ok()) return kvcm_status_; \
  } while (false)

#define KVCM_ASSIGN_OR_RETURN(lhs, expr) \
  KVCM_ASSIGN_OR_RETURN_IMPL(KVCM_STATUS_CONCAT(kvcm_statusor_, __LINE__), lhs, expr)

#define KVCM_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr)    \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
