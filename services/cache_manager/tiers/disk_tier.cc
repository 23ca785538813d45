// The disk tier's slot files (docs/architecture.md, "Tiers"; the format is in disk_tier.h).
#include "services/cache_manager/tiers/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

// Header-only use of Debian's xxHash, as common/block/block_hash.cc does.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/atomic_file.h"
#include "common/base/check.h"
#include "common/base/status_macros.h"

namespace kvcm::cache_manager::tiers {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the slot header and the identity are written little-endian; add byte swaps "
              "before building on a big-endian machine");

constexpr uint64_t kPage = 4096;  // header size, slot alignment, O_DIRECT's unit
constexpr char kMagic[8] = {'K', 'V', 'C', 'M', 'S', 'L', 'O', 'T'};
constexpr uint32_t kVersion = 2;
// Version 1's header checksum covered [0, 120) and sat at 120.
constexpr uint32_t kVersion1 = 1;
constexpr uint32_t kVersion1Covered = 120;
// Version 2 covers the fixed fields and the token ids; its checksum follows them.
constexpr uint32_t kFixedBytes = 128;
constexpr absl::string_view kIdentityTag = "kvcm.tier.v1";
constexpr absl::string_view kDigestCacheTag = "digest-v1";
// Model files larger than the cache file would hold are not expected: one line per model.
constexpr size_t kMaxDigestCacheBytes = 1 << 20;

// Offsets of the header fields (disk_tier.h, "Slot header").
constexpr size_t kOffVersion = 8;
constexpr size_t kOffCovered = 12;
constexpr size_t kOffIdentity = 16;
constexpr size_t kOffHash = 32;
constexpr size_t kOffSerial = 64;
constexpr size_t kOffDataBytes = 72;
constexpr size_t kOffDataChecksum = 80;
constexpr size_t kOffParent = 88;
constexpr size_t kOffFlags = 120;
constexpr size_t kOffTokenCount = 124;
constexpr size_t kOffTokens = 128;
constexpr uint32_t kFlagHasParent = 1;

// Zeros for Invalidate: one aligned page, so that it can be written with O_DIRECT.
alignas(kPage) constexpr uint8_t kZeroPage[kPage] = {};

std::string Errno(int error) { return std::strerror(error); }

template <typename T>
void Put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(value));
}
template <typename T>
T Get(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(value));
  return value;
}

uint64_t Xxh64(const uint8_t* bytes, size_t size) { return XXH3_64bits(bytes, size); }

std::array<uint8_t, 16> Canonical128(XXH128_hash_t hash) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  std::array<uint8_t, 16> out;
  std::memcpy(out.data(), canonical.digest, out.size());
  return out;
}

