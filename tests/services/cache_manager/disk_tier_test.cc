// The disk tier on real files in a fresh directory under the test's TMPDIR: round trips,
// restarts, the directory's lock, and every kind of damage a slot can suffer (a flipped
// byte, a torn write, a truncated file, a file of another model), none of which is served.

#include "services/cache_manager/tiers/disk_tier.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/status_matchers.h"

namespace kvcm::cache_manager::tiers {
namespace {

using ::testing::HasSubstr;

// Block bytes that are not a multiple of 4096: the slot rounds them up (4096 + 16384).
constexpr uint64_t kBlockBytes = 3 * 4096 + 100;
constexpr uint64_t kSlotBytes = 4096 + 4 * 4096;
constexpr uint64_t kSeed = 20240601;

KvCacheSpec Spec() {
  KvCacheSpec spec;
  spec.num_layers = 2;
  spec.num_kv_heads = 4;
  spec.head_dim = 64;
  spec.dtype = DType::kBFloat16;
  spec.block_size = 16;
  return spec;
}

TierIdentity Identity(uint8_t model_byte = 1) {
  std::array<uint8_t, 16> digest{};
  digest.fill(model_byte);
  return MakeTierIdentity(digest, Spec(), HashAlgorithm::kXxh3V2);
}

BlockHash HashOf(int i) {
  const std::string message = absl::StrCat("block ", i);
  return Xxh3Digest({reinterpret_cast<const uint8_t*>(message.data()), message.size()});
}

void FillRandom(SlotBuffer& buffer, std::mt19937_64& random) {
  for (uint64_t i = 0; i < kBlockBytes; ++i) buffer.data()[i] = static_cast<uint8_t>(random());
}

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  byte ^= 0xFF;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = absl::StrCat(::testing::TempDir(), "/disk_tier_test-", ::getpid(), "-", info->name());
    std::filesystem::remove_all(root_);
    ASSERT_TRUE(std::filesystem::create_directories(root_)) << root_;
    dir_ = root_ + "/tier";
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // `slots` slots in `files` files (slots a multiple of files).
  DiskTier::Options Options(int32_t slots = 8, int32_t files = 2) const {
    DiskTier::Options options;
    options.dir = dir_;
    options.capacity_bytes = static_cast<uint64_t>(slots) * kSlotBytes;
    options.block_bytes = kBlockBytes;
    options.identity = Identity();
    options.files = files;
    return options;
  }

  std::unique_ptr<DiskTier> OpenOrDie(const DiskTier::Options& options) {
    absl::StatusOr<std::unique_ptr<DiskTier>> tier = DiskTier::Open(options);
    EXPECT_THAT(tier, IsOk());
    return tier.ok() ? std::move(*tier) : nullptr;
  }

  std::string FilePath(int32_t file) const { return absl::StrCat(dir_, "/tier-", file, ".kvcm"); }
  // The file and offset of `slot` in a tier of `slots_per_file`.
  std::pair<std::string, uint64_t> Where(int32_t slot, int32_t slots_per_file) const {
    return {FilePath(slot / slots_per_file),
            static_cast<uint64_t>(slot % slots_per_file) * kSlotBytes};
  }

  // Writes slots [0, count) as blocks HashOf(slot) with serial 100 + slot.
  void WriteSlots(DiskTier& tier, int32_t count) {
    std::mt19937_64 random(kSeed);
    SlotBuffer buffer(tier.slot_bytes());
    for (int32_t slot = 0; slot < count; ++slot) {
      FillRandom(buffer, random);
      ASSERT_THAT(tier.Write(slot, HashOf(slot), 100 + static_cast<uint64_t>(slot), buffer),
                  IsOk());
    }
  }

  static int32_t Refused(const DiskTier& tier, Refusal refusal) {
    return tier.open_report().refused[static_cast<size_t>(refusal)];
  }

