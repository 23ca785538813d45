#include "tools/kvcmctl/plan_command.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"
#include "common/model/model_config.h"
#include "common/sizing/byte_size.h"
#include "common/sizing/kv_cache_groups.h"
#include "common/sizing/kv_cache_spec.h"
#include "common/sizing/model_config.h"
#include "common/sizing/pool_plan.h"
#include "nlohmann/json.hpp"
#include "tools/kvcmctl/command.h"
#include "tools/kvcmctl/flag_parser.h"

namespace kvcm::kvcmctl {
namespace {

// The flags of `kvcmctl plan`, defined here and nowhere else.
constexpr FlagSpec kPlanFlags[] = {
    {"model-config", "PATH",
     "config.json, model folder or GGUF file giving layers, KV heads, head dim, dtype"},
    {"layers", "N", "transformer layers (instead of --model-config)"},
    {"kv-heads", "N", "KV heads per layer; fewer than query heads under GQA"},
    {"head-dim", "N", "elements per head"},
    {"dtype", "T",
     "KV-cache dtype: fp32, fp16, bf16, fp8, fp8_e5m2 (default: torch_dtype, or bf16)"},
    {"block-size", "N", "tokens per block (default 16)"},
    {"pool-bytes", "BYTES", "pool size, e.g. 64GiB, 80GB, 512MiB"},
    {"memory-fraction", "F", "use F (0 < F <= 1) of --free-memory, less --margin"},
    {"free-memory", "BYTES", "device memory free after weights and activations"},
    {"margin", "M", "safety margin for --memory-fraction, 0 <= M < 1 (default 0.1)"},
    {"num-blocks", "N", "a fixed number of blocks"},
    {"seq-len", "N", "also show how many sequences of N tokens fit (default 4096)"},
    {"host-tier-bytes", "BYTES", "also show what a host-memory tier of BYTES holds"},
    {"disk-tier-bytes", "BYTES", "also show what a disk tier of BYTES holds"},
    {"json", "", "print one JSON object instead of text"},
    {"help", "", "print this help"},
};

constexpr absl::string_view kSizingChoice =
    "pass exactly one of --pool-bytes, --memory-fraction (with --free-memory) or --num-blocks";

absl::Status FlagError(absl::string_view flag, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", message));
}

// A positive integer in [1, max].
absl::StatusOr<int64_t> ParsePositive(const ParsedFlags& flags, const char* flag, int64_t max) {
  const std::string text = flags.Get(flag).value_or("");
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return FlagError(flag, absl::StrCat("expected a positive integer, got \"", text, "\""));
  }
  if (value <= 0 || value > max) {
    return FlagError(flag, absl::StrCat("must be in [1, ", max, "], got ", value));
  }
  return value;
}

absl::StatusOr<double> ParseDouble(const ParsedFlags& flags, const char* flag) {
  const std::string text = flags.Get(flag).value_or("");
  double value = 0;
  if (!absl::SimpleAtod(text, &value)) {
    return FlagError(flag, absl::StrCat("expected a number, got \"", text, "\""));
  }
  return value;
}

absl::StatusOr<int64_t> ParseBytesFlag(const ParsedFlags& flags, const char* flag) {
  absl::StatusOr<int64_t> bytes = ParseByteSize(flags.Get(flag).value_or(""));
  if (!bytes.ok()) return FlagError(flag, bytes.status().message());
  return *bytes;
}

absl::Status ParseShape(const ParsedFlags& flags, PlanOptions& options) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (flags.Has("dtype")) {
    absl::StatusOr<DType> dtype = ParseDType(*flags.Get("dtype"));
    if (!dtype.ok()) return FlagError("dtype", dtype.status().message());
    options.dtype = *dtype;
  }
  if (flags.Has("block-size")) {
    KVCM_ASSIGN_OR_RETURN(const int64_t block_size,
                          ParsePositive(flags, "block-size", kMaxBlockSize));
    options.block_size = static_cast<int32_t>(block_size);
  }

