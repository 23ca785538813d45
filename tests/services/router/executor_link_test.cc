// The router's ExecutorLink over a real ZeroMQ socket, executors played by DEALERs sending
// the real codec's ExecutorHello: a step of a cache-manager epoch goes only to executors that
// announced that epoch (docs/architecture.md, "Fencing"), and an executor that attaches to
// a new epoch and says Hello again is counted in the new one alone.

#include "services/router/executor_link.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/transport/event_loop.h"
#include "common/transport/zmq_util.h"
#include "common/wire/executor_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/subprocess.h"

namespace kvcm::router {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

ExecutorHello Hello(const std::string& name) {
  ExecutorHello hello;
  hello.name = name;
  hello.pid = static_cast<int32_t>(::getpid());
  hello.model.name = "tiny";
  hello.model.num_layers = 4;
  hello.model.hidden_size = 64;
  hello.model.num_attention_heads = 4;
  hello.model.num_kv_heads = 2;
  hello.model.head_dim = 16;
  hello.model.vocab_size = 320;
  hello.model.max_position_embeddings = 2048;
  hello.model.eos_token_ids = {2};
  hello.kv_spec = {4, 2, 16, DType::kFloat16, 16};
  hello.num_blocks = 64;
  return hello;
}

class ExecutorLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = kvcm::testing::TempDir::Create("kvcm-executor-link");
    ASSERT_THAT(dir, IsOk());
    dir_.emplace(*std::move(dir));
    ExecutorLink::Options options;
    options.endpoint = "ipc://" + dir_->path() + "/router-executors.sock";
    link_ = std::make_unique<ExecutorLink>(context_, &loop_, options);
    ASSERT_THAT(link_->Bind(), IsOk());
    endpoint_ = options.endpoint;
  }

  zmq::socket_t Connect() {
    zmq::socket_t dealer(context_, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.connect(endpoint_);
    return dealer;
  }

  // Sends an ExecutorHello announcing `epoch` and returns once the link has read it and
  // answered (the reply read off the DEALER).
  void SayHello(zmq::socket_t& dealer, const std::string& name, uint64_t epoch) {
    flatbuffers::FlatBufferBuilder builder;
    EncodeExecutorHello(builder, ++request_, 0, epoch, Hello(name));
    dealer.send(zmq::const_buffer(builder.GetBufferPointer(), builder.GetSize()),
                zmq::send_flags::none);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      link_->HandleReadable(MonotonicNow());
      zmq::message_t reply;
      if (dealer.recv(reply, zmq::recv_flags::dontwait)) return;
      absl::SleepFor(absl::Milliseconds(2));
    }
    ADD_FAILURE() << "no ExecutorHelloReply for " << name;
  }

  zmq::context_t context_;
  EventLoop loop_;
  std::optional<kvcm::testing::TempDir> dir_;
  std::unique_ptr<ExecutorLink> link_;
  std::string endpoint_;
  uint64_t request_ = 0;
};

TEST_F(ExecutorLinkTest, StepsOfAnEpochGoOnlyToExecutorsThatAnnouncedIt) {
  zmq::socket_t a = Connect();
  zmq::socket_t b = Connect();
  ASSERT_NO_FATAL_FAILURE(SayHello(a, "exec-a", 5));
  ASSERT_NO_FATAL_FAILURE(SayHello(b, "exec-b", 4));  // still attached to the old epoch
  ASSERT_EQ(link_->Live().size(), 2u);
  const uint64_t id_a = link_->LiveInEpoch(5).at(0);
  EXPECT_THAT(link_->LiveInEpoch(5), ElementsAre(id_a));
  EXPECT_EQ(link_->LiveInEpoch(4).size(), 1u);
  EXPECT_THAT(link_->LiveInEpoch(6), IsEmpty());

  // b attaches to epoch 5 and says Hello again: it is a new executor of epoch 5, and its
  // registration in 4 is gone (dropped without proof that it stopped: the router drains
  // what it was running).
  const uint64_t old_b = link_->LiveInEpoch(4).at(0);
  ASSERT_NO_FATAL_FAILURE(SayHello(b, "exec-b", 5));
  EXPECT_THAT(link_->LiveInEpoch(4), IsEmpty());
  const std::vector<uint64_t> in_five = link_->LiveInEpoch(5);
  ASSERT_EQ(in_five.size(), 2u);
  EXPECT_EQ(in_five[0], id_a);
  EXPECT_GT(in_five[1], old_b);
  EXPECT_THAT(link_->TakeUnconfirmed(), ElementsAre(old_b));
}

}  // namespace
}  // namespace kvcm::router
