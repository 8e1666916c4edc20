#include "backend/sealed_store.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "common/logging.h"
#include "transport/group_secret.h"
#include "transport/socket.h"

namespace hetcomm {
namespace {

// How often a wait for a record (or for a value that opens) looks again.
constexpr std::chrono::milliseconds kRetry{20};
// Where rank 0 publishes the group's secret, or (out-of-band secret) the group record, and where
// every other rank publishes its nonce for that record.
constexpr const char* kSecretKey = "hetcomm/secret";
constexpr const char* kRecordKey = "hetcomm/record";
// Set by a rank 0 with an out-of-band secret before it waits for the nonces: a rank without one
// learns at once that the settings differ (a hint only for a rank with one).
constexpr const char* kSealedMarkKey = "hetcomm/sealed";
// How long a rank with an out-of-band secret goes on when every record it finds fails its MAC
// (another secret than rank 0's, most likely) before it says so, rather than at the timeout.
constexpr std::chrono::seconds kForgedRecordPatience{10};
std::string nonceKey(int rank) { return strCat("hetcomm/nonce/", rank); }

void sayIgnoredOnce(const std::string& key) {
  static std::mutex mu;
  static std::set<std::string> said;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (said.size() >= 1024 || !said.insert(key).second) return;
  }
  HC_LOG(kWarn, "hetcomm: ignored the store's value of '", key, "': it fails its authentication (written by someone "
         "without the group's secret, or HETCOMM_SECRET differs between ranks)");
}

// Stores whose compareSet cannot serve readNow (a Python store's asserts): check + get instead.
std::atomic<bool> noCompareSet{false};

GroupKeys keysThroughTheStore(c10d::Store& store, int rank, std::chrono::milliseconds timeout,
                              const std::vector<std::string>& staleKeys) {
  if (rank == 0) {
    for (const std::string& key : staleKeys) store.deleteKey(key);
    store.deleteKey(kSealedMarkKey);
    std::array<uint8_t, kSecretBytes> secret{};
    secureRandom(secret.data(), secret.size());
    store.set(kSecretKey, std::vector<uint8_t>(secret.begin(), secret.end()));
    return keysFromStoreSecret(secret);
  }
  const Deadline deadline = Clock::now() + timeout;
  while (true) {
    if (std::optional<std::vector<uint8_t>> got = readNow(store, kSecretKey)) {
      if (got->size() != kSecretBytes) {
        throw CommError(strCat("rank ", rank, ": the group secret in the store has ", got->size(), " bytes, not ",
                               kSecretBytes, " (something else wrote '", kSecretKey, "')"));
      }
      std::array<uint8_t, kSecretBytes> secret{};
      std::copy(got->begin(), got->end(), secret.begin());
      return keysFromStoreSecret(secret);
    }
    if (readNow(store, kSealedMarkKey) || readNow(store, kRecordKey)) {
      throw CommError(strCat("rank 0 has an out-of-band secret (HETCOMM_SECRET_FILE or HETCOMM_SECRET) and rank ", rank,
                             " has none: set it on every rank or on none"));
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(strCat("rank ", rank, ": rank 0 did not publish the group's secret within ", timeout.count(),
                                " ms (did it create the process group?)"));
    }
    std::this_thread::sleep_for(kRetry);
  }
}

}  // namespace

std::optional<std::vector<uint8_t>> readNow(c10d::Store& store, const std::string& key) {
  // compareSet(key, x, x) reads without waiting and, for a missing key, writes nothing (x is not
  // empty) and answers x: no check-then-get that a deletion in between turns into a long wait.
  // Random per process: fixed bytes a store writer planted would read as "no value", and a wait
  // for that key would then last the store's timeout rather than kForgedRecordPatience.
  static const std::vector<uint8_t> kAbsentMark = [] {
    const std::string mark = "hetcomm: no value (a read that found none) ";
    std::vector<uint8_t> bytes(mark.begin(), mark.end());
    std::array<uint8_t, 16> nonce{};
    secureRandom(nonce.data(), nonce.size());
    for (uint8_t b : nonce) {
      bytes.push_back(static_cast<uint8_t>("0123456789abcdef"[b >> 4]));
      bytes.push_back(static_cast<uint8_t>("0123456789abcdef"[b & 15]));
    }
    return bytes;
  }();
  if (!noCompareSet.load()) {
    try {
      std::vector<uint8_t> raw = store.compareSet(key, kAbsentMark, kAbsentMark);
      if (raw == kAbsentMark) return std::nullopt;
      return raw;
    } catch (const c10::DistError&) {
      throw;  // the store's connection: not a missing feature
    } catch (const std::exception&) {
      noCompareSet = true;  // NotImplementedError, a Python store's assertion or exception
    }
  }
  if (!store.check({key})) return std::nullopt;
  return store.get(key);
}