uint64_t RoundUpToPage(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

bool AllZero(const uint8_t* bytes, size_t size) {
  return std::all_of(bytes, bytes + size, [](uint8_t b) { return b == 0; });
}

// A header's fields after CheckHeader accepted it.
struct SlotHeader {
  BlockHash hash;
  uint64_t serial = 0;
  uint64_t data_bytes = 0;
  uint64_t data_checksum = 0;
  BlockLineage lineage;  // only when asked for (CheckHeader's want_lineage)
};

// nullopt when the header at `slot` is well formed and of `identity`; else why not. The
// checksum is checked before the identity, so that a torn header is never reported as a
// file of another model.
std::optional<Refusal> CheckHeader(const uint8_t* slot, const TierIdentity& identity,
                                   SlotHeader* header, bool want_lineage = false) {
  if (std::memcmp(slot, kMagic, sizeof(kMagic)) != 0) return Refusal::kBadHeader;
  const uint32_t version = Get<uint32_t>(slot + kOffVersion);
  const uint32_t covered = Get<uint32_t>(slot + kOffCovered);
  if (version == kVersion1 && covered == kVersion1Covered &&
      Get<uint64_t>(slot + kVersion1Covered) == Xxh64(slot, kVersion1Covered)) {
    return Refusal::kOtherIdentity;  // whole, but of the earlier format
  }
  const uint32_t tokens = Get<uint32_t>(slot + kOffTokenCount);
  if (version != kVersion || covered < kFixedBytes || covered + 8 > kPage ||
      tokens > kMaxSlotTokens || covered != kFixedBytes + 4 * tokens ||
      Get<uint64_t>(slot + covered) != Xxh64(slot, covered)) {
    return Refusal::kBadHeader;
  }
  if (std::memcmp(slot + kOffIdentity, identity.data(), identity.size()) != 0) {
    return Refusal::kOtherIdentity;
  }
  std::memcpy(header->hash.bytes.data(), slot + kOffHash, header->hash.bytes.size());
  header->serial = Get<uint64_t>(slot + kOffSerial);
  header->data_bytes = Get<uint64_t>(slot + kOffDataBytes);
  header->data_checksum = Get<uint64_t>(slot + kOffDataChecksum);
  if (want_lineage) {
    BlockLineage& lineage = header->lineage;
    lineage.has_parent = (Get<uint32_t>(slot + kOffFlags) & kFlagHasParent) != 0;
    if (lineage.has_parent) {
      std::memcpy(lineage.parent.bytes.data(), slot + kOffParent, lineage.parent.bytes.size());
    }
    lineage.tokens.resize(tokens);
    if (tokens > 0) std::memcpy(lineage.tokens.data(), slot + kOffTokens, 4 * size_t{tokens});
  }
  return std::nullopt;
}

// pread/pwrite of the whole range, continuing after short transfers and EINTR. Returns the
// bytes moved (less than `size` only at end of file for a read) or -1 with errno set.
ssize_t PreadAll(int fd, uint8_t* buffer, size_t size, uint64_t offset) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, buffer + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

ssize_t PwriteAll(int fd, const uint8_t* buffer, size_t size, uint64_t offset) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, buffer + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) {
      errno = EIO;
      return -1;
    }
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

// ENOSPC, and EFBIG (a file-size limit, RLIMIT_FSIZE or the file system's), both mean that
// the disk tier has no room: the operator's problem, not a bug.
bool IsOutOfSpace(int error) { return error == ENOSPC || error == EFBIG || error == EDQUOT; }

// Creates `path` and its missing parents; the tier's own directory gets 0700 (its files
// hold other tenants' KV).
absl::Status MakeDirectory(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1)) {
    const std::string parent = path.substr(0, slash);
    if (::mkdir(parent.c_str(), 0755) != 0 && errno != EEXIST) {
      const int error = errno;
      return absl::InternalError(absl::StrCat("cannot create disk tier directory ", path,
                                              ": creating ", parent, ": ", Errno(error)));
    }
  }
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    const int error = errno;
    const std::string message =
        absl::StrCat("cannot create disk tier directory ", path, ": ", Errno(error));
    return error == EACCES || error == EPERM ? absl::PermissionDeniedError(message)
                                             : absl::InternalError(message);
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InternalError(absl::StrCat("disk tier directory ", path, " is not a directory"));
  }
  return absl::OkStatus();
}

std::string ReadPid(int fd) {
  char buffer[32] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  int pid = 0;
  if (n <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buffer)), &pid)) {
    return "unknown";
  }
  return absl::StrCat(pid);
}

// The directory's one owner (disk_tier.h): as RunDirectory::Acquire locks the run
// directory. The lock file stays when the owner goes: unlinking it would let two later
// owners lock two different files.
absl::StatusOr<UniqueFd> LockDirectory(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/tier.lock");
  UniqueFd lock(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!lock.valid()) {
    const int error = errno;
    const std::string message = absl::StrCat("cannot open ", path, ": ", Errno(error));
    return error == EACCES ? absl::PermissionDeniedError(message) : absl::InternalError(message);
  }
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EWOULDBLOCK) {
      return absl::AlreadyExistsError(
          absl::StrCat("disk tier directory ", dir, " is in use by pid ", ReadPid(lock.get())));
    }
    return absl::InternalError(absl::StrCat("cannot lock ", path, ": ", Errno(error)));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(lock.get(), 0) != 0 ||
      ::pwrite(lock.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int error = errno;
    return absl::InternalError(absl::StrCat("cannot write pid into ", path, ": ", Errno(error)));
  }
  return lock;
}

