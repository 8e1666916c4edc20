#pragma once
// The group's keys, and the sealing of the values hetcomm keeps in the (untrusted) c10d store.
//
// Without an out-of-band secret, rank 0 draws the group's secret and publishes it in the store:
// whoever reads the store can then pass the mesh's handshake, and whoever writes it can redirect
// or fail the group (docs/security.md says exactly what). With one (HETCOMM_SECRET_FILE or
// HETCOMM_SECRET, the same on every rank), nothing secret enters the store:
//
//   master  = PBKDF2-HMAC-SHA-256(secret, salt "hetcomm out-of-band secret v1", 100000 iterations)
//   every rank r > 0 publishes a fresh nonce n_r; rank 0 draws n_0 and, once it has every n_r,
//   transcript = u32 len(scope) || scope || u32 size || i64 job rank of each group rank
//                || n_0 || n_1 || ... || n_{size-1}
//   where scope is the prefix under which the group's keys lie in the store (its PrefixStores'
//   prefixes joined as PrefixStore joins them, outermost first: "job/0//" for PrefixStore("0/")
//   over PrefixStore("job"); "" for a store that is no PrefixStore), preceded by HETCOMM_JOB_ID
//   and a zero byte where that is set (torch gives every job the same prefixes: two jobs that
//   share a secret are told apart only by it);
//   record  = n_0 || ... || n_{size-1} || HMAC(master, "hetcomm record v2\0" || transcript)
//   a rank takes a record only if its MAC is right for the group it knows (scope, size, job ranks)
//   and it carries that rank's own fresh nonce: a record of another group (another prefix, even
//   with the same ranks, whose nonces a store writer swapped), or an earlier creation under the
//   same prefix, is refused;
//   mesh    = HMAC(master, "hetcomm mesh v2\0" || transcript)[:16]   (the handshake's secret)
//   seal    = HMAC(master, "hetcomm seal v2\0" || transcript)
//   incarnation = the first 8 bytes of SHA-256(mesh), in 16 lowercase hex digits
//   sealed  = value || HMAC(seal, "hetcomm store v1\0" || u32 len(key) || key || value)
//
// A value written by anyone without the secret, or moved from another key or group, fails to open
// and is ignored. Integers are little-endian. Torch-free (the C++ tests link it); the c10d::Store
// that seals on set and opens on get is backend/sealed_store.h.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "transport/framing.h"
#include "transport/hmac.h"

namespace hetcomm {

using Nonce = std::array<uint8_t, kNonceBytes>;

// The shortest secret accepted, and the longest secret file read.
constexpr size_t kMinOutOfBandSecretBytes = 16;
constexpr size_t kMaxOutOfBandSecretBytes = 64 * 1024;
constexpr uint32_t kSecretIterations = 100000;

// Bytes from the kernel's random source (getrandom(2)); throws CommError if it fails.
void secureRandom(void* out, size_t bytes);
Nonce freshNonce();

// The out-of-band secret's master key (above) from HETCOMM_SECRET_FILE's contents or HETCOMM_SECRET
// (one trailing newline, "\n" or "\r\n", dropped: `echo secret > file`); nullopt when neither is
// set; computed once per process and value. Throws CommError: both set; a secret shorter than
// kMinOutOfBandSecretBytes; a file that cannot be read, is not a regular file, is larger than
// kMaxOutOfBandSecretBytes, may be written by its group or others, or belongs to another user
// (root excepted: mounted secrets). One that others may read is used, with a warning.
std::optional<Sha256Digest> outOfBandSecretFromEnv();

// HETCOMM_JOB_ID without the white space around it ("" when unset): the name of the run that every
// rank of it sets alike, bound into each group's record (above) and into the key of the elastic
// runs' sealed records, so that two runs sharing one secret are told apart.
std::string jobIdFromEnv();
// `scope` preceded by the job id and a zero byte, where one is set (the job id cannot hold one).
std::string withJobId(const std::string& scope);
std::optional<Sha256Digest> outOfBandSecret(const std::string& file, const std::string& value);

// What a group derives from its secret: the mesh handshake's secret, the key that seals store
// values (none without an out-of-band secret) and the group's incarnation (16 hex digits, the tag
// of its store keys, failure records and segment names).
struct GroupKeys {
  std::array<uint8_t, kSecretBytes> mesh{};
  std::optional<Sha256Digest> seal;
  std::string incarnation;
  // What rank 0 published for this group (the secret, or the group record), as it stands in the store.
  std::vector<uint8_t> published;
};

// The keys of a group whose secret travels through the store (the secret itself is `mesh`).
GroupKeys keysFromStoreSecret(const std::array<uint8_t, kSecretBytes>& secret);

// The out-of-band path. `scope`: the group's prefix in the store (above); `jobRanks`: each group
// rank's rank in the job (every rank passes the same).
std::vector<uint8_t> groupRecord(const Sha256Digest& master, const std::string& scope,
                                 const std::vector<int64_t>& jobRanks, const std::vector<Nonce>& nonces);
// Whether a record's MAC is right for this group (its scope, size and job ranks), whoever's nonces
// it has.
bool groupRecordAuthentic(const Sha256Digest& master, const std::string& scope, const std::vector<int64_t>& jobRanks,
                          const std::vector<uint8_t>& record);
// The keys a record gives, if its MAC is right for this group and it carries `own` as `rank`'s
// nonce; nullopt otherwise.
std::optional<GroupKeys> openGroupRecord(const Sha256Digest& master, const std::string& scope,
                                         const std::vector<int64_t>& jobRanks, int rank, const Nonce& own,
                                         const std::vector<uint8_t>& record);

// value || tag; and the value of a sealed record if its tag is right for this key.
std::vector<uint8_t> sealValue(const Sha256Digest& key, const std::string& storeKey, const std::vector<uint8_t>& value);
std::optional<std::vector<uint8_t>> openValue(const Sha256Digest& key, const std::string& storeKey,
                                              const std::vector<uint8_t>& sealed);

}  // namespace hetcomm
