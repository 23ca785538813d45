#include "tests/support/vllm_event_reader.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/monotonic_clock.h"
#include "common/transport/zmq_util.h"
#include "msgpack.hpp"

namespace kvcm::testing {
namespace {

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("vLLM event payload: ", std::string(what)));
}

bool IsUnsigned(const msgpack::object& o) { return o.type == msgpack::type::POSITIVE_INTEGER; }

absl::StatusOr<std::string> AsString(const msgpack::object& o, std::string_view field) {
  if (o.type != msgpack::type::STR)
    return Bad(absl::StrCat(std::string(field), " is not a string"));
  return std::string(o.via.str.ptr, o.via.str.size);
}

absl::StatusOr<std::vector<uint64_t>> AsHashes(const msgpack::object& o) {
  if (o.type != msgpack::type::ARRAY) return Bad("block_hashes is not an array");
  std::vector<uint64_t> hashes;
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    const msgpack::object& h = o.via.array.ptr[i];
    if (!IsUnsigned(h)) return Bad(absl::StrCat("block hash ", i, " is not an unsigned integer"));
    hashes.push_back(h.via.u64);
  }
  return hashes;
}

absl::StatusOr<uint64_t> ReadSeq(const zmq::message_t& frame) {
  if (frame.size() != 8) return Bad(absl::StrCat("seq frame of ", frame.size(), " bytes"));
  uint64_t seq = 0;
  const auto* bytes = static_cast<const uint8_t*>(frame.data());
  for (int i = 0; i < 8; ++i) seq = (seq << 8) | bytes[i];
  return seq;
}

// The keys of an event read so far.
struct SeenKeys {
  bool type = false, hashes = false, parent = false, tokens = false, block_size = false,
       medium = false, extra_keys = false, window = false;
};

// Reads one key of an event into `event`.
absl::Status ReadField(const std::string& key, const msgpack::object& value, ReadVllmEvent* event,
                       SeenKeys* seen) {
  if (key == "type") {
    absl::StatusOr<std::string> type = AsString(value, "type");
    if (!type.ok()) return type.status();
    event->type = *type;
    seen->type = true;
  } else if (key == "block_hashes") {
    absl::StatusOr<std::vector<uint64_t>> hashes = AsHashes(value);
    if (!hashes.ok()) return hashes.status();
    event->block_hashes = *std::move(hashes);
    seen->hashes = true;
  } else if (key == "parent_block_hash") {
    if (value.type == msgpack::type::NIL) {
      event->parent_block_hash.reset();
    } else if (IsUnsigned(value)) {
      event->parent_block_hash = value.via.u64;
    } else {
      return Bad("parent_block_hash is neither nil nor an unsigned integer");
    }
    seen->parent = true;
  } else if (key == "token_ids") {
    if (value.type != msgpack::type::ARRAY) return Bad("token_ids is not an array");
    for (uint32_t i = 0; i < value.via.array.size; ++i) {
      const msgpack::object& t = value.via.array.ptr[i];
      if (!IsUnsigned(t) || t.via.u64 > UINT32_MAX) return Bad("a token id is not a u32");
      event->token_ids.push_back(static_cast<uint32_t>(t.via.u64));
    }
    seen->tokens = true;
  } else if (key == "block_size") {
    if (!IsUnsigned(value)) return Bad("block_size is not a positive integer");
    event->block_size = static_cast<int64_t>(value.via.u64);
    seen->block_size = true;
  } else if (key == "medium") {
    absl::StatusOr<std::string> medium = AsString(value, "medium");
    if (!medium.ok()) return medium.status();
    event->medium = *medium;
    seen->medium = true;
  } else if (key == "lora_id" || key == "lora_name") {
    if (value.type != msgpack::type::NIL) return Bad(absl::StrCat(key, " is not nil"));
  } else if (key == "extra_keys") {
    if (value.type != msgpack::type::NIL && value.type != msgpack::type::ARRAY) {
      return Bad("extra_keys is neither nil nor an array");
    }
    seen->extra_keys = true;
  } else if (key == "group_idx") {
    if (!IsUnsigned(value)) return Bad("group_idx is not an unsigned integer");
    event->group_idx = static_cast<int64_t>(value.via.u64);
  } else if (key == "kv_cache_spec_kind") {
    absl::StatusOr<std::string> kind = AsString(value, "kv_cache_spec_kind");
    if (!kind.ok()) return kind.status();
    if (*kind != "full_attention" && *kind != "sliding_window") {
      return Bad(absl::StrCat("unknown kv_cache_spec_kind ", *kind));
    }
    event->kv_cache_spec_kind = *kind;
  } else if (key == "kv_cache_spec_sliding_window") {
    if (value.type == msgpack::type::NIL) {
      event->sliding_window.reset();
    } else if (IsUnsigned(value) && value.via.u64 > 0) {
      event->sliding_window = static_cast<int64_t>(value.via.u64);
    } else {
      return Bad("kv_cache_spec_sliding_window is neither nil nor a positive integer");
    }
    seen->window = true;
  } else {
    return Bad(absl::StrCat("unexpected key ", key));
  }
  return absl::OkStatus();
}