  std::string root_;
  std::string dir_;
};

TEST_F(DiskTierTest, WriteThenReadBackIdenticalBytes) {
  RecordProperty("seed", std::to_string(kSeed));
  std::cout << "random data seed " << kSeed << "\n";
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  std::cout << "direct_io " << tier->direct_io() << "\n";
  EXPECT_EQ(tier->direct_io(), tier->open_report().direct_io);
  EXPECT_EQ(tier->num_slots(), 8);
  EXPECT_EQ(tier->slot_bytes(), kSlotBytes);
  EXPECT_EQ(tier->open_report().empty, 8);
  EXPECT_EQ(tier->open_report().recovered, 0);
  for (int32_t file = 0; file < 2; ++file) {
    EXPECT_EQ(std::filesystem::file_size(FilePath(file)), 4 * kSlotBytes);
  }
  std::mt19937_64 random(kSeed);
  std::vector<std::vector<uint8_t>> written;
  SlotBuffer buffer(tier->slot_bytes());
  for (int32_t slot = 0; slot < tier->num_slots(); ++slot) {
    FillRandom(buffer, random);
    written.emplace_back(buffer.data(), buffer.data() + kBlockBytes);
    ASSERT_THAT(tier->Write(slot, HashOf(slot), 1 + static_cast<uint64_t>(slot), buffer), IsOk());
  }
  for (int32_t slot = 0; slot < tier->num_slots(); ++slot) {
    SlotBuffer read(tier->slot_bytes());
    Refusal refusal = Refusal::kIoError;
    ASSERT_THAT(tier->Read(slot, HashOf(slot), read, &refusal), IsOk());
    EXPECT_EQ(std::vector<uint8_t>(read.data(), read.data() + kBlockBytes), written[slot])
        << "slot " << slot;
  }
  EXPECT_EQ(tier->bytes_written(), 8 * kSlotBytes);
  EXPECT_EQ(tier->bytes_read(), 8 * kSlotBytes);
}

TEST_F(DiskTierTest, BufferedIoWhenDirectIoIsNotWanted) {
  DiskTier::Options options = Options();
  options.direct_io = false;
  auto tier = OpenOrDie(options);
  ASSERT_NE(tier, nullptr);
  EXPECT_FALSE(tier->direct_io());
  EXPECT_FALSE(tier->open_report().direct_io);
  WriteSlots(*tier, 8);
  tier.reset();
  tier = OpenOrDie(Options());  // the files are the same with or without O_DIRECT
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->open_report().recovered, 8);
}

TEST_F(DiskTierTest, ReopenRecoversEverySlotWithHashAndSerial) {
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    WriteSlots(*tier, 7);  // slot 7 stays empty
    ASSERT_THAT(tier->Invalidate(3), IsOk());
  }
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  const DiskTier::OpenReport& report = tier->open_report();
  EXPECT_EQ(report.slots, 8);
  EXPECT_EQ(report.recovered, 6);
  EXPECT_EQ(report.empty, 2);  // the invalidated slot 3 and the unwritten slot 7
  EXPECT_EQ(report.max_serial, 106u);
  for (int32_t refused : report.refused) EXPECT_EQ(refused, 0);
  std::vector<int32_t> slots;
  for (const DiskTier::Recovered& recovered : tier->recovered()) {
    slots.push_back(recovered.slot);
    EXPECT_EQ(recovered.hash, HashOf(recovered.slot)) << "slot " << recovered.slot;
    EXPECT_EQ(recovered.serial, 100u + static_cast<uint64_t>(recovered.slot));
  }
  EXPECT_THAT(slots, ::testing::ElementsAre(0, 1, 2, 4, 5, 6));
  // The data is what was written: the same random stream.
  std::mt19937_64 random(kSeed);
  SlotBuffer expected(tier->slot_bytes());
  SlotBuffer read(tier->slot_bytes());
  for (int32_t slot = 0; slot < 7; ++slot) {
    FillRandom(expected, random);
    if (slot == 3) continue;
    ASSERT_THAT(tier->Read(slot, HashOf(slot), read, nullptr), IsOk());
    EXPECT_EQ(std::memcmp(read.data(), expected.data(), kBlockBytes), 0) << "slot " << slot;
  }
}