bool putBack(c10d::Store& store, const std::string& key, const std::vector<uint8_t>& value) {
  if (!noCompareSet.load()) {
    try {
      // Sets it when missing (or empty); answers what is there otherwise.
      if (store.compareSet(key, {}, value) == value) return false;
      store.set(key, value);
      return true;
    } catch (const c10::DistError&) {
      throw;
    } catch (const std::exception&) {
      noCompareSet = true;
    }
  }
  if (store.check({key}) && store.get(key) == value) return false;
  store.set(key, value);
  return true;
}

SealedStore::SealedStore(c10::intrusive_ptr<c10d::Store> inner, std::optional<Sha256Digest> key)
    : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), key_(key) {}

std::optional<std::vector<uint8_t>> SealedStore::open(const std::string& key, const std::vector<uint8_t>& raw) {
  if (!key_) return raw;
  std::optional<std::vector<uint8_t>> value = openValue(*key_, key, raw);
  if (!value) sayIgnoredOnce(key);
  return value;
}

SealedStore::Read SealedStore::tryGet(const std::string& key, std::vector<uint8_t>& value) {
  std::optional<std::vector<uint8_t>> raw = readNow(*inner_, key);
  if (!raw) return Read::kAbsent;
  std::optional<std::vector<uint8_t>> opened = open(key, *raw);
  if (!opened) return Read::kForged;
  value = std::move(*opened);
  return Read::kValue;
}

c10::intrusive_ptr<c10d::Store> SealedStore::clone() { return cloneSealed(); }

c10::intrusive_ptr<SealedStore> SealedStore::cloneSealed() {
  return c10::make_intrusive<SealedStore>(inner_->clone(), key_);
}

std::vector<uint8_t> SealedStore::sealed(const std::string& key, const std::vector<uint8_t>& value) const {
  return key_ ? sealValue(*key_, key, value) : value;
}

void SealedStore::set(const std::string& key, const std::vector<uint8_t>& value) { inner_->set(key, sealed(key, value)); }

std::vector<uint8_t> SealedStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  if (!key_) return inner_->compareSet(key, expected, desired);
  const std::vector<uint8_t> sealedDesired = sealValue(*key_, key, desired);
  // Sealing is deterministic: a sealed expected value is byte for byte what its writer stored.
  std::vector<uint8_t> expect = expected.empty() ? expected : sealValue(*key_, key, expected);
  for (int attempt = 0; attempt < 8; ++attempt) {
    const std::vector<uint8_t> now = inner_->compareSet(key, expect, sealedDesired);
    if (std::optional<std::vector<uint8_t>> value = open(key, now)) return *value;
    if (!expected.empty()) return {};
    // A forged value counts as none: replace exactly that one (another rank's genuine value,
    // written meanwhile, is kept).
    expect = now;
  }
  return {};  // a store writer keeps forging it
}

std::vector<uint8_t> SealedStore::get(const std::string& key) {
  const Deadline deadline = Clock::now() + getTimeout();
  bool forged = false;
  // Since when a value read has failed its seal: one still not replaced by an authentic one
  // kForgedRecordPatience later is not coming (its writer writes once, and early), so the reader
  // says so then rather than at the store's timeout, which may outlast the group's (a torchrun
  // store), while its peers still wait to hear why. Not reset when the key is absent meanwhile:
  // a writer flipping between a forged value and none would otherwise hold the reader.
  std::optional<Clock::time_point> forgedSince;
  while (true) {
    std::vector<uint8_t> value;
    const Read read = tryGet(key, value);
    if (read == Read::kValue) return value;
    forged = forged || read == Read::kForged;
    if (read == Read::kForged && !forgedSince) forgedSince = Clock::now();
    if (forgedSince && Clock::now() - *forgedSince >= kForgedRecordPatience) {
      C10_THROW_ERROR(DistStoreError,
                      strCat("hetcomm: the store's value of '", key, "' failed its authentication for ",
                             kForgedRecordPatience.count(), " s: written by someone without the group's secret, or "
                             "HETCOMM_SECRET differs between ranks"));
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      C10_THROW_ERROR(DistStoreError,
                      forged ? strCat("hetcomm: the store's value of '", key, "' failed its authentication until the "
                                      "timeout (", getTimeout().count(), " ms): written by someone without the "
                                      "group's secret, or HETCOMM_SECRET differs between ranks")
                             : strCat("hetcomm: '", key, "' did not appear in the store within ", getTimeout().count(),
                                      " ms"));
    }
    try {
      inner_->wait({key}, std::min(left, std::chrono::milliseconds(1000)));
    } catch (const c10::Error&) {
      // not there yet (a real failure of the store shows in the next read)
    }
    std::this_thread::sleep_for(kRetry);
  }
}