  constexpr const char* kDimensionFlags[] = {"layers", "kv-heads", "head-dim"};
  if (flags.Has("model-config")) {
    options.model_config = *flags.Get("model-config");
    if (options.model_config.empty()) return FlagError("model-config", "empty path");
    for (const char* flag : kDimensionFlags) {
      if (flags.Has(flag)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--model-config and --", flag,
            " cannot be combined: the config gives the model shape (use --dtype to change "
            "the KV-cache dtype)"));
      }
    }
    return absl::OkStatus();
  }
  for (const char* flag : kDimensionFlags) {
    if (!flags.Has(flag)) {
      return absl::InvalidArgumentError(
          absl::StrCat("no model shape: missing --", flag,
                       "; give --layers, --kv-heads and --head-dim, or --model-config"));
    }
  }
  KVCM_ASSIGN_OR_RETURN(const int64_t layers, ParsePositive(flags, "layers", kInt32Max));
  KVCM_ASSIGN_OR_RETURN(const int64_t kv_heads, ParsePositive(flags, "kv-heads", kInt32Max));
  KVCM_ASSIGN_OR_RETURN(const int64_t head_dim, ParsePositive(flags, "head-dim", kInt32Max));
  options.num_layers = static_cast<int32_t>(layers);
  options.num_kv_heads = static_cast<int32_t>(kv_heads);
  options.head_dim = static_cast<int32_t>(head_dim);
  return absl::OkStatus();
}

absl::Status ParseBudget(const ParsedFlags& flags, PlanOptions& options) {
  std::vector<std::string> given;
  for (const char* flag : {"pool-bytes", "memory-fraction", "num-blocks"}) {
    if (flags.Has(flag)) given.push_back(absl::StrCat("--", flag));
  }
  if (given.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no pool size given; ", kSizingChoice));
  }
  if (given.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "conflicting pool sizes ", absl::StrJoin(given, " and "), "; ", kSizingChoice));
  }
  if (!flags.Has("memory-fraction")) {
    for (const char* flag : {"free-memory", "margin"}) {
      if (flags.Has(flag)) {
        return FlagError(flag, "only applies with --memory-fraction");
      }
    }
  }

  if (flags.Has("pool-bytes")) {
    KVCM_ASSIGN_OR_RETURN(const int64_t bytes, ParseBytesFlag(flags, "pool-bytes"));
    if (bytes <= 0) return FlagError("pool-bytes", "must be positive");
    options.budget = PoolBudget::Bytes(bytes);
    return absl::OkStatus();
  }
  if (flags.Has("num-blocks")) {
    KVCM_ASSIGN_OR_RETURN(const int64_t num_blocks,
                          ParsePositive(flags, "num-blocks", kMaxNumBlocks));
    options.budget = PoolBudget::Blocks(num_blocks);
    return absl::OkStatus();
  }

  KVCM_ASSIGN_OR_RETURN(const double fraction, ParseDouble(flags, "memory-fraction"));
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return FlagError("memory-fraction", absl::StrCat("must be in (0, 1], got ", fraction));
  }
  if (!flags.Has("free-memory")) {
    return FlagError("memory-fraction",
                     "needs --free-memory BYTES: kvcmctl plan measures no device, so give the "
                     "memory free after weights and activations (e.g. --free-memory 60GiB)");
  }
  KVCM_ASSIGN_OR_RETURN(const int64_t free_bytes, ParseBytesFlag(flags, "free-memory"));
  double margin = kDefaultMemoryMargin;
  if (flags.Has("margin")) {
    KVCM_ASSIGN_OR_RETURN(margin, ParseDouble(flags, "margin"));
    if (!(margin >= 0.0 && margin < 1.0)) {
      return FlagError("margin", absl::StrCat("must be in [0, 1), got ", margin));
    }
  }
  options.budget = PoolBudget::FractionOfFree(free_bytes, fraction, margin);
  return absl::OkStatus();
}