// Opens one tier file, with O_DIRECT when asked and the file system takes it (open()
// refuses it with EINVAL on file systems without direct I/O).
absl::StatusOr<UniqueFd> OpenTierFile(const std::string& path, bool* direct_io) {
  constexpr int kFlags = O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW;
  if (*direct_io) {
    UniqueFd fd(::open(path.c_str(), kFlags | O_DIRECT, 0600));
    if (fd.valid()) return fd;
    if (errno != EINVAL) {
      const int error = errno;
      return absl::InternalError(absl::StrCat("cannot open ", path, ": ", Errno(error)));
    }
    *direct_io = false;
  }
  UniqueFd fd(::open(path.c_str(), kFlags, 0600));
  if (!fd.valid()) {
    const int error = errno;
    const std::string message = absl::StrCat("cannot open ", path, ": ", Errno(error));
    return error == EACCES ? absl::PermissionDeniedError(message) : absl::InternalError(message);
  }
  return fd;
}

// Gives the file exactly `size` bytes, all allocated, so that a full disk shows at Open()
// and not in the middle of serving. Bytes past the old end read as zeros (empty slots).
absl::Status Preallocate(int fd, const std::string& path, uint64_t old_size, uint64_t size) {
  if (old_size > size && ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int error = errno;
    return absl::InternalError(
        absl::StrCat("cannot shrink ", path, " to ", size, " bytes: ", Errno(error)));
  }
  int error = 0;
  if (::fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0) {
    error = errno;
    // posix_fallocate returns its error instead of setting errno.
    if (error == EOPNOTSUPP) error = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  }
  if (error == 0) return absl::OkStatus();
  if (IsOutOfSpace(error)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot preallocate ", size, " bytes for ", path, ": ", Errno(error),
                     "; free space or lower the disk tier's capacity"));
  }
  return absl::InternalError(
      absl::StrCat("cannot preallocate ", size, " bytes for ", path, ": ", Errno(error)));
}

// The key under which a digest is cached: a file's own; for a directory, the newest mtime
// (of the directory and its model files: adding or removing a file changes the
// directory's), the sum of the files' sizes and the directory's inode.
struct DigestKey {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
};

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

bool IsModelFileName(absl::string_view name) {
  for (absl::string_view suffix : {".safetensors", ".gguf", ".bin", ".json", ".model", ".txt"}) {
    if (name.size() > suffix.size() && absl::EndsWith(name, suffix)) return true;
  }
  return false;
}

// The model files directly in `dir` (regular files, symbolic links followed: a Hugging Face
// snapshot links into its blobs), by name in byte order, and the directory's key.
absl::Status ListModelFiles(const std::string& dir, const struct stat& dir_stat,
                            std::vector<std::string>* names, DigestKey* key) {
  DIR* stream = ::opendir(dir.c_str());
  if (stream == nullptr) {
    const int error = errno;
    return absl::InternalError(absl::StrCat("cannot list ", dir, ": ", Errno(error)));
  }
  *key = DigestKey{0, MtimeNs(dir_stat), static_cast<uint64_t>(dir_stat.st_ino)};
  absl::Status status;
  while (const dirent* entry = ::readdir(stream)) {
    const std::string name = entry->d_name;
    if (!IsModelFileName(name)) continue;
    struct stat st {};
    if (::stat(absl::StrCat(dir, "/", name).c_str(), &st) != 0) {
      const int error = errno;
      status =
          absl::InternalError(absl::StrCat("cannot stat ", dir, "/", name, ": ", Errno(error)));
      break;
    }
    if (!S_ISREG(st.st_mode)) continue;
    names->push_back(name);
    key->size += static_cast<uint64_t>(st.st_size);
    key->mtime_ns = std::max(key->mtime_ns, MtimeNs(st));
  }
  ::closedir(stream);
  std::sort(names->begin(), names->end());
  return status;
}