int64_t SealedStore::add(const std::string& key, int64_t value) { return inner_->add(key, value); }
bool SealedStore::deleteKey(const std::string& key) { return inner_->deleteKey(key); }
bool SealedStore::check(const std::vector<std::string>& keys) { return inner_->check(keys); }
int64_t SealedStore::getNumKeys() { return inner_->getNumKeys(); }
void SealedStore::wait(const std::vector<std::string>& keys) { inner_->wait(keys); }
void SealedStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  inner_->wait(keys, timeout);
}
const std::chrono::milliseconds& SealedStore::getTimeout() const noexcept { return inner_->getTimeout(); }
void SealedStore::setTimeout(const std::chrono::milliseconds& timeout) { inner_->setTimeout(timeout); }

std::vector<std::vector<uint8_t>> SealedStore::multiGet(const std::vector<std::string>& keys) {
  std::vector<std::vector<uint8_t>> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) out.push_back(get(key));
  return out;
}

void SealedStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  TORCH_CHECK_VALUE(keys.size() == values.size(), "hetcomm: multiSet of ", keys.size(), " keys and ", values.size(),
                    " values");
  for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
}

void SealedStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  if (!key_) return inner_->append(key, value);
  C10_THROW_ERROR(NotImplementedError, "hetcomm: append on a store whose values are sealed (HETCOMM_SECRET)");
}

namespace {

// PrefixStore keeps its prefix protected: a pointer to that member, formed in a class derived from
// it (its type is PrefixStore's member's), reads it on any PrefixStore.
struct PrefixOf : c10d::PrefixStore {
  static std::string c10d::PrefixStore::*member() { return &PrefixOf::prefix_; }
};

}  // namespace

std::string storeScope(c10d::Store& store) {
  std::string scope;
  c10d::Store* s = &store;
  for (int depth = 0; depth < 64; ++depth) {
    auto* p = dynamic_cast<c10d::PrefixStore*>(s);
    if (p == nullptr) break;
    scope = (p->*PrefixOf::member()) + "/" + scope;  // PrefixStore's joinKey: prefix + "/" + key
    s = p->getUnderlyingStore().get();
  }
  return scope;
}