// Fields shared by the text and JSON outputs for the budget.
nlohmann::ordered_json BudgetJson(const PoolBudget& budget) {
  nlohmann::ordered_json j;
  j["kind"] = std::string(budget.KindName());
  if (const auto* b = std::get_if<PoolBytesBudget>(&budget.kind)) {
    j["pool_bytes"] = b->bytes;
  } else if (const auto* f = std::get_if<MemoryFractionBudget>(&budget.kind)) {
    j["free_bytes"] = f->free_bytes;
    j["fraction"] = f->fraction;
    j["margin"] = f->margin;
  } else if (const auto* c = std::get_if<BlockCountBudget>(&budget.kind)) {
    j["num_blocks"] = c->num_blocks;
  }
  return j;
}

// The groups of a model whose layers are not all of one type; none for one group.
absl::StatusOr<std::optional<KvCacheGroups>> ModelGroups(const ModelConfig& model) {
  KVCM_ASSIGN_OR_RETURN(const std::vector<int32_t> windows, LayerWindows(model));
  KVCM_ASSIGN_OR_RETURN(KvCacheGroups groups, GroupLayers(windows));
  if (groups.num_groups() <= 1) return std::nullopt;
  return groups;
}

// What `plan`'s pool becomes laid out by pages of `groups`, for each of `fits`.
absl::StatusOr<GroupedPlan> PlanGroups(KvCacheGroups groups, const PoolPlan& plan,
                                       const std::vector<SequenceFit>& fits) {
  GroupedPlan grouped;
  grouped.bytes_per_page = PageSpec(plan.spec, groups).BytesPerBlock();
  grouped.num_pages = plan.usable_bytes / grouped.bytes_per_page;
  if (grouped.num_pages > kMaxNumBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a pool of KV cache groups holds ", grouped.num_pages, " pages of ", grouped.bytes_per_page,
        " bytes, more than ", kMaxNumBlocks, "; give a larger block size"));
  }
  grouped.groups = std::move(groups);
  for (const SequenceFit& fit : fits) {
    GroupedFit entry;
    entry.seq_len = fit.seq_len;
    // The full figure first: when it fits in an int64, seq_len is far from overflowing in
    // BlocksHeldByGroups, and the grouped bytes (at most num_groups x group_size slots per
    // token) are checked below.
    if (__builtin_mul_overflow(fit.blocks_per_sequence, plan.bytes_per_block,
                               &entry.full_bytes_per_sequence)) {
      return FlagError("seq-len", absl::StrCat(fit.seq_len,
                                               " tokens hold more than 2^63 - 1 "
                                               "bytes of KV"));
    }
    entry.pages_per_sequence =
        BlocksHeldByGroups(grouped.groups, fit.seq_len, plan.spec.block_size);
    if (__builtin_mul_overflow(entry.pages_per_sequence, grouped.bytes_per_page,
                               &entry.bytes_per_sequence)) {
      return FlagError("seq-len", absl::StrCat(fit.seq_len,
                                               " tokens hold more than 2^63 - 1 "
                                               "bytes of KV in KV cache groups"));
    }
    entry.ratio = static_cast<double>(entry.bytes_per_sequence) /
                  static_cast<double>(entry.full_bytes_per_sequence);
    entry.num_sequences = grouped.num_pages / entry.pages_per_sequence;
    grouped.fits.push_back(entry);
  }
  return grouped;
}