// Feeds u64 size || the bytes of `path` to `state`.
absl::Status HashFile(const std::string& path, XXH3_state_t* state) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st {};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
    const int error = errno;
    return absl::InternalError(absl::StrCat("cannot open ", path, ": ", Errno(error)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  XXH3_128bits_update(state, &size, sizeof(size));
  std::vector<uint8_t> chunk(1 << 20);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      return absl::InternalError(absl::StrCat("cannot read ", path, ": ", Errno(error)));
    }
    if (n == 0) {
      return absl::InternalError(absl::StrCat(path, " shrank while it was being hashed"));
    }
    const uint64_t take = std::min<uint64_t>(static_cast<uint64_t>(n), size - done);
    XXH3_128bits_update(state, chunk.data(), take);
    done += take;
  }
  return absl::OkStatus();
}

std::string CacheLine(const std::string& path, const DigestKey& key,
                      const std::array<uint8_t, 16>& digest) {
  std::string hex;
  for (uint8_t byte : digest) absl::StrAppend(&hex, absl::Hex(byte, absl::kZeroPad2));
  return absl::StrCat(kDigestCacheTag, " ", path, " ", key.size, " ", key.mtime_ns, " ", key.inode,
                      " ", hex);
}

// The cached digest of `path` under `key`, if the cache file has one. The path may hold
// spaces, so a line is split from the right.
std::optional<std::array<uint8_t, 16>> LookUpDigest(const std::string& contents,
                                                    const std::string& path, const DigestKey& key) {
  const std::string prefix = CacheLine(path, key, {});
  const absl::string_view head(prefix.data(), prefix.size() - 32);  // without the hex
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    if (line.size() != prefix.size() || !absl::StartsWith(line, head)) continue;
    std::array<uint8_t, 16> digest;
    bool ok = true;
    for (size_t i = 0; i < digest.size() && ok; ++i) {
      uint32_t byte = 0;
      ok = absl::SimpleHexAtoi(line.substr(head.size() + 2 * i, 2), &byte);
      digest[i] = static_cast<uint8_t>(byte);
    }
    if (ok) return digest;
  }
  return std::nullopt;
}

// Replaces `path`'s line in the cache file. Best effort: a read-only cache costs a rehash
// at the next start, nothing else.
void StoreDigest(const std::string& cache_file, const std::string& contents,
                 const std::string& path, const DigestKey& key,
                 const std::array<uint8_t, 16>& digest) {
  const std::string mine = absl::StrCat(kDigestCacheTag, " ", path, " ");
  std::string updated;
  for (absl::string_view line : absl::StrSplit(contents, '\n', absl::SkipEmpty())) {
    if (!absl::StartsWith(line, mine)) absl::StrAppend(&updated, line, "\n");
  }
  absl::StrAppend(&updated, CacheLine(path, key, digest), "\n");
  (void)WriteFileAtomically(cache_file, updated, 0600);
}

void PutIdentityInt(XXH3_state_t* state, int32_t value) {
  XXH3_128bits_update(state, &value, sizeof(value));
}

}  // namespace

TierIdentity MakeTierIdentity(const std::array<uint8_t, 16>& model_digest, const KvCacheSpec& spec,
                              HashAlgorithm algorithm) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, kIdentityTag.data(), kIdentityTag.size());
  XXH3_128bits_update(&state, model_digest.data(), model_digest.size());
  PutIdentityInt(&state, spec.num_layers);
  PutIdentityInt(&state, spec.num_kv_heads);
  PutIdentityInt(&state, spec.head_dim);
  PutIdentityInt(&state, static_cast<int32_t>(spec.dtype));
  PutIdentityInt(&state, spec.block_size);
  const uint8_t algorithm_byte = static_cast<uint8_t>(algorithm);
  XXH3_128bits_update(&state, &algorithm_byte, sizeof(algorithm_byte));
  return Canonical128(XXH3_128bits_digest(&state));
}

