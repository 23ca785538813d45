#pragma once

// Mutex, MutexLock and ReaderMutexLock: a reader-writer lock (std::shared_mutex) with
// Clang's thread-safety annotations, so that members declared ABSL_GUARDED_BY(mu_) and
// functions declared ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) or ABSL_LOCKS_EXCLUDED(mu_) are
// checked at compile time by the clang build (-Wthread-safety -Werror,
// cmake/KvcmHelpers.cmake). The interface is absl::Mutex's (Lock, Unlock, ReaderLock,
// ReaderUnlock, MutexLock(&mu), ReaderMutexLock(&mu)), so a member can move between the two
// by its type alone.
//
// Why not absl::Mutex itself: Debian's libabsl is built without ThreadSanitizer, and
// absl::Mutex synchronises through atomics inside that library, which TSan does not see;
// every member it guards would be reported as a data race. std::shared_mutex is
// pthread_rwlock_t, which TSan intercepts (docs/RELIABILITY.md, "Sanitizers").
//
// Thread safety: that of std::shared_mutex. Not recursive; Unlock only from the thread that
// locked. Uncontended, a lock or an unlock is one atomic operation, as std::mutex's.

#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace kvcm {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Returns true with the lock held, false without it.
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // Shared with other readers, exclusive of Lock().
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds `mu` from construction to the end of the scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// Holds `mu` shared from construction to the end of the scope.
class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace kvcm
