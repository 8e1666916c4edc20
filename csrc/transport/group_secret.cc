#include "transport/group_secret.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"

namespace hetcomm {
namespace {

// Labels keep the derived keys apart: a MAC made for one purpose never verifies for another.
constexpr char kSecretSalt[] = "hetcomm out-of-band secret v1";
constexpr char kRecordLabel[] = "hetcomm record v2";
constexpr char kMeshLabel[] = "hetcomm mesh v2";
constexpr char kSealLabel[] = "hetcomm seal v2";
constexpr char kStoreLabel[] = "hetcomm store v1";

std::string withoutTrailingNewline(std::string s) {
  if (!s.empty() && s.back() == '\n') s.pop_back();
  if (!s.empty() && s.back() == '\r') s.pop_back();
  return s;
}

std::string readSecretFile(const std::string& path) {
  // O_NONBLOCK: a FIFO in its place must not block the open (it is then refused as not regular).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw CommError(strCat("HETCOMM_SECRET_FILE=", path, " cannot be read: ", std::strerror(errno)));
  struct stat st {};
  std::string contents;
  std::string error;
  if (::fstat(fd, &st) != 0) {
    error = std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    error = "not a regular file";
  } else if ((st.st_mode & 022) != 0) {
    error = strCat("its group or others may write it (mode 0", std::oct, (st.st_mode & 0777), "): chmod go-w it");
  } else if (st.st_uid != ::geteuid() && st.st_uid != 0) {
    error = strCat("it belongs to user ", st.st_uid, ", not to this process's (", ::geteuid(), ") or root");
  } else if (static_cast<uint64_t>(st.st_size) > kMaxOutOfBandSecretBytes) {
    error = strCat(st.st_size, " bytes (at most ", kMaxOutOfBandSecretBytes, ")");
  } else {
    char buf[4096];
    while (contents.size() <= kMaxOutOfBandSecretBytes) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        error = std::strerror(errno);
        break;
      }
      if (n == 0) break;
      contents.append(buf, static_cast<size_t>(n));
    }
    if (error.empty() && contents.size() > kMaxOutOfBandSecretBytes) error = "it grew past the limit while read";
  }
  ::close(fd);
  if (!error.empty()) throw CommError(strCat("HETCOMM_SECRET_FILE=", path, ": ", error));
  if ((st.st_mode & 044) != 0) {
    static std::once_flag said;
    std::call_once(said, [&] {
      HC_LOG(kWarn, "HETCOMM_SECRET_FILE=", path, " may be read by its group or by others (mode 0", std::oct,
             (st.st_mode & 0777), "): chmod 600 it");
    });
  }
  return contents;
}

Sha256Digest labelled(const Sha256Digest& key, const char* label, size_t labelLen, const std::vector<uint8_t>& data) {
  return hmacSha256(key.data(), key.size(), {{label, labelLen}, {data.data(), data.size()}});
}

std::string hex16(const Sha256Digest& d) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < 8; ++i) {
    out += kDigits[d[i] >> 4];
    out += kDigits[d[i] & 15];
  }
  return out;
}

void putLe(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

std::vector<uint8_t> transcript(const std::string& scope, const std::vector<int64_t>& jobRanks,
                                const std::vector<Nonce>& nonces) {
  std::vector<uint8_t> t;
  t.reserve(8 + scope.size() + 8 * jobRanks.size() + kNonceBytes * nonces.size());
  putLe(t, static_cast<uint32_t>(scope.size()), 4);
  t.insert(t.end(), scope.begin(), scope.end());
  putLe(t, static_cast<uint32_t>(jobRanks.size()), 4);
  for (int64_t g : jobRanks) putLe(t, static_cast<uint64_t>(g), 8);
  for (const Nonce& n : nonces) t.insert(t.end(), n.begin(), n.end());
  return t;
}

Sha256Digest storeTag(const Sha256Digest& key, const std::string& storeKey, const uint8_t* value, size_t len) {
  const uint32_t n = static_cast<uint32_t>(storeKey.size());
  const uint8_t lenBytes[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n >> 16),
                               static_cast<uint8_t>(n >> 24)};
  return hmacSha256(key.data(), key.size(),
                    {{kStoreLabel, sizeof(kStoreLabel)}, {lenBytes, 4}, {storeKey.data(), storeKey.size()}, {value, len}});
}

}  // namespace