// What consumers require of an event of `size` keys, the `e`th of its batch.
absl::Status CheckEvent(uint32_t size, uint32_t e, const ReadVllmEvent& event,
                        const SeenKeys& seen) {
  if (!seen.type) return Bad(absl::StrCat("event ", e, " has no type"));
  if (event.type == "BlockStored") {
    const bool grouped = event.group_idx.has_value();
    if (!seen.hashes || !seen.parent || !seen.tokens || !seen.block_size || !seen.medium ||
        size != (grouped ? 12u : 8u)) {
      return Bad("BlockStored lacks a field");
    }
    if (grouped &&
        (!seen.extra_keys || event.kv_cache_spec_kind.empty() || !seen.window ||
         event.sliding_window.has_value() != (event.kv_cache_spec_kind == "sliding_window"))) {
      return Bad("BlockStored has some of the group fields, or a kind and window that differ");
    }
    if (event.block_hashes.empty()) return Bad("BlockStored of no block");
    if (event.token_ids.size() !=
        event.block_hashes.size() * static_cast<size_t>(event.block_size)) {
      return Bad(absl::StrCat("BlockStored of ", event.block_hashes.size(), " blocks of ",
                              event.block_size, " has ", event.token_ids.size(), " tokens"));
    }
    absl::flat_hash_set<uint64_t> ids(event.block_hashes.begin(), event.block_hashes.end());
    if (event.parent_block_hash.has_value()) ids.insert(*event.parent_block_hash);
    if (ids.size() != event.block_hashes.size() + (event.parent_block_hash ? 1 : 0)) {
      return Bad("BlockStored ids repeat (parent included)");
    }
  } else if (event.type == "BlockRemoved") {
    if (!seen.hashes || !seen.medium || size != (event.group_idx.has_value() ? 4u : 3u)) {
      return Bad("BlockRemoved lacks a field");
    }
  } else if (event.type == "AllBlocksCleared") {
    if (size != 1) return Bad("AllBlocksCleared has fields");
  } else {
    return Bad(absl::StrCat("unknown event type ", event.type));
  }
  return absl::OkStatus();
}

// One event of a batch, the `e`th.
absl::StatusOr<ReadVllmEvent> DecodeEvent(const msgpack::object& map, uint32_t e) {
  if (map.type != msgpack::type::MAP) return Bad(absl::StrCat("event ", e, " is not a map"));
  ReadVllmEvent event;
  SeenKeys seen;
  for (uint32_t k = 0; k < map.via.map.size; ++k) {
    const msgpack::object_kv& kv = map.via.map.ptr[k];
    absl::StatusOr<std::string> key = AsString(kv.key, "a key");
    if (!key.ok()) return key.status();
    if (absl::Status read = ReadField(*key, kv.val, &event, &seen); !read.ok()) return read;
  }
  if (absl::Status valid = CheckEvent(map.via.map.size, e, event, seen); !valid.ok()) {
    return valid;
  }
  return event;
}

}  // namespace

absl::StatusOr<ReadVllmBatch> DecodeVllmPayload(std::string_view payload) {
  msgpack::object_handle handle;
  try {
    handle = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception& error) {
    return Bad(absl::StrCat("not msgpack: ", error.what()));
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::ARRAY || root.via.array.size != 3) {
    return Bad("not an array of 3 [ts, events, data_parallel_rank]");
  }
  ReadVllmBatch batch;
  const msgpack::object& ts = root.via.array.ptr[0];
  if (ts.type != msgpack::type::FLOAT64) return Bad("ts is not a float64");
  batch.timestamp = ts.via.f64;
  const msgpack::object& rank = root.via.array.ptr[2];
  if (rank.type != msgpack::type::POSITIVE_INTEGER &&
      rank.type != msgpack::type::NEGATIVE_INTEGER) {
    return Bad("data_parallel_rank is not an integer");
  }
  batch.data_parallel_rank = rank.as<int64_t>();
  const msgpack::object& events = root.via.array.ptr[1];
  if (events.type != msgpack::type::ARRAY) return Bad("events is not an array");
  for (uint32_t e = 0; e < events.via.array.size; ++e) {
    absl::StatusOr<ReadVllmEvent> event = DecodeEvent(events.via.array.ptr[e], e);
    if (!event.ok()) return event.status();
    batch.events.push_back(*std::move(event));
  }
  return batch;
}