GroupKeys agreeGroupKeys(c10d::Store& store, int rank, int size, std::vector<int64_t> jobRanks,
                         std::chrono::milliseconds timeout, const std::vector<std::string>& staleKeys,
                         StoreRecords& kept) {
  if (jobRanks.empty()) {
    for (int r = 0; r < size; ++r) jobRanks.push_back(r);
  }
  if (static_cast<int>(jobRanks.size()) != size) {
    throw CommError(strCat("rank ", rank, ": ", jobRanks.size(), " job ranks for a group of ", size));
  }
  const std::optional<Sha256Digest> master = outOfBandSecretFromEnv();
  if (!master) return keysThroughTheStore(store, rank, timeout, staleKeys);
  const Deadline deadline = Clock::now() + timeout;
  const Nonce own = freshNonce();
  // The group's place in the store is part of what the record proves: a store writer who swaps
  // nonces and records between two groups of the same ranks (two prefixes) cannot move a rank
  // from one into the other.
  // HETCOMM_JOB_ID, where set, too: two jobs with one secret (and the same prefixes, as torch gives
  // every job) are then told apart.
  const std::string scope = withJobId(storeScope(store));
  if (rank == 0) {
    for (const std::string& key : staleKeys) store.deleteKey(key);
    store.deleteKey(kSecretKey);
    store.deleteKey(kRecordKey);
    // An earlier creation's nonces must not be taken for this one's: the ranks of this one put
    // theirs back at once (they keep them there until they have the record).
    for (int r = 1; r < size; ++r) store.deleteKey(nonceKey(r));
    store.set(kSealedMarkKey, std::vector<uint8_t>{1});
    std::vector<Nonce> nonces(size);
    nonces[0] = own;
    std::vector<int> missing;
    for (int r = 1; r < size; ++r) missing.push_back(r);
    while (!missing.empty()) {
      std::vector<std::string> keys;
      for (int r : missing) keys.push_back(nonceKey(r));
      if (!store.check(keys)) {  // one round trip while some have not published theirs
        if (Clock::now() >= deadline) break;
        std::this_thread::sleep_for(kRetry);
        continue;
      }
      std::vector<int> still;
      for (int r : missing) {
        std::optional<std::vector<uint8_t>> got = readNow(store, nonceKey(r));
        if (got && got->size() == kNonceBytes) {
          std::copy(got->begin(), got->end(), nonces[r].begin());
        } else {
          still.push_back(r);  // not there yet (a value of another size is not a nonce: wait on)
        }
      }
      missing.swap(still);
      if (missing.empty() || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(kRetry);
    }
    if (!missing.empty()) {
      throw TimeoutError(strCat("rank 0: ", missing.size(), " rank(s), the first ", missing[0],
                                ", did not publish their nonce within ", timeout.count(),
                                " ms (did they create the process group, with HETCOMM_SECRET set?)"));
    }
    const std::vector<uint8_t> record = groupRecord(*master, scope, jobRanks, nonces);
    kept.emplace_back(kRecordKey, record);
    store.set(kRecordKey, record);
    store.deleteKey(kSealedMarkKey);  // the record says as much from now on
    return *openGroupRecord(*master, scope, jobRanks, 0, own, record);
  }
  const std::vector<uint8_t> mine(own.begin(), own.end());
  store.set(nonceKey(rank), mine);
  bool forged = false, plain = false;
  bool forgedNow = false;  // every record found lately failed its MAC ...
  Deadline forgedSince{};  // ... since then
  while (true) {
    if (std::optional<std::vector<uint8_t>> record = readNow(store, kRecordKey)) {
      if (std::optional<GroupKeys> keys = openGroupRecord(*master, scope, jobRanks, rank, own, *record)) {
        store.deleteKey(nonceKey(rank));  // read: the record carries it
        return *keys;
      }
      if (groupRecordAuthentic(*master, scope, jobRanks, *record)) {
        forgedNow = false;  // genuine, of another creation (an earlier one's, not yet replaced)
      } else if (!forgedNow) {
        sayIgnoredOnce(kRecordKey);
        forged = forgedNow = true;  // a store writer's, or another secret's
        forgedSince = Clock::now();
      } else if (Clock::now() - forgedSince >= kForgedRecordPatience) {
        throw CommError(strCat("rank ", rank, ": the group record in the store has not opened for ",
                               kForgedRecordPatience.count(), " s: HETCOMM_SECRET(_FILE) differs from rank 0's "
                               "(or HETCOMM_JOB_ID, or the ranks run different versions of hetcomm or reach the "
                               "store through different prefixes; or a store writer keeps replacing the record)"));
      }
    } else {
      forgedNow = false;
    }
    plain = plain || readNow(store, kSecretKey).has_value();  // a hint only: a store writer may plant it
    // Where rank 0 looks for it, whatever a store writer did to it meanwhile.
    putBack(store, nonceKey(rank), mine);
    if (Clock::now() >= deadline) {
      throw TimeoutError(strCat(
          "rank ", rank, ": no group record from rank 0 that carries this rank's nonce within ", timeout.count(), " ms",
          forged ? " (the one in the store does not open: HETCOMM_SECRET differs from rank 0's, or it is another "
                   "group's or a store writer's)"
                 : "",
          plain ? "; rank 0 published a secret in the store instead: is HETCOMM_SECRET(_FILE) set on rank 0?" : ""));
    }
    std::this_thread::sleep_for(kRetry);
  }
}

void deleteGroupKeyRecords(c10d::Store& store, const GroupKeys& keys) {
  for (const char* key : {kSecretKey, kRecordKey}) {
    if (readNow(store, key) == keys.published) store.deleteKey(key);
  }
}

}  // namespace hetcomm