absl::StatusOr<std::array<uint8_t, 16>> ModelDigest(const std::string& model_path,
                                                    const std::string& cache_file) {
  struct stat st {};
  if (::stat(model_path.c_str(), &st) != 0) {
    const int error = errno;
    const std::string message = absl::StrCat("model ", model_path, ": ", Errno(error));
    return error == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  }
  DigestKey key;
  std::vector<std::string> names;
  if (S_ISDIR(st.st_mode)) {
    if (absl::Status listed = ListModelFiles(model_path, st, &names, &key); !listed.ok()) {
      return listed;
    }
  } else if (S_ISREG(st.st_mode)) {
    key =
        DigestKey{static_cast<uint64_t>(st.st_size), MtimeNs(st), static_cast<uint64_t>(st.st_ino)};
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", model_path, " is neither a regular file nor a directory"));
  }
  std::string cached;
  if (!cache_file.empty()) {
    cached = ReadSmallFile(cache_file, kMaxDigestCacheBytes).value_or("");
    if (auto digest = LookUpDigest(cached, model_path, key)) return *digest;
  }
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  if (S_ISREG(st.st_mode)) {
    XXH3_128bits_update(&state, "file", 4);
    if (absl::Status hashed = HashFile(model_path, &state); !hashed.ok()) return hashed;
  }
  for (const std::string& name : names) {
    const uint32_t length = static_cast<uint32_t>(name.size());
    XXH3_128bits_update(&state, &length, sizeof(length));
    XXH3_128bits_update(&state, name.data(), name.size());
    if (absl::Status hashed = HashFile(absl::StrCat(model_path, "/", name), &state); !hashed.ok()) {
      return hashed;
    }
  }
  const std::array<uint8_t, 16> digest = Canonical128(XXH3_128bits_digest(&state));
  if (!cache_file.empty()) StoreDigest(cache_file, cached, model_path, key, digest);
  return digest;
}

std::string_view RefusalName(Refusal refusal) {
  switch (refusal) {
    case Refusal::kBadHeader:
      return "bad_header";
    case Refusal::kOtherIdentity:
      return "other_identity";
    case Refusal::kChecksum:
      return "checksum";
    case Refusal::kTruncated:
      return "truncated";
    case Refusal::kWrongHash:
      return "wrong_hash";
    case Refusal::kIoError:
      return "io_error";
  }
  return "unknown";
}

SlotBuffer::SlotBuffer(uint64_t slot_bytes) : slot_bytes_(slot_bytes) {
  KVCM_CHECK(slot_bytes >= kPage && slot_bytes % kPage == 0)
      << "slot bytes " << slot_bytes << " is not a positive multiple of 4096";
  slot_ = static_cast<uint8_t*>(std::aligned_alloc(kPage, slot_bytes));
  KVCM_CHECK(slot_ != nullptr) << "cannot allocate a slot buffer of " << slot_bytes << " bytes";
  std::memset(slot_, 0, slot_bytes);
}

SlotBuffer::~SlotBuffer() { std::free(slot_); }

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const Options& options) {
  const auto started = std::chrono::steady_clock::now();
  if (options.dir.empty()) return absl::InvalidArgumentError("disk tier: no directory");
  if (options.block_bytes == 0 || options.block_bytes > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier: block bytes ", options.block_bytes, " is not in [1, 2^40]"));
  }
  if (options.files < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier: files ", options.files, " is not positive"));
  }
  const uint64_t slot_bytes = kPage + RoundUpToPage(options.block_bytes);
  const uint64_t slots = std::max<uint64_t>(1, options.capacity_bytes / slot_bytes);
  if (slots > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier: capacity ", options.capacity_bytes,
                                                   " bytes makes ", slots, " slots of ", slot_bytes,
                                                   " bytes, more than 2^31 - 1"));
  }
  // The slots are split evenly among the files; a remainder of fewer slots than files is
  // dropped, so that the files never exceed the capacity.
  const int32_t files = static_cast<int32_t>(std::min<uint64_t>(options.files, slots));
  auto tier = std::unique_ptr<DiskTier>(new DiskTier(options));
  tier->slot_bytes_ = slot_bytes;
  tier->slots_per_file_ = static_cast<int32_t>(slots / static_cast<uint64_t>(files));
  tier->num_slots_ = tier->slots_per_file_ * files;
  if (absl::Status made = MakeDirectory(options.dir); !made.ok()) return made;
  absl::StatusOr<UniqueFd> lock = LockDirectory(options.dir);
  if (!lock.ok()) return lock.status();
  tier->lock_ = std::move(*lock);
  if (absl::Status opened = tier->OpenFiles(files); !opened.ok()) return opened;
  tier->report_.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return tier;
}