void secureRandom(void* out, size_t bytes) {
  auto* p = static_cast<uint8_t*>(out);
  while (bytes > 0) {
    const ssize_t n = ::getrandom(p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CommError(strCat("hetcomm: getrandom failed: ", std::strerror(errno)));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

Nonce freshNonce() {
  Nonce n{};
  secureRandom(n.data(), n.size());
  return n;
}

std::optional<Sha256Digest> outOfBandSecret(const std::string& file, const std::string& value) {
  if (file.empty() && value.empty()) return std::nullopt;
  if (!file.empty() && !value.empty()) {
    throw CommError("both HETCOMM_SECRET_FILE and HETCOMM_SECRET are set: set one");
  }
  const std::string secret = withoutTrailingNewline(file.empty() ? value : readSecretFile(file));
  const char* what = file.empty() ? "HETCOMM_SECRET" : "HETCOMM_SECRET_FILE's secret";
  if (secret.size() < kMinOutOfBandSecretBytes) {
    throw CommError(strCat(what, " has ", secret.size(), " bytes; at least ", kMinOutOfBandSecretBytes,
                           " are needed, random ones (e.g. `openssl rand -hex 32`)"));
  }
  // Derived once per process and secret: the iterations cost a fraction of a second.
  static std::mutex mu;
  static std::map<std::string, Sha256Digest> derived;
  std::lock_guard<std::mutex> lock(mu);
  auto it = derived.find(secret);
  if (it == derived.end()) {
    it = derived.emplace(secret, pbkdf2Sha256(secret.data(), secret.size(), kSecretSalt, sizeof(kSecretSalt) - 1,
                                              kSecretIterations)).first;
  }
  return it->second;
}

std::optional<Sha256Digest> outOfBandSecretFromEnv() {
  // Set but empty (`HETCOMM_SECRET=$(cat /missing)`) is a mistake, not "no secret": the group would
  // otherwise run with its secret in the store while the operator believes it protected.
  for (const char* name : {"HETCOMM_SECRET_FILE", "HETCOMM_SECRET"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v == '\0') throw CommError(strCat(name, " is set but empty: unset it, or give the secret"));
  }
  return outOfBandSecret(envStr("HETCOMM_SECRET_FILE"), envStr("HETCOMM_SECRET"));
}

std::string jobIdFromEnv() {
  const std::string raw = envStr("HETCOMM_JOB_ID");
  const char* space = " \t\n\r\v\f";  // what Python's str.strip() removes of ASCII (hosts.py compares so)
  const size_t first = raw.find_first_not_of(space);
  if (first == std::string::npos) return "";
  return raw.substr(first, raw.find_last_not_of(space) - first + 1);
}

std::string withJobId(const std::string& scope) {
  const std::string job = jobIdFromEnv();
  return job.empty() ? scope : strCat(job, std::string(1, '\0'), scope);
}

GroupKeys keysFromStoreSecret(const std::array<uint8_t, kSecretBytes>& secret) {
  GroupKeys keys;
  keys.mesh = secret;
  keys.published.assign(secret.begin(), secret.end());
  keys.incarnation = hex16(sha256(secret.data(), secret.size()));
  return keys;
}

std::vector<uint8_t> groupRecord(const Sha256Digest& master, const std::string& scope,
                                 const std::vector<int64_t>& jobRanks, const std::vector<Nonce>& nonces) {
  const Sha256Digest tag = labelled(master, kRecordLabel, sizeof(kRecordLabel), transcript(scope, jobRanks, nonces));
  std::vector<uint8_t> out;
  for (const Nonce& n : nonces) out.insert(out.end(), n.begin(), n.end());
  out.insert(out.end(), tag.begin(), tag.end());
  return out;
}

bool groupRecordAuthentic(const Sha256Digest& master, const std::string& scope, const std::vector<int64_t>& jobRanks,
                          const std::vector<uint8_t>& record) {
  const size_t size = jobRanks.size();
  if (size == 0 || record.size() != size * kNonceBytes + kMacBytes) return false;
  std::vector<Nonce> nonces(size);
  for (size_t r = 0; r < size; ++r) std::copy_n(record.begin() + r * kNonceBytes, kNonceBytes, nonces[r].begin());
  const Sha256Digest tag = labelled(master, kRecordLabel, sizeof(kRecordLabel), transcript(scope, jobRanks, nonces));
  return constantTimeEqual(tag.data(), record.data() + size * kNonceBytes, kMacBytes);
}

std::optional<GroupKeys> openGroupRecord(const Sha256Digest& master, const std::string& scope,
                                         const std::vector<int64_t>& jobRanks, int rank, const Nonce& own,
                                         const std::vector<uint8_t>& record) {
  const size_t size = jobRanks.size();
  if (rank < 0 || static_cast<size_t>(rank) >= size || record.size() != size * kNonceBytes + kMacBytes) {
    return std::nullopt;
  }
  std::vector<Nonce> nonces(size);
  for (size_t r = 0; r < size; ++r) std::copy_n(record.begin() + r * kNonceBytes, kNonceBytes, nonces[r].begin());
  const std::vector<uint8_t> t = transcript(scope, jobRanks, nonces);
  const Sha256Digest tag = labelled(master, kRecordLabel, sizeof(kRecordLabel), t);
  if (!constantTimeEqual(tag.data(), record.data() + size * kNonceBytes, kMacBytes)) return std::nullopt;
  if (!constantTimeEqual(nonces[rank].data(), own.data(), kNonceBytes)) return std::nullopt;
  GroupKeys keys;
  const Sha256Digest mesh = labelled(master, kMeshLabel, sizeof(kMeshLabel), t);
  std::copy_n(mesh.begin(), kSecretBytes, keys.mesh.begin());
  keys.seal = labelled(master, kSealLabel, sizeof(kSealLabel), t);
  keys.incarnation = hex16(sha256(keys.mesh.data(), keys.mesh.size()));
  keys.published = record;
  return keys;
}

std::vector<uint8_t> sealValue(const Sha256Digest& key, const std::string& storeKey, const std::vector<uint8_t>& value) {
  const Sha256Digest tag = storeTag(key, storeKey, value.data(), value.size());
  std::vector<uint8_t> out(value);
  out.insert(out.end(), tag.begin(), tag.end());
  return out;
}

std::optional<std::vector<uint8_t>> openValue(const Sha256Digest& key, const std::string& storeKey,
                                              const std::vector<uint8_t>& sealed) {
  if (sealed.size() < kMacBytes) return std::nullopt;
  const size_t len = sealed.size() - kMacBytes;
  const Sha256Digest tag = storeTag(key, storeKey, sealed.data(), len);
  if (!constantTimeEqual(tag.data(), sealed.data() + len, kMacBytes)) return std::nullopt;
  return std::vector<uint8_t>(sealed.begin(), sealed.begin() + static_cast<std::ptrdiff_t>(len));
}

}  // namespace hetcomm