absl::StatusOr<std::unique_ptr<VllmEventSubscriber>> VllmEventSubscriber::Connect(
    const std::string& endpoint, absl::Time deadline) {
  std::unique_ptr<VllmEventSubscriber> subscriber(new VllmEventSubscriber());
  subscriber->socket_ = zmq::socket_t(subscriber->context_, zmq::socket_type::sub);
  subscriber->socket_.set(zmq::sockopt::subscribe, "");
  subscriber->socket_.set(zmq::sockopt::linger, 0);
  if (absl::Status connected =
          ConnectAndAwaitHandshake(subscriber->context_, subscriber->socket_, endpoint, deadline);
      !connected.ok()) {
    return connected;
  }
  return subscriber;
}

absl::StatusOr<ReadVllmBatch> VllmEventSubscriber::Next(absl::Time deadline) {
  absl::StatusOr<std::vector<zmq::message_t>> frames = ReceiveMessageUntil(socket_, deadline);
  if (!frames.ok()) return frames.status();
  if (frames->empty()) return absl::DeadlineExceededError("no vLLM event batch came");
  if (frames->size() != 3) return Bad(absl::StrCat("a batch of ", frames->size(), " frames"));
  absl::StatusOr<uint64_t> seq = ReadSeq((*frames)[1]);
  if (!seq.ok()) return seq.status();
  absl::StatusOr<ReadVllmBatch> batch = DecodeVllmPayload(
      std::string_view(static_cast<const char*>((*frames)[2].data()), (*frames)[2].size()));
  if (!batch.ok()) return batch.status();
  batch->topic = (*frames)[0].to_string();
  batch->seq = *seq;
  return batch;
}

absl::StatusOr<std::vector<ReadVllmBatch>> ReplayVllmEvents(const std::string& endpoint,
                                                            uint64_t start_seq,
                                                            absl::Time deadline) {
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(endpoint);
  uint8_t seq_be[8];
  for (int i = 7; i >= 0; --i) seq_be[i] = static_cast<uint8_t>(start_seq >> (8 * (7 - i)));
  dealer.send(zmq::const_buffer("", 0), zmq::send_flags::sndmore);
  dealer.send(zmq::const_buffer(seq_be, sizeof(seq_be)), zmq::send_flags::none);
  std::vector<ReadVllmBatch> batches;
  while (true) {
    absl::StatusOr<std::vector<zmq::message_t>> frames = ReceiveMessageUntil(dealer, deadline);
    if (!frames.ok()) return frames.status();
    if (frames->empty()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no end marker after ", batches.size(), " replayed batch(es)"));
    }
    if (frames->size() != 4 || (*frames)[0].size() != 0) {
      return Bad(absl::StrCat("a replay reply of ", frames->size(), " frames"));
    }
    absl::StatusOr<uint64_t> seq = ReadSeq((*frames)[2]);
    if (!seq.ok()) return seq.status();
    if (*seq == ~uint64_t{0}) {
      if ((*frames)[1].size() != 0 || (*frames)[3].size() != 0) {
        return Bad("the end marker's topic or payload is not empty");
      }
      return batches;
    }
    absl::StatusOr<ReadVllmBatch> batch = DecodeVllmPayload(
        std::string_view(static_cast<const char*>((*frames)[3].data()), (*frames)[3].size()));
    if (!batch.ok()) return batch.status();
    batch->topic = (*frames)[1].to_string();
    batch->seq = *seq;
    batches.push_back(*std::move(batch));
  }
}

absl::StatusOr<int> SendRawReplayRequest(const std::string& endpoint,
                                         const std::vector<std::string>& frames,
                                         absl::Duration wait) {
  zmq::context_t context(1);
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  // Connected before sending, and the frames flushed before the socket closes: `wait` is
  // the time given to a reply, not to a connection a loaded machine makes slowly (a message
  // still queued at the close would be dropped, and the publisher never see it).
  dealer.set(zmq::sockopt::linger, 60000);
  if (absl::Status connected =
          ConnectAndAwaitHandshake(context, dealer, endpoint, MonotonicNow() + absl::Seconds(60));
      !connected.ok()) {
    return connected;
  }
  for (size_t i = 0; i < frames.size(); ++i) {
    dealer.send(zmq::const_buffer(frames[i].data(), frames[i].size()),
                i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  int replies = 0;
  const absl::Time deadline = MonotonicNow() + wait;
  while (true) {
    absl::StatusOr<std::vector<zmq::message_t>> reply = ReceiveMessageUntil(dealer, deadline);
    if (!reply.ok()) return reply.status();
    if (reply->empty()) return replies;
    ++replies;
  }
}

}  // namespace kvcm::testing