absl::Status DiskTier::OpenFiles(int32_t files) {
  bool direct_io = options_.direct_io;
  const uint64_t file_bytes = static_cast<uint64_t>(slots_per_file_) * slot_bytes_;
  std::vector<uint64_t> old_sizes;
  for (int32_t i = 0; i < files; ++i) {
    const std::string path = absl::StrCat(options_.dir, "/tier-", i, ".kvcm");
    absl::StatusOr<UniqueFd> fd = OpenTierFile(path, &direct_io);
    if (!fd.ok()) return fd.status();
    struct stat st {};
    if (::fstat(fd->get(), &st) != 0) {
      const int error = errno;
      return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", Errno(error)));
    }
    old_sizes.push_back(static_cast<uint64_t>(st.st_size));
    if (absl::Status sized = Preallocate(fd->get(), path, old_sizes.back(), file_bytes);
        !sized.ok()) {
      return sized;
    }
    files_.push_back(std::move(*fd));
  }
  // A file opened with O_DIRECT before another fell back keeps it; direct_io() says
  // whether all did.
  direct_io_ = direct_io;
  report_.direct_io = direct_io;
  ScanHeaders(old_sizes);
  return absl::OkStatus();
}

void DiskTier::ScanHeaders(const std::vector<uint64_t>& old_sizes) {
  report_.slots = num_slots_;
  SlotBuffer header(kPage);
  struct Found {
    int32_t slot;
    SlotHeader header;
  };
  std::vector<Found> found;
  for (int32_t slot = 0; slot < num_slots_; ++slot) {
    const int32_t file = slot / slots_per_file_;
    const uint64_t offset = static_cast<uint64_t>(slot % slots_per_file_) * slot_bytes_;
    if (offset >= old_sizes[static_cast<size_t>(file)]) {  // wholly past the old end
      ++report_.empty;
      continue;
    }
    if (PreadAll(files_[static_cast<size_t>(file)].get(), header.slot(), kPage, offset) !=
        static_cast<ssize_t>(kPage)) {
      ++report_.refused[static_cast<size_t>(Refusal::kIoError)];
      continue;
    }
    if (AllZero(header.slot(), kPage)) {
      ++report_.empty;
      continue;
    }
    // Its end was cut off: the header may still be whole, but the data is not.
    if (offset + slot_bytes_ > old_sizes[static_cast<size_t>(file)]) {
      ++report_.refused[static_cast<size_t>(Refusal::kTruncated)];
      continue;
    }
    SlotHeader parsed;
    if (std::optional<Refusal> refusal =
            CheckHeader(header.slot(), options_.identity, &parsed, /*want_lineage=*/true)) {
      ++report_.refused[static_cast<size_t>(*refusal)];
      continue;
    }
    report_.max_serial = std::max(report_.max_serial, parsed.serial);
    found.push_back({slot, parsed});
  }
  // Two slots of one hash: a crash between writing the new copy and invalidating the old.
  // The newest serial wins; the other is refused and its slot reusable.
  absl::flat_hash_map<BlockHash, size_t, BlockHashHasher> newest;
  for (size_t i = 0; i < found.size(); ++i) {
    auto [it, inserted] = newest.try_emplace(found[i].header.hash, i);
    if (!inserted && found[it->second].header.serial < found[i].header.serial) it->second = i;
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (newest.at(found[i].header.hash) != i) {
      ++report_.refused[static_cast<size_t>(Refusal::kWrongHash)];
      continue;
    }
    recovered_.push_back({found[i].slot, found[i].header.hash, found[i].header.serial,
                          std::move(found[i].header.lineage)});
  }
  report_.recovered = static_cast<int32_t>(recovered_.size());
}