TEST_F(DiskTierTest, ReopenRecoversEachBlocksParentAndTokens) {
  std::vector<BlockLineage> lineages(3);
  for (int32_t t = 0; t < 16; ++t) lineages[0].tokens.push_back(1000 + t);  // a chain's root
  lineages[1].parent = HashOf(0);
  lineages[1].has_parent = true;
  for (int32_t t = 0; t < 16; ++t) lineages[1].tokens.push_back(-5 + 7 * t);  // any i32
  lineages[2].parent = HashOf(1);
  lineages[2].has_parent = true;  // and no tokens: the commit carried none
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    std::mt19937_64 random(kSeed);
    SlotBuffer buffer(tier->slot_bytes());
    for (int32_t slot = 0; slot < 3; ++slot) {
      FillRandom(buffer, random);
      ASSERT_THAT(tier->Write(slot, HashOf(slot), 1 + static_cast<uint64_t>(slot), buffer,
                              lineages[static_cast<size_t>(slot)]),
                  IsOk());
    }
  }
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  ASSERT_EQ(tier->recovered().size(), 3u);
  for (const DiskTier::Recovered& recovered : tier->recovered()) {
    const BlockLineage& want = lineages[static_cast<size_t>(recovered.slot)];
    EXPECT_EQ(recovered.lineage.has_parent, want.has_parent) << "slot " << recovered.slot;
    if (want.has_parent) {
      EXPECT_EQ(recovered.lineage.parent, want.parent);
    }
    EXPECT_EQ(recovered.lineage.tokens, want.tokens) << "slot " << recovered.slot;
  }
  SlotBuffer read(tier->slot_bytes());
  EXPECT_THAT(tier->Read(1, HashOf(1), read, nullptr), IsOk());
}

TEST_F(DiskTierTest, AFlippedTokenIsBadHeader) {
  BlockLineage lineage;
  for (int32_t t = 0; t < 16; ++t) lineage.tokens.push_back(t);
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    SlotBuffer buffer(tier->slot_bytes());
    ASSERT_THAT(tier->Write(0, HashOf(0), 1, buffer, lineage), IsOk());
    ASSERT_THAT(tier->Write(1, HashOf(1), 2, buffer, lineage), IsOk());
  }
  const auto [path, offset] = Where(1, 4);
  FlipByte(path, offset + 128 + 4 * 9);  // the tenth token id
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(Refused(*tier, Refusal::kBadHeader), 1);
  ASSERT_EQ(tier->recovered().size(), 1u);
  EXPECT_EQ(tier->recovered()[0].slot, 0);
}

// A slot of kvcm's first format (version 1: its header checksum over [0, 120) at 120, no
// lineage) is whole but not this format: refused as another identity, never as damage.
TEST_F(DiskTierTest, ASlotOfTheFirstFormatIsRefusedAsAnotherIdentity) {
  { ASSERT_NE(OpenOrDie(Options()), nullptr); }  // creates the files
  std::vector<uint8_t> header(4096, 0);
  std::memcpy(header.data(), "KVCMSLOT", 8);
  const uint32_t version = 1;
  const uint32_t covered = 120;
  std::memcpy(header.data() + 8, &version, 4);
  std::memcpy(header.data() + 12, &covered, 4);
  const TierIdentity identity = Identity();
  std::memcpy(header.data() + 16, identity.data(), identity.size());
  const BlockHash hash = HashOf(0);
  std::memcpy(header.data() + 32, hash.bytes.data(), hash.bytes.size());
  const uint64_t checksum = XXH3_64bits(header.data(), covered);
  std::memcpy(header.data() + 120, &checksum, 8);
  const auto [path, offset] = Where(0, 4);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, header.data(), header.size(), static_cast<off_t>(offset)), 4096);
  ::close(fd);

  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(Refused(*tier, Refusal::kOtherIdentity), 1);
  EXPECT_EQ(Refused(*tier, Refusal::kBadHeader), 0);
  EXPECT_EQ(tier->open_report().recovered, 0);
}

TEST_F(DiskTierTest, SecondOpenWhileAliveIsAlreadyExistsNamingThePid) {
  auto first = OpenOrDie(Options());
  ASSERT_NE(first, nullptr);
  EXPECT_THAT(DiskTier::Open(Options()),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr(absl::StrCat("disk tier directory ", dir_, " is in use by pid ",
                                              ::getpid()))));
  first.reset();
  EXPECT_THAT(DiskTier::Open(Options()), IsOk());
}

