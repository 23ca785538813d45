#include "common/wire/attach_codec.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/wire/convert.h"

namespace kvcm {

flatbuffers::Offset<wire::AttachReply> EncodeAttachReply(flatbuffers::FlatBufferBuilder& builder,
                                                         const PoolDescriptorInfo& pool) {
  const auto spec = ToWire(builder, pool.spec);
  const PoolStrides& strides = pool.layout;
  const auto layout = wire::CreatePoolLayout(
      builder, strides.layer_stride, strides.kv_stride, strides.block_stride, strides.token_stride,
      strides.head_stride, strides.elem_bytes, strides.total_bytes);
  const auto path = builder.CreateString(pool.fd_channel_path);
  const auto handle = builder.CreateVector(pool.cuda_ipc_handle);
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::KvCacheGroup>>> groups;
  if (!pool.kv_groups.empty()) {
    std::vector<flatbuffers::Offset<wire::KvCacheGroup>> each;
    for (const KvCacheGroup& group : pool.kv_groups) {
      each.push_back(
          wire::CreateKvCacheGroup(builder, group.window, builder.CreateVector(group.layers)));
    }
    groups = builder.CreateVector(each);
  }
  const auto descriptor = wire::CreatePoolDescriptor(
      builder, spec, pool.num_blocks, layout, pool.backend, pool.epoch, path, pool.cuda_device,
      handle, pool.sliding_window_tokens, groups);
  return wire::CreateAttachReply(builder, descriptor);
}

absl::StatusOr<PoolDescriptorInfo> DecodeAttachReply(const wire::AttachReply& reply) {
  const wire::PoolDescriptor* descriptor = reply.descriptor();
  if (descriptor == nullptr) return absl::InternalError("pool descriptor: missing");
  PoolDescriptorInfo out;
  absl::StatusOr<KvCacheSpec> spec = FromWire(descriptor->spec());
  if (!spec.ok()) {
    return absl::InternalError(
        absl::StrCat("pool descriptor: ", std::string(spec.status().message())));
  }
  out.spec = *spec;
  out.num_blocks = descriptor->num_blocks();
  const wire::PoolLayout* layout = descriptor->layout();
  if (layout == nullptr) return absl::InternalError("pool descriptor: layout missing");
  out.layout.layer_stride = layout->layer_stride();
  out.layout.kv_stride = layout->kv_stride();
  out.layout.block_stride = layout->block_stride();
  out.layout.token_stride = layout->token_stride();
  out.layout.head_stride = layout->head_stride();
  out.layout.elem_bytes = layout->elem_bytes();
  out.layout.total_bytes = layout->total_bytes();
  out.backend = descriptor->backend();
  out.epoch = descriptor->epoch();
  if (descriptor->fd_channel_path() != nullptr) {
    out.fd_channel_path = descriptor->fd_channel_path()->str();
  }
  out.cuda_device = descriptor->cuda_device();
  out.sliding_window_tokens = descriptor->sliding_window_tokens();
  if (const auto* handle = descriptor->cuda_ipc_handle(); handle != nullptr) {
    out.cuda_ipc_handle.assign(handle->begin(), handle->end());
  }
  if (const auto* groups = descriptor->kv_groups(); groups != nullptr) {
    for (const wire::KvCacheGroup* group : *groups) {
      KvCacheGroup& g = out.kv_groups.emplace_back();
      g.window = group->window();
      if (group->layers() != nullptr)
        g.layers.assign(group->layers()->begin(), group->layers()->end());
    }
  }
  return out;
}

}  // namespace kvcm