DiskTier::~DiskTier() = default;  // closing lock_ releases the flock

absl::Status DiskTier::Write(int32_t slot, const BlockHash& hash, uint64_t serial,
                             SlotBuffer& buffer, const BlockLineage& lineage) {
  if (slot < 0 || slot >= num_slots_ || buffer.slot_bytes() != slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier write: slot ", slot, " of ",
                                                   num_slots_, ", buffer of ", buffer.slot_bytes(),
                                                   " bytes for slots of ", slot_bytes_));
  }
  uint8_t* header = buffer.slot();
  std::memset(header, 0, kPage);
  std::memcpy(header, kMagic, sizeof(kMagic));
  Put<uint32_t>(header + kOffVersion, kVersion);
  const uint32_t tokens =
      lineage.tokens.size() <= kMaxSlotTokens ? static_cast<uint32_t>(lineage.tokens.size()) : 0;
  const uint32_t covered = kFixedBytes + 4 * tokens;
  Put<uint32_t>(header + kOffCovered, covered);
  std::memcpy(header + kOffIdentity, options_.identity.data(), options_.identity.size());
  std::memcpy(header + kOffHash, hash.bytes.data(), hash.bytes.size());
  Put<uint64_t>(header + kOffSerial, serial);
  Put<uint64_t>(header + kOffDataBytes, options_.block_bytes);
  Put<uint64_t>(header + kOffDataChecksum, Xxh64(buffer.data(), options_.block_bytes));
  if (lineage.has_parent) {
    std::memcpy(header + kOffParent, lineage.parent.bytes.data(), lineage.parent.bytes.size());
    Put<uint32_t>(header + kOffFlags, kFlagHasParent);
  }
  Put<uint32_t>(header + kOffTokenCount, tokens);
  if (tokens > 0) std::memcpy(header + kOffTokens, lineage.tokens.data(), 4 * size_t{tokens});
  Put<uint64_t>(header + covered, Xxh64(header, covered));
  const int fd = files_[static_cast<size_t>(slot / slots_per_file_)].get();
  const uint64_t offset = static_cast<uint64_t>(slot % slots_per_file_) * slot_bytes_;
  if (PwriteAll(fd, buffer.slot(), slot_bytes_, offset) < 0) {
    const int error = errno;
    const std::string message = absl::StrCat("disk tier write of slot ", slot, " (", slot_bytes_,
                                             " bytes) in ", options_.dir, ": ", Errno(error));
    return IsOutOfSpace(error) ? absl::ResourceExhaustedError(message)
                               : absl::InternalError(message);
  }
  bytes_written_.fetch_add(slot_bytes_, std::memory_order_relaxed);
  writes_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<DiskTier::Extent> DiskTier::ExtentOf(int32_t slot, const SlotBuffer& buffer) const {
  if (slot < 0 || slot >= num_slots_ || buffer.slot_bytes() != slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier read: slot ", slot, " of ",
                                                   num_slots_, ", buffer of ", buffer.slot_bytes(),
                                                   " bytes for slots of ", slot_bytes_));
  }
  return Extent{files_[static_cast<size_t>(slot / slots_per_file_)].get(),
                static_cast<uint64_t>(slot % slots_per_file_) * slot_bytes_};
}

absl::Status DiskTier::Read(int32_t slot, const BlockHash& hash, SlotBuffer& buffer,
                            Refusal* refusal) {
  KVCM_ASSIGN_OR_RETURN(const Extent extent, ExtentOf(slot, buffer));
  const ssize_t n = PreadAll(extent.fd, buffer.slot(), slot_bytes_, extent.offset);
  return Verify(slot, hash, buffer, n < 0 ? -int64_t{errno} : int64_t{n}, refusal);
}