TEST_F(DiskTierTest, FlippedDataByteIsChecksum) {
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  WriteSlots(*tier, 8);
  const auto [path, offset] = Where(5, 4);
  FlipByte(path, offset + 4096 + 1234);
  SlotBuffer read(tier->slot_bytes());
  Refusal refusal = Refusal::kIoError;
  EXPECT_THAT(tier->Read(5, HashOf(5), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kChecksum);
  EXPECT_THAT(tier->Read(4, HashOf(4), read, &refusal), IsOk());
}

TEST_F(DiskTierTest, FlippedHeaderByteIsBadHeaderAtOpen) {
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    WriteSlots(*tier, 8);
  }
  const auto [path, offset] = Where(2, 4);
  FlipByte(path, offset + 40);  // inside the block's hash
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(Refused(*tier, Refusal::kBadHeader), 1);
  EXPECT_EQ(tier->open_report().recovered, 7);
  for (const DiskTier::Recovered& recovered : tier->recovered()) EXPECT_NE(recovered.slot, 2);
  SlotBuffer read(tier->slot_bytes());
  Refusal refusal = Refusal::kIoError;
  EXPECT_THAT(tier->Read(2, HashOf(2), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kBadHeader);
}

TEST_F(DiskTierTest, FileOfAnotherIdentityIsNotRecovered) {
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    WriteSlots(*tier, 8);
  }
  DiskTier::Options options = Options();
  options.identity = Identity(2);
  auto tier = OpenOrDie(options);
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(Refused(*tier, Refusal::kOtherIdentity), 8);
  EXPECT_EQ(tier->open_report().recovered, 0);
  EXPECT_TRUE(tier->recovered().empty());
  SlotBuffer read(tier->slot_bytes());
  Refusal refusal = Refusal::kIoError;
  EXPECT_THAT(tier->Read(0, HashOf(0), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kOtherIdentity);
}

TEST_F(DiskTierTest, TruncatedFileIsExtendedAndItsLostSlotsAreNotRecovered) {
  {
    auto tier = OpenOrDie(Options(5, 1));  // one file of 5 slots
    ASSERT_NE(tier, nullptr);
    WriteSlots(*tier, 5);
  }
  // Half the file: slots 0 and 1 whole, slot 2 cut inside its data, slots 3 and 4 gone.
  ASSERT_EQ(::truncate(FilePath(0).c_str(), static_cast<off_t>(5 * kSlotBytes / 2)), 0);
  auto tier = OpenOrDie(Options(5, 1));
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(std::filesystem::file_size(FilePath(0)), 5 * kSlotBytes);
  EXPECT_EQ(Refused(*tier, Refusal::kTruncated), 1);
  EXPECT_EQ(tier->open_report().empty, 2);
  std::vector<int32_t> slots;
  for (const DiskTier::Recovered& recovered : tier->recovered()) slots.push_back(recovered.slot);
  EXPECT_THAT(slots, ::testing::ElementsAre(0, 1));
  SlotBuffer read(tier->slot_bytes());
  EXPECT_THAT(tier->Read(1, HashOf(1), read, nullptr), IsOk());
  for (int32_t lost = 2; lost < 5; ++lost) {
    EXPECT_THAT(tier->Read(lost, HashOf(lost), read, nullptr),
                StatusIs(absl::StatusCode::kDataLoss));
  }
}

TEST_F(DiskTierTest, TornWriteIsNeverServed) {
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  WriteSlots(*tier, 1);  // slot 0: block 0
  // The image of a write of block 99 (header and data), made through slot 1 and then
  // invalidated there; its first half lands on slot 0, as a crash mid-write leaves it.
  std::mt19937_64 random(kSeed + 1);
  SlotBuffer image(tier->slot_bytes());
  FillRandom(image, random);
  ASSERT_THAT(tier->Write(1, HashOf(99), 500, image), IsOk());
  ASSERT_THAT(tier->Invalidate(1), IsOk());
  const int fd = ::open(FilePath(0).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, image.slot(), kSlotBytes / 2, 0), static_cast<ssize_t>(kSlotBytes / 2));
  ::close(fd);
  SlotBuffer read(tier->slot_bytes());
  Refusal refusal = Refusal::kIoError;
  EXPECT_THAT(tier->Read(0, HashOf(99), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kChecksum);
  EXPECT_THAT(tier->Read(0, HashOf(0), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kWrongHash);
  // After a restart: the header is whole, so Open() (which reads only headers) keeps the
  // slot, but its data is checked at every read and is still refused.
  tier.reset();
  tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  for (const DiskTier::Recovered& recovered : tier->recovered()) {
    EXPECT_NE(recovered.hash, HashOf(0)) << "the torn slot still served block 0";
  }
  EXPECT_THAT(tier->Read(0, HashOf(99), read, &refusal), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(refusal, Refusal::kChecksum);
}

TEST_F(DiskTierTest, WrongExpectedHashIsRefused) {
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  WriteSlots(*tier, 2);
  SlotBuffer read(tier->slot_bytes());
  Refusal refusal = Refusal::kIoError;
  EXPECT_THAT(tier->Read(0, HashOf(1), read, &refusal),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(HashOf(0).ToHex())));
  EXPECT_EQ(refusal, Refusal::kWrongHash);
}

TEST_F(DiskTierTest, TwoSlotsOfOneHashKeepTheNewestSerial) {
  {
    auto tier = OpenOrDie(Options());
    ASSERT_NE(tier, nullptr);
    SlotBuffer buffer(tier->slot_bytes());
    ASSERT_THAT(tier->Write(2, HashOf(1), 5, buffer), IsOk());
    ASSERT_THAT(tier->Write(5, HashOf(1), 9, buffer), IsOk());   // newer in the later slot
    ASSERT_THAT(tier->Write(1, HashOf(2), 20, buffer), IsOk());  // newer in the earlier slot
    ASSERT_THAT(tier->Write(6, HashOf(2), 3, buffer), IsOk());
  }
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(Refused(*tier, Refusal::kWrongHash), 2);
  EXPECT_EQ(tier->open_report().recovered, 2);
  EXPECT_EQ(tier->open_report().max_serial, 20u);
  ASSERT_EQ(tier->recovered().size(), 2u);
  EXPECT_EQ(tier->recovered()[0].slot, 1);
  EXPECT_EQ(tier->recovered()[0].serial, 20u);
  EXPECT_EQ(tier->recovered()[1].slot, 5);
  EXPECT_EQ(tier->recovered()[1].serial, 9u);
}

TEST_F(DiskTierTest, InvalidOptionsAreRefused) {
  DiskTier::Options options = Options();
  options.block_bytes = 0;
  EXPECT_THAT(DiskTier::Open(options), StatusIs(absl::StatusCode::kInvalidArgument));
  options = Options();
  options.files = 0;
  EXPECT_THAT(DiskTier::Open(options), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(DiskTierTest, DirectoryThatCannotBeCreatedIsNamed) {
  const std::string file = root_ + "/plain-file";
  std::ofstream(file) << "not a directory";
  DiskTier::Options options = Options();
  options.dir = file + "/tier";
  absl::StatusOr<std::unique_ptr<DiskTier>> tier = DiskTier::Open(options);
  ASSERT_FALSE(tier.ok());
  EXPECT_THAT(tier.status().message(), HasSubstr(options.dir));
}

// A full disk, made deterministic with RLIMIT_FSIZE (writes past it fail with EFBIG) in a
// child process, so that the limit does not reach the rest of the tests.
TEST_F(DiskTierTest, DiskFullIsResourceExhausted) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    absl::StatusOr<std::unique_ptr<DiskTier>> tier = DiskTier::Open(Options());
    if (!tier.ok()) _exit(10);
    const rlimit limit{2 * kSlotBytes, 2 * kSlotBytes};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(11);
    SlotBuffer buffer((*tier)->slot_bytes());
    if (!(*tier)->Write(1, HashOf(1), 1, buffer).ok()) _exit(12);  // ends at the limit
    if ((*tier)->Write(3, HashOf(3), 2, buffer).code() != absl::StatusCode::kResourceExhausted) {
      _exit(13);
    }
    tier->reset();
    DiskTier::Options options = Options();
    options.dir = root_ + "/small";
    const absl::Status opened = DiskTier::Open(options).status();
    if (opened.code() != absl::StatusCode::kResourceExhausted) _exit(14);
    if (opened.message().find(absl::StrCat(4 * kSlotBytes, " bytes")) == std::string::npos) {
      _exit(15);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: open, 11: setrlimit, 12: write below the limit, 13: write past it not "
         "RESOURCE_EXHAUSTED, 14: open past it not RESOURCE_EXHAUSTED, 15: no byte count";
}

TEST_F(DiskTierTest, SyncCoversTheWritesThatReturnedBeforeIt) {
  auto tier = OpenOrDie(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->writes(), 0u);
  EXPECT_EQ(tier->synced_writes(), 0u);
  WriteSlots(*tier, 3);
  EXPECT_EQ(tier->writes(), 3u);
  EXPECT_EQ(tier->synced_writes(), 0u);
  ASSERT_THAT(tier->Sync(), IsOk());
  EXPECT_EQ(tier->synced_writes(), 3u);
  EXPECT_EQ(tier->syncs(), 1u);
  // An invalidation is a write too: a reused slot's old header must not come back.
  ASSERT_THAT(tier->Invalidate(0), IsOk());
  EXPECT_EQ(tier->writes(), 4u);
  EXPECT_EQ(tier->synced_writes(), 3u);
  ASSERT_THAT(tier->Sync(), IsOk());
  EXPECT_EQ(tier->synced_writes(), 4u);
  EXPECT_EQ(tier->syncs(), 2u);
  EXPECT_EQ(tier->sync_errors(), 0u);
}

TEST(TierIdentityTest, DiffersWhenAnyInputDiffers) {
  std::array<uint8_t, 16> digest{};
  digest.fill(7);
  const TierIdentity base = MakeTierIdentity(digest, Spec(), HashAlgorithm::kXxh3V2);
  EXPECT_EQ(MakeTierIdentity(digest, Spec(), HashAlgorithm::kXxh3V2), base);
  std::set<TierIdentity> seen = {base};
  auto expect_new = [&](const std::array<uint8_t, 16>& d, const KvCacheSpec& spec,
                        HashAlgorithm algorithm, const char* what) {
    EXPECT_TRUE(seen.insert(MakeTierIdentity(d, spec, algorithm)).second) << what;
  };
  std::array<uint8_t, 16> other = digest;
  other[15] ^= 1;
  expect_new(other, Spec(), HashAlgorithm::kXxh3V2, "model digest");
  KvCacheSpec spec = Spec();
  spec.num_layers += 1;
  expect_new(digest, spec, HashAlgorithm::kXxh3V2, "num_layers");
  spec = Spec();
  spec.num_kv_heads += 1;
  expect_new(digest, spec, HashAlgorithm::kXxh3V2, "num_kv_heads");
  spec = Spec();
  spec.head_dim += 1;
  expect_new(digest, spec, HashAlgorithm::kXxh3V2, "head_dim");
  spec = Spec();
  spec.dtype = DType::kFloat16;
  expect_new(digest, spec, HashAlgorithm::kXxh3V2, "dtype");
  spec = Spec();
  spec.block_size = 32;
  expect_new(digest, spec, HashAlgorithm::kXxh3V2, "block_size");
  expect_new(digest, Spec(), HashAlgorithm::kSha256, "algorithm");
}

class ModelDigestTest : public DiskTierTest {
 protected:
  static void WriteFile(const std::string& path, const std::string& contents) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << contents;
    ASSERT_TRUE(out.good()) << path;
  }
  // Moves the file's mtime by `seconds`, so that a change is seen whatever the file
  // system's timestamp granularity.
  static void MoveMtime(const std::string& path, int seconds) {
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    timespec times[2] = {st.st_atim, st.st_mtim};
    times[1].tv_sec += seconds;
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  }
  static void ChangeByte(const std::string& path, uint64_t offset) {
    FlipByte(path, offset);
    MoveMtime(path, 5);
  }
  static std::string ReadAll(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream contents;
    contents << in.rdbuf();
    return contents.str();
  }
};

TEST_F(ModelDigestTest, FileDigestIsXxh3OfItsBytesAndFollowsChanges) {
  const std::string model = root_ + "/model.gguf";
  WriteFile(model, std::string(100000, 'w'));
  absl::StatusOr<std::array<uint8_t, 16>> first = ModelDigest(model, "");
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(*ModelDigest(model, ""), *first);
  // "file" || u64 size || the bytes (disk_tier.h).
  std::string message = "file";
  const uint64_t size = 100000;
  message.append(reinterpret_cast<const char*>(&size), sizeof(size));
  message += std::string(100000, 'w');
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits(message.data(), message.size()));
  EXPECT_EQ(std::memcmp(first->data(), canonical.digest, 16), 0);

  const std::string cache = root_ + "/digests";
  EXPECT_EQ(*ModelDigest(model, cache), *first);
  ChangeByte(model, 5000);
  absl::StatusOr<std::array<uint8_t, 16>> changed = ModelDigest(model, cache);
  ASSERT_THAT(changed, IsOk());
  EXPECT_NE(*changed, *first);
  EXPECT_EQ(*changed, *ModelDigest(model, ""));
}

TEST_F(ModelDigestTest, DirectoryDigestCoversTheModelFilesOnly) {
  const std::string model = root_ + "/model";
  ASSERT_TRUE(std::filesystem::create_directories(model + "/subdir"));
  WriteFile(model + "/config.json", "{\"num_hidden_layers\": 2}");
  WriteFile(model + "/model.safetensors", std::string(50000, 's'));
  WriteFile(model + "/tokenizer.model", "tokens");
  WriteFile(model + "/README.md", "readme");
  const std::string cache = root_ + "/digests";
  absl::StatusOr<std::array<uint8_t, 16>> first = ModelDigest(model, cache);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(*ModelDigest(model, cache), *first);
  EXPECT_EQ(*ModelDigest(model, ""), *first);
  EXPECT_NE(*first, *ModelDigest(model + "/model.safetensors", ""));
  // Not a model file: no effect.
  WriteFile(model + "/README.md", "another readme");
  EXPECT_EQ(*ModelDigest(model, ""), *first);
  ChangeByte(model + "/model.safetensors", 40000);
  absl::StatusOr<std::array<uint8_t, 16>> changed = ModelDigest(model, cache);
  ASSERT_THAT(changed, IsOk());
  EXPECT_NE(*changed, *first);
  EXPECT_EQ(*changed, *ModelDigest(model, ""));
}

TEST_F(ModelDigestTest, CacheFileIsWrittenAndReused) {
  const std::string model = root_ + "/model.gguf";
  WriteFile(model, std::string(4096, 'g'));
  const std::string cache = root_ + "/digests";
  absl::StatusOr<std::array<uint8_t, 16>> digest = ModelDigest(model, cache);
  ASSERT_THAT(digest, IsOk());
  const std::string contents = ReadAll(cache);
  EXPECT_THAT(contents, HasSubstr(absl::StrCat("digest-v1 ", model, " 4096 ")));
  EXPECT_EQ(std::count(contents.begin(), contents.end(), '\n'), 1);
  EXPECT_EQ(*ModelDigest(model, cache), *digest);
  EXPECT_EQ(ReadAll(cache), contents);  // a hit does not rewrite the cache
  // Reused while the key matches: a digest planted in the cache is returned as is.
  const std::string real_hex = contents.substr(contents.size() - 33, 32);
  std::string planted = contents;
  planted.replace(contents.size() - 33, 32, std::string(32, 'a'));
  WriteFile(cache, planted);
  std::array<uint8_t, 16> all_aa;
  all_aa.fill(0xaa);
  EXPECT_EQ(*ModelDigest(model, cache), all_aa);
  // A new key (another mtime) is hashed again, and replaces the line.
  MoveMtime(model, 3);
  EXPECT_EQ(*ModelDigest(model, cache), *digest);
  const std::string rewritten = ReadAll(cache);
  EXPECT_EQ(std::count(rewritten.begin(), rewritten.end(), '\n'), 1);
  EXPECT_THAT(rewritten, HasSubstr(real_hex));
}

TEST_F(ModelDigestTest, MissingModelIsNotFoundAndUnwritableCacheIsNoError) {
  EXPECT_THAT(ModelDigest(root_ + "/missing", ""), StatusIs(absl::StatusCode::kNotFound));
  const std::string model = root_ + "/model.gguf";
  WriteFile(model, "weights");
  EXPECT_THAT(ModelDigest(model, root_ + "/no/such/dir/digests"), IsOk());
}

}  // namespace
}  // namespace kvcm::cache_manager::tiers
