// Regression test: a library linked into kvcm-executor must not stop civetweb's threads.
//
// Linking cuBLAS (its libcublasLt carries some 94 KB of static TLS) put that TLS on every
// thread's stack, and civetweb's worker threads, whose stack Debian's build fixes at
// 102,400 bytes, could no longer be created: every kvcm-executor of a CUDA build stopped at
// "metrics address 127.0.0.1:0: cannot listen: null context when constructing CivetServer".
// The CUDA forward now loads cuBLAS when it first needs it (docs/executor.md, "Where the model
// runs"). This binary links the model library as kvcm-executor does, the CUDA forward included
// where the build has one, and starts the metrics server and a thread of civetweb's stack size.

#include <pthread.h>

#include <memory>

#include "common/metrics/metrics_server.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "services/executor/model/llama_model_cuda.h"
#include "tests/support/status_matchers.h"

namespace kvcm::executor {
namespace {

// Referenced, so that the linker keeps the CUDA forward's object and the libraries it needs.
auto* volatile keep_cuda_forward = &LlamaCudaModel::Create;

constexpr size_t kCivetwebStackBytes = 102400;  // USE_STACK_SIZE in Debian's civetweb build

TEST(ExecutorThreadsTest, AThreadOfCivetwebsStackSizeStarts) {
  ASSERT_NE(keep_cuda_forward, nullptr);
  pthread_attr_t attributes;
  ASSERT_EQ(pthread_attr_init(&attributes), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attributes, kCivetwebStackBytes), 0);
  pthread_t thread;
  const int created = pthread_create(
      &thread, &attributes, [](void*) -> void* { return nullptr; }, nullptr);
  pthread_attr_destroy(&attributes);
  ASSERT_EQ(created, 0) << "a thread with a " << kCivetwebStackBytes
                        << "-byte stack cannot start (EINVAL: the static TLS of a linked "
                           "library leaves no room); civetweb's cannot either";
  ASSERT_EQ(pthread_join(thread, nullptr), 0);
}

TEST(ExecutorThreadsTest, TheMetricsServerStartsBesideTheModelLibrary) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start("127.0.0.1:0", std::make_shared<prometheus::Registry>());
  ASSERT_THAT(server, IsOk());
  EXPECT_GT((*server)->port(), 0);
}

}  // namespace
}  // namespace kvcm::executor