// The "KV cache groups" section of the text output: the groups, the page, and what a
// decoding sequence holds with them against all its layers in full.
std::string GroupsText(const PoolPlan& plan, const GroupedPlan& grouped) {
  const KvCacheGroups& groups = grouped.groups;
  std::string out = absl::StrCat(
      "\nKV cache groups: ", groups.num_groups(), " groups of ", groups.group_size,
      " slots, one block table each; a window group releases the blocks behind its window:\n");
  for (int32_t g = 0; g < groups.num_groups(); ++g) {
    const KvCacheGroup& group = groups.groups[g];
    absl::StrAppend(&out, "  group ", g, ": ",
                    group.window == 0 ? "full attention" : absl::StrCat("window ", group.window),
                    ", layers ", absl::StrJoin(group.layers, ", "), "\n");
  }
  absl::StrAppend(&out, "  padding slots    = ", groups.num_groups(), " groups x ",
                  groups.group_size, " slots - ", groups.num_layers,
                  " layers = ", groups.padding_slots(), "\n");
  absl::StrAppend(&out, "  bytes per page   = 2 (K and V) x ", groups.group_size, " slots x ",
                  plan.spec.num_kv_heads, " KV heads x ", plan.spec.head_dim, " head dim x ",
                  DTypeBytes(plan.spec.dtype), " bytes (", std::string(DTypeName(plan.spec.dtype)),
                  ") x ", plan.spec.block_size, " tokens = ", ExactBytes(grouped.bytes_per_page),
                  "\n");
  absl::StrAppend(&out, "  pool pages       = floor(", plan.usable_bytes, " / ",
                  grouped.bytes_per_page, ") = ", grouped.num_pages, "\n");
  absl::StrAppend(&out,
                  "A pool serving groups is laid out by pages: its blocks number usable bytes / "
                  "bytes per page, not usable bytes / bytes per block.\n");
  absl::StrAppend(&out,
                  "A decoding sequence in every group, against all its layers kept in full:\n");
  absl::StrAppend(&out, absl::StrFormat("  %10s %12s %12s %12s %7s %12s\n", "seq_len", "pages/seq",
                                        "with groups", "in full", "ratio", "sequences"));
  for (const GroupedFit& fit : grouped.fits) {
    absl::StrAppend(
        &out,
        absl::StrFormat("  %10d %12d %12s %12s %7.3f %12d\n", fit.seq_len, fit.pages_per_sequence,
                        FormatBytes(fit.bytes_per_sequence),
                        FormatBytes(fit.full_bytes_per_sequence), fit.ratio, fit.num_sequences));
  }
  return out;
}

nlohmann::ordered_json GroupsJson(const GroupedPlan& grouped) {
  nlohmann::ordered_json groups = nlohmann::ordered_json::array();
  for (const KvCacheGroup& group : grouped.groups.groups) {
    groups.push_back({{"window", group.window}, {"layers", group.layers}});
  }
  nlohmann::ordered_json fits = nlohmann::ordered_json::array();
  for (const GroupedFit& fit : grouped.fits) {
    fits.push_back({
        {"seq_len", fit.seq_len},
        {"pages_per_sequence", fit.pages_per_sequence},
        {"bytes_per_sequence", fit.bytes_per_sequence},
        {"full_bytes_per_sequence", fit.full_bytes_per_sequence},
        {"ratio", fit.ratio},
        {"num_sequences", fit.num_sequences},
    });
  }
  return {
      {"group_size", grouped.groups.group_size},
      {"num_groups", grouped.groups.num_groups()},
      {"padding_slots", grouped.groups.padding_slots()},
      {"groups", std::move(groups)},
      {"bytes_per_page", grouped.bytes_per_page},
      {"num_pages", grouped.num_pages},
      {"sequences", std::move(fits)},
  };
}

}  // namespace

absl::StatusOr<PlanOptions> ParsePlanOptions(absl::Span<const std::string> args) {
  KVCM_ASSIGN_OR_RETURN(const ParsedFlags flags, ParseFlags(kPlanFlags, args));
  PlanOptions options;
  if (flags.Has("help")) {
    options.help = true;
    return options;
  }
  if (!flags.positional().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument \"", flags.positional().front(), "\""));
  }
  KVCM_RETURN_IF_ERROR(ParseShape(flags, options));
  KVCM_RETURN_IF_ERROR(ParseBudget(flags, options));
  if (flags.Has("seq-len")) {
    KVCM_ASSIGN_OR_RETURN(options.seq_len,
                          ParsePositive(flags, "seq-len", std::numeric_limits<int64_t>::max()));
  }
  for (const auto& [flag, field] : {std::pair{"host-tier-bytes", &options.host_tier_bytes},
                                    std::pair{"disk-tier-bytes", &options.disk_tier_bytes}}) {
    if (!flags.Has(flag)) continue;
    KVCM_ASSIGN_OR_RETURN(*field, ParseBytesFlag(flags, flag));
    if (*field <= 0) return FlagError(flag, "must be positive");
  }
  options.json = flags.Has("json");
  return options;
}