absl::Status DiskTier::Verify(int32_t slot, const BlockHash& hash, SlotBuffer& buffer, int64_t read,
                              Refusal* refusal) {
  KVCM_ASSIGN_OR_RETURN(const Extent extent, ExtentOf(slot, buffer));
  auto refuse = [&](Refusal why, const std::string& what) {
    if (refusal != nullptr) *refusal = why;
    return absl::DataLossError(absl::StrCat("disk tier slot ", slot, " in ", options_.dir,
                                            " refused (", std::string(RefusalName(why)),
                                            "): ", what));
  };
  if (read >= 0 && static_cast<uint64_t>(read) < slot_bytes_) {
    // A short read (at end of file, or one the kernel split): the rest, as Read does.
    const auto done = static_cast<uint64_t>(read);
    const ssize_t n =
        PreadAll(extent.fd, buffer.slot() + done, slot_bytes_ - done, extent.offset + done);
    read = n < 0 ? -int64_t{errno} : read + n;
  }
  if (read < 0) {
    if (refusal != nullptr) *refusal = Refusal::kIoError;
    return absl::InternalError(absl::StrCat("disk tier read of slot ", slot, " in ", options_.dir,
                                            ": ", Errno(static_cast<int>(-read))));
  }
  bytes_read_.fetch_add(static_cast<uint64_t>(read), std::memory_order_relaxed);
  if (static_cast<uint64_t>(read) < slot_bytes_) {
    return refuse(Refusal::kTruncated, "the file ends inside the slot");
  }
  SlotHeader header;
  if (std::optional<Refusal> bad = CheckHeader(buffer.slot(), options_.identity, &header)) {
    return refuse(*bad, *bad == Refusal::kBadHeader ? "bad header" : "another identity");
  }
  if (!(header.hash == hash)) {
    return refuse(Refusal::kWrongHash,
                  absl::StrCat("it holds block ", header.hash.ToHex(), ", not ", hash.ToHex()));
  }
  if (header.data_bytes != options_.block_bytes ||
      header.data_checksum != Xxh64(buffer.data(), options_.block_bytes)) {
    return refuse(Refusal::kChecksum, "the data does not match its checksum");
  }
  return absl::OkStatus();
}

absl::Status DiskTier::Invalidate(int32_t slot) {
  if (slot < 0 || slot >= num_slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("disk tier invalidate: slot ", slot, " of ", num_slots_));
  }
  const int fd = files_[static_cast<size_t>(slot / slots_per_file_)].get();
  const uint64_t offset = static_cast<uint64_t>(slot % slots_per_file_) * slot_bytes_;
  if (PwriteAll(fd, kZeroPage, kPage, offset) < 0) {
    const int error = errno;
    return absl::InternalError(absl::StrCat("disk tier invalidate of slot ", slot, " in ",
                                            options_.dir, ": ", Errno(error)));
  }
  writes_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status DiskTier::Sync() {
  // The writes counted now returned before the fdatasyncs start: those are what they cover.
  const uint64_t covered = writes_.load(std::memory_order_acquire);
  absl::Status first_error;
  for (size_t i = 0; i < files_.size(); ++i) {
    if (::fdatasync(files_[i].get()) == 0) continue;
    const int error = errno;
    sync_errors_.fetch_add(1, std::memory_order_relaxed);
    if (first_error.ok()) {
      first_error = absl::InternalError(absl::StrCat("disk tier fdatasync of ", options_.dir,
                                                     "/tier-", i, ".kvcm: ", Errno(error)));
    }
  }
  if (!first_error.ok()) return first_error;
  uint64_t synced = synced_writes_.load(std::memory_order_relaxed);
  while (synced < covered &&
         !synced_writes_.compare_exchange_weak(synced, covered, std::memory_order_release)) {
  }
  syncs_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace kvcm::cache_manager::tiers
