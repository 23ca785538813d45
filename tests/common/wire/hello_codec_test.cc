// The Hello codec: every value of a Hello and of a HelloReply survives the wire, and a reply
// the client cannot use is refused with the texts it has always given.

#include "common/wire/hello_codec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

TEST(HelloCodecTest, EveryFieldOfAHelloSurvives) {
  const HelloRequest hello = {
      .role = wire::Role::Executor, .pid = 4242, .name = "executor-3", .secret = "s3cret"};
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHello(builder, hello));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  ASSERT_TRUE(verifier.VerifyBuffer<wire::Hello>(nullptr));
  EXPECT_EQ(DecodeHello(*flatbuffers::GetRoot<wire::Hello>(builder.GetBufferPointer())), hello);
}

TEST(HelloCodecTest, AnEmptySecretIsLeftOut) {
  const HelloRequest hello = {.role = wire::Role::Control, .pid = 1, .name = "", .secret = ""};
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHello(builder, hello));
  const auto* wire_hello = flatbuffers::GetRoot<wire::Hello>(builder.GetBufferPointer());
  EXPECT_EQ(wire_hello->secret(), nullptr);
  ASSERT_NE(wire_hello->name(), nullptr);  // the name is always sent
  EXPECT_EQ(DecodeHello(*wire_hello), hello);

  flatbuffers::FlatBufferBuilder bare;
  bare.Finish(wire::CreateHello(bare, wire::Role::Router, 9));
  EXPECT_EQ(DecodeHello(*flatbuffers::GetRoot<wire::Hello>(bare.GetBufferPointer())),
            (HelloRequest{.role = wire::Role::Router, .pid = 9, .name = "", .secret = ""}));
}

SessionInfo Info() {
  SessionInfo info;
  info.session_id = 17;
  info.epoch = (uint64_t{1} << 40) + 5;
  info.heartbeat_interval = absl::Milliseconds(250);
  info.heartbeat_timeout = absl::Seconds(3);
  info.num_blocks = 1000;
  info.block_size = 16;
  info.hash_algorithm = HashAlgorithm::kXxh3V2;
  info.max_ops_per_step = 512;
  info.max_message_bytes = 1u << 24;
  info.wants_commit_tokens = true;
  return info;
}

absl::StatusOr<SessionInfo> RoundTrip(const SessionInfo& info) {
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeHelloReply(builder, info));
  return DecodeHelloReply(*flatbuffers::GetRoot<wire::HelloReply>(builder.GetBufferPointer()));
}

TEST(HelloCodecTest, EveryFieldOfAReplySurvives) {
  const SessionInfo info = Info();
  absl::StatusOr<SessionInfo> decoded = RoundTrip(info);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, info);
  SessionInfo other = info;
  other.hash_algorithm = HashAlgorithm::kSha256;
  other.wants_commit_tokens = false;
  other.group_windows = {0, 512, 512};
  decoded = RoundTrip(other);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, other);
}

TEST(HelloCodecTest, ANegativeGroupWindowIsRefused) {
  SessionInfo info = Info();
  info.group_windows = {0, -3};
  absl::StatusOr<SessionInfo> refused = RoundTrip(info);
  EXPECT_TRUE(absl::IsInternal(refused.status())) << refused.status();
}

TEST(HelloCodecTest, RepliesWithoutASessionOrWithAnUnknownHashAreRefused) {
  SessionInfo no_session = Info();
  no_session.session_id = 0;
  absl::StatusOr<SessionInfo> refused = RoundTrip(no_session);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused.status().message(), "HelloReply without a session id or epoch");

  SessionInfo no_epoch = Info();
  no_epoch.epoch = 0;
  EXPECT_EQ(RoundTrip(no_epoch).status().message(), "HelloReply without a session id or epoch");

  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(wire::CreateHelloReply(builder, 1, 1, 100, 1000, 8, 16,
                                        static_cast<wire::HashAlgorithm>(77)));
  refused = DecodeHelloReply(*flatbuffers::GetRoot<wire::HelloReply>(builder.GetBufferPointer()));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(refused.status().message(), "unknown hash algorithm value 77");
}

}  // namespace
}  // namespace kvcm