std::string PlanUsage() {
  return absl::StrCat(
      "Usage: kvcmctl plan (--model-config PATH | --layers N --kv-heads N --head-dim N)\n"
      "                    (--pool-bytes BYTES | --memory-fraction F --free-memory BYTES\n"
      "                     [--margin M] | --num-blocks N)\n"
      "                    [--dtype T] [--block-size N] [--seq-len N] [--json]\n"
      "                    [--host-tier-bytes BYTES] [--disk-tier-bytes BYTES]\n"
      "\n"
      "Prints how many KV-cache blocks fit in a memory budget and what that means:\n"
      "  bytes per token  = 2 (K and V) x layers x KV heads x head dim x dtype bytes\n"
      "  bytes per block  = bytes per token x block size\n"
      "  num_blocks       = floor(usable bytes / bytes per block)\n"
      "  max total tokens = num_blocks x block size (TGI's max_batch_total_tokens)\n"
      "With --memory-fraction: usable bytes = free memory x F x (1 - margin).\n"
      "A model of several layer types (--model-config) also shows its KV cache groups, whose\n"
      "pool is laid out by pages of group size layers:\n"
      "  bytes per page   = 2 x group size x KV heads x head dim x dtype bytes x block size\n"
      "  pool pages       = floor(usable bytes / bytes per page)\n"
      "Tiers (the cache manager's flags of the same names):\n"
      "  host tier blocks = floor(host tier bytes / bytes per block)\n"
      "  disk tier slot   = 4096 B header + bytes per block rounded up to 4096\n"
      "  disk tier blocks = floor(disk tier bytes / slot), at least 1, in 4 files of\n"
      "                     equal size (a remainder of fewer slots than files is dropped)\n"
      "  tokens           = blocks x block size\n"
      "BYTES take binary units KiB/MiB/GiB/TiB (also K/M/G/T) or decimal KB/MB/GB/TB.\n"
      "\n"
      "Flags:\n",
      FlagHelp(kPlanFlags));
}

absl::StatusOr<PlanReport> BuildPlanReport(const PlanOptions& options) {
  KVCM_CHECK(!options.help);
  PlanReport report;
  KvCacheSpec spec;
  std::optional<KvCacheGroups> groups;
  if (!options.model_config.empty()) {
    report.model_config = options.model_config;
    KVCM_ASSIGN_OR_RETURN(spec, SpecFromModelPath(options.model_config, options.block_size,
                                                  options.dtype, &report.notes));
    KVCM_ASSIGN_OR_RETURN(const ModelConfig model, ReadModelConfig(options.model_config));
    KVCM_ASSIGN_OR_RETURN(report.sliding_window, ReleasableWindow(model));
    KVCM_ASSIGN_OR_RETURN(groups, ModelGroups(model));
  } else {
    spec.num_layers = options.num_layers;
    spec.num_kv_heads = options.num_kv_heads;
    spec.head_dim = options.head_dim;
    spec.dtype = options.dtype.value_or(DType::kBFloat16);
    spec.block_size = options.block_size;
  }
  KVCM_ASSIGN_OR_RETURN(report.plan, PlanPool(spec, options.budget));

  std::vector<int64_t> seq_lens(std::begin(kStandardSeqLens), std::end(kStandardSeqLens));
  seq_lens.push_back(options.seq_len);
  std::sort(seq_lens.begin(), seq_lens.end());
  seq_lens.erase(std::unique(seq_lens.begin(), seq_lens.end()), seq_lens.end());
  for (int64_t seq_len : seq_lens) {
    KVCM_ASSIGN_OR_RETURN(SequenceFit fit, SequencesThatFit(report.plan, seq_len));
    report.fits.push_back(fit);
  }
  if (groups.has_value()) {
    KVCM_ASSIGN_OR_RETURN(report.grouped, PlanGroups(std::move(*groups), report.plan, report.fits));
  }

  const int64_t block_bytes = report.plan.bytes_per_block;
  const int64_t block_size = report.plan.spec.block_size;
  constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();
  if (options.host_tier_bytes > 0) {
    TierPlan host{.tier = "host", .bytes = options.host_tier_bytes, .slot_bytes = block_bytes};
    host.blocks = options.host_tier_bytes / block_bytes;
    if (host.blocks == 0 || host.blocks > kMaxSlots) {
      return FlagError(
          "host-tier-bytes",
          absl::StrCat(options.host_tier_bytes, " holds ", host.blocks, " blocks of ", block_bytes,
                       " bytes: give at least one block's bytes, and fewer than "
                       "2^31 blocks"));
    }
    host.tokens = host.blocks * block_size;
    report.tiers.push_back(host);
  }
  if (options.disk_tier_bytes > 0) {
    constexpr int64_t kPage = 4096;
    TierPlan disk{.tier = "disk", .bytes = options.disk_tier_bytes};
    disk.slot_bytes = kDiskTierSlotHeaderBytes + (block_bytes + kPage - 1) / kPage * kPage;
    const int64_t slots = std::max<int64_t>(1, options.disk_tier_bytes / disk.slot_bytes);
    if (slots > kMaxSlots) {
      return FlagError("disk-tier-bytes",
                       absl::StrCat(options.disk_tier_bytes, " makes ", slots, " slots of ",
                                    disk.slot_bytes, " bytes, more than 2^31 - 1"));
    }
    const int64_t files = std::min(kDiskTierFiles, slots);
    disk.blocks = slots / files * files;
    disk.tokens = disk.blocks * block_size;
    report.tiers.push_back(disk);
  }
  return report;
}

