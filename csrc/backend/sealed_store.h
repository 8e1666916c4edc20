#pragma once
// A c10d::Store over the group's store that seals what it writes and opens what it reads
// (transport/group_secret.h): with an out-of-band secret, a value that someone without the secret
// wrote, or moved from another key or group, is never handed out. Without a seal key it passes
// everything through (the behaviour of a group whose secret is in the store).
//
// What is sealed: set, compareSet, multiSet; opened: get, multiGet. A value that fails to open is
// treated as absent: get waits (up to the store's timeout) for an authentic one and then throws
// naming the key, or 10 s after it first read a value that fails (none authentic since); tryGet
// answers at once. Counters (add), presence (check, wait) and
// deletion pass through: a store writer can change those anyway, and hetcomm decides nothing on
// them alone. hetcomm's own keys, and the rendezvous of the torch groups it makes as a host's inner
// level (Gloo, NCCL), go through it.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <optional>

#include "transport/group_secret.h"

namespace hetcomm {

class SealedStore : public c10d::Store {
 public:
  SealedStore(c10::intrusive_ptr<c10d::Store> inner, std::optional<Sha256Digest> key);

  bool sealing() const { return key_.has_value(); }
  // What set(key, value) writes to the store underneath.
  std::vector<uint8_t> sealed(const std::string& key, const std::vector<uint8_t>& value) const;
  // The key's value now, without waiting: absent, forged (it fails to open; logged once per key),
  // or its value in `value`. A key removed meanwhile reads as absent (a get would wait for it).
  enum class Read { kAbsent, kForged, kValue };
  Read tryGet(const std::string& key, std::vector<uint8_t>& value);

  c10::intrusive_ptr<c10d::Store> clone() override;
  // clone(), as what it is.
  c10::intrusive_ptr<SealedStore> cloneSealed();
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  // A present value that fails to open counts as absent: with `expected` empty, the new value
  // replaces it. Returns the value now there, opened (empty when it does not open).
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  const std::chrono::milliseconds& getTimeout() const noexcept override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override;
  // append cannot keep a seal (the appended value's tag would cover only its part).
  void append(const std::string& key, const std::vector<uint8_t>& value) override;
  bool hasExtendedApi() const override { return false; }

  const c10::intrusive_ptr<c10d::Store>& inner() const { return inner_; }

 private:
  std::optional<std::vector<uint8_t>> open(const std::string& key, const std::vector<uint8_t>& raw);

  c10::intrusive_ptr<c10d::Store> inner_;
  std::optional<Sha256Digest> key_;
};

}  // namespace hetcomm

namespace hetcomm {

// The group's keys, agreed through its store (kept in neither the store nor the logs). Without an
// out-of-band secret rank 0 draws a fresh secret and publishes it. With one (HETCOMM_SECRET_FILE,
// HETCOMM_SECRET), every other rank publishes a fresh nonce, rank 0 waits for them all and
// publishes the group record (transport/group_secret.h), and each rank takes the first record
// that opens for this group and carries its own nonce (a record of another group or an earlier
// creation never does). `jobRanks`: each group rank's rank in the job (empty: the group ranks).
// Rank 0 first removes `staleKeys` (an earlier group's records under the same prefix) and adds
// what it publishes to `kept` (put back should a store writer replace it). Throws CommError: no
// record (or no nonces) within `timeout`, saying what was seen instead.
using StoreRecords = std::vector<std::pair<std::string, std::vector<uint8_t>>>;
// The prefix under which `store`'s keys lie in the store beneath its PrefixStores (their prefixes
// joined as PrefixStore joins them: "job/0//" for PrefixStore("0/") over PrefixStore("job")), ""
// for a store that is no PrefixStore: the scope the group record binds (group_secret.h).
std::string storeScope(c10d::Store& store);

GroupKeys agreeGroupKeys(c10d::Store& store, int rank, int size, std::vector<int64_t> jobRanks,
                         std::chrono::milliseconds timeout, const std::vector<std::string>& staleKeys,
                         StoreRecords& kept);
// Removes what agreeGroupKeys published (by the last rank to leave the group), but only while it
// is still this group's: a group made again under the same prefix may have replaced it already.
void deleteGroupKeyRecords(c10d::Store& store, const GroupKeys& keys);
// A key's raw value now, without waiting (nullopt: absent); a key removed meanwhile reads as absent.
std::optional<std::vector<uint8_t>> readNow(c10d::Store& store, const std::string& key);
// Puts `value` at `key` unless it is there already (one round trip when it is); whether another
// value was there (a missing one is put back silently).
bool putBack(c10d::Store& store, const std::string& key, const std::vector<uint8_t>& value);

}  // namespace hetcomm
