// The AttachReply codec: every value of a pool descriptor survives the wire, absent strings
// and handles read as empty, and a reply without its descriptor, layout or a valid spec is
// refused with the texts the client has always given.

#include "common/wire/attach_codec.h"

#include "common/wire/convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr KvCacheSpec kSpec = {
    .num_layers = 3, .num_kv_heads = 2, .head_dim = 16, .dtype = DType::kFloat16, .block_size = 4};

const wire::AttachReply& Root(const flatbuffers::FlatBufferBuilder& builder) {
  return *flatbuffers::GetRoot<wire::AttachReply>(builder.GetBufferPointer());
}

TEST(AttachCodecTest, EveryFieldOfADescriptorSurvives) {
  PoolDescriptorInfo pool;
  pool.spec = kSpec;
  pool.num_blocks = 8;
  pool.layout = {.layer_stride = 1u << 20,
                 .kv_stride = 1u << 19,
                 .block_stride = 256,
                 .token_stride = 64,
                 .head_stride = 32,
                 .elem_bytes = 2,
                 .total_bytes = (uint64_t{1} << 33) + 7};
  pool.backend = wire::PoolBackend::Cuda;
  pool.epoch = (uint64_t{1} << 40) + 5;
  pool.fd_channel_path = "pool.sock";
  pool.cuda_device = 3;
  pool.cuda_ipc_handle.assign(64, 0);
  for (size_t i = 0; i < pool.cuda_ipc_handle.size(); ++i) {
    pool.cuda_ipc_handle[i] = static_cast<uint8_t>(i * 7);
  }
  pool.kv_groups = {{.window = 0, .layers = {2}}, {.window = 64, .layers = {0, 1}}};
  flatbuffers::FlatBufferBuilder builder;
  builder.Finish(EncodeAttachReply(builder, pool));
  flatbuffers::Verifier verifier(builder.GetBufferPointer(), builder.GetSize());
  ASSERT_TRUE(verifier.VerifyBuffer<wire::AttachReply>(nullptr));
  absl::StatusOr<PoolDescriptorInfo> decoded = DecodeAttachReply(Root(builder));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(*decoded, pool);
}

TEST(AttachCodecTest, AbsentPathAndHandleReadAsEmpty) {
  flatbuffers::FlatBufferBuilder builder;
  const auto spec = ToWire(builder, kSpec);
  const auto layout = wire::CreatePoolLayout(builder);
  builder.Finish(wire::CreateAttachReply(
      builder, wire::CreatePoolDescriptor(builder, spec, 8, layout, wire::PoolBackend::Shm, 2)));
  absl::StatusOr<PoolDescriptorInfo> decoded = DecodeAttachReply(Root(builder));
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(decoded->epoch, 2u);
  EXPECT_TRUE(decoded->fd_channel_path.empty());
  EXPECT_TRUE(decoded->cuda_ipc_handle.empty());
}

TEST(AttachCodecTest, AReplyWithoutDescriptorLayoutOrSpecIsRefused) {
  flatbuffers::FlatBufferBuilder empty;
  empty.Finish(wire::CreateAttachReply(empty));
  absl::StatusOr<PoolDescriptorInfo> missing = DecodeAttachReply(Root(empty));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(missing.status().message(), "pool descriptor: missing");

  flatbuffers::FlatBufferBuilder no_layout;
  const auto spec = ToWire(no_layout, kSpec);
  no_layout.Finish(
      wire::CreateAttachReply(no_layout, wire::CreatePoolDescriptor(no_layout, spec, 8)));
  absl::StatusOr<PoolDescriptorInfo> layoutless = DecodeAttachReply(Root(no_layout));
  EXPECT_EQ(layoutless.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(layoutless.status().message(), "pool descriptor: layout missing");

  flatbuffers::FlatBufferBuilder no_spec;
  const auto layout = wire::CreatePoolLayout(no_spec);
  no_spec.Finish(
      wire::CreateAttachReply(no_spec, wire::CreatePoolDescriptor(no_spec, /*spec=*/0, 8, layout)));
  absl::StatusOr<PoolDescriptorInfo> specless = DecodeAttachReply(Root(no_spec));
  EXPECT_EQ(specless.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(specless.status().message(), HasSubstr("pool descriptor: "));
}

}  // namespace
}  // namespace kvcm