std::string FormatPlanText(const PlanReport& report) {
  std::string out;
  if (!report.model_config.empty()) {
    absl::StrAppend(&out, "Model shape from ", report.model_config, "\n");
    for (const std::string& note : report.notes) absl::StrAppend(&out, "Note: ", note, "\n");
  }
  absl::StrAppend(&out, DescribePlan(report.plan));
  absl::StrAppend(&out, "\nSequences that fit, each in its own blocks (no prefix sharing):\n");
  absl::StrAppend(&out, absl::StrFormat("  %10s %12s %12s  %s\n", "seq_len", "blocks/seq",
                                        "sequences", "empty slots in last block"));
  for (const SequenceFit& fit : report.fits) {
    absl::StrAppend(&out, absl::StrFormat("  %10d %12d %12d  %d tokens (%s)\n", fit.seq_len,
                                          fit.blocks_per_sequence, fit.num_sequences,
                                          fit.wasted_tokens_per_sequence,
                                          FormatBytes(fit.wasted_bytes_per_sequence)));
  }
  if (report.sliding_window > 0) {
    absl::StrAppend(&out, "\nWith the model's sliding window of ", report.sliding_window,
                    " tokens, blocks behind it released (a decoding sequence; a prompt's blocks "
                    "are all taken when it is admitted):\n");
    absl::StrAppend(&out,
                    absl::StrFormat("  %10s %12s %12s\n", "seq_len", "blocks/seq", "sequences"));
    for (const SequenceFit& fit : report.fits) {
      const int64_t held =
          BlocksHeldUnderWindow(fit.seq_len, report.sliding_window, report.plan.spec.block_size);
      absl::StrAppend(&out, absl::StrFormat("  %10d %12d %12d\n", fit.seq_len, held,
                                            report.plan.num_blocks / held));
    }
  }
  if (report.grouped.has_value()) absl::StrAppend(&out, GroupsText(report.plan, *report.grouped));
  if (!report.tiers.empty()) {
    absl::StrAppend(&out, "\nTiers below the pool (--host-tier-bytes, --disk-tier-bytes):\n");
  }
  for (const TierPlan& tier : report.tiers) {
    std::string blocks = absl::StrCat("floor(", tier.bytes, " / ", tier.slot_bytes, ")");
    if (tier.tier == "disk") {
      absl::StrAppend(&out, "  disk tier slot   = 4096 B header + ", report.plan.bytes_per_block,
                      " B block rounded up to 4096 = ", ExactBytes(tier.slot_bytes), "\n");
      const int64_t slots = std::max<int64_t>(1, tier.bytes / tier.slot_bytes);
      if (slots != tier.bytes / tier.slot_bytes) absl::StrAppend(&blocks, ", at least 1");
      if (slots != tier.blocks) {
        absl::StrAppend(&blocks, " = ", slots, ", in ", kDiskTierFiles, " equal files");
      }
    }
    absl::StrAppend(&out, absl::StrFormat("  %-16s = ", tier.tier + " tier blocks"), blocks, " = ",
                    tier.blocks, "\n");
    absl::StrAppend(&out, absl::StrFormat("  %-16s = ", tier.tier + " tier tokens"), tier.blocks,
                    " blocks x ", report.plan.spec.block_size, " tokens = ", tier.tokens, " (",
                    FormatBytes(tier.blocks * report.plan.bytes_per_block), " of KV)\n");
  }
  return out;
}

std::string FormatPlanJson(const PlanReport& report) {
  const PoolPlan& plan = report.plan;
  nlohmann::ordered_json j;
  if (!report.model_config.empty()) j["model_config"] = report.model_config;
  if (!report.notes.empty()) j["notes"] = report.notes;
  j["num_layers"] = plan.spec.num_layers;
  j["num_kv_heads"] = plan.spec.num_kv_heads;
  j["head_dim"] = plan.spec.head_dim;
  j["dtype"] = std::string(DTypeName(plan.spec.dtype));
  j["dtype_bytes"] = DTypeBytes(plan.spec.dtype);
  j["block_size"] = plan.spec.block_size;
  j["bytes_per_token"] = plan.bytes_per_token;
  j["bytes_per_block"] = plan.bytes_per_block;
  j["budget"] = BudgetJson(plan.budget);
  j["usable_bytes"] = plan.usable_bytes;
  j["num_blocks"] = plan.num_blocks;
  j["pool_bytes"] = plan.pool_bytes;
  j["unused_bytes"] = plan.unused_bytes;
  j["max_total_tokens"] = plan.max_total_tokens;
  nlohmann::ordered_json fits = nlohmann::ordered_json::array();
  if (report.sliding_window > 0) j["sliding_window_tokens"] = report.sliding_window;
  for (const SequenceFit& fit : report.fits) {
    nlohmann::ordered_json entry = {
        {"seq_len", fit.seq_len},
        {"blocks_per_sequence", fit.blocks_per_sequence},
        {"num_sequences", fit.num_sequences},
        {"wasted_tokens_per_sequence", fit.wasted_tokens_per_sequence},
        {"wasted_bytes_per_sequence", fit.wasted_bytes_per_sequence},
    };
    if (report.sliding_window > 0) {
      const int64_t held =
          BlocksHeldUnderWindow(fit.seq_len, report.sliding_window, plan.spec.block_size);
      entry["window_blocks_per_sequence"] = held;
      entry["window_sequences"] = plan.num_blocks / held;
    }
    fits.push_back(std::move(entry));
  }
  j["sequences"] = std::move(fits);
  if (report.grouped.has_value()) j["kv_cache_groups"] = GroupsJson(*report.grouped);
  if (!report.tiers.empty()) {
    nlohmann::ordered_json tiers = nlohmann::ordered_json::array();
    for (const TierPlan& tier : report.tiers) {
      tiers.push_back({
          {"tier", tier.tier},
          {"bytes", tier.bytes},
          {"slot_bytes", tier.slot_bytes},
          {"blocks", tier.blocks},
          {"tokens", tier.tokens},
      });
    }
    j["tiers"] = std::move(tiers);
  }
  return j.dump(2) + "\n";
}

int RunPlanCommand(absl::Span<const std::string> args, std::ostream& out, std::ostream& err) {
  const absl::StatusOr<PlanOptions> options = ParsePlanOptions(args);
  if (!options.ok()) {
    err << "kvcmctl plan: " << options.status().message() << "\n"
        << "Run 'kvcmctl plan --help' for usage.\n";
    return kExitUsage;
  }
  if (options->help) {
    out << PlanUsage();
    return kExitOk;
  }
  const absl::StatusOr<PlanReport> report = BuildPlanReport(*options);
  if (!report.ok()) {
    err << "kvcmctl plan: " << report.status().message() << "\n";
    return kExitFailure;
  }
  out << (options->json ? FormatPlanJson(*report) : FormatPlanText(*report));
  return kExitOk;
}

}  // namespace kvcm::kvcmctl
