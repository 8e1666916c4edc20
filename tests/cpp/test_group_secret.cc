// The out-of-band secret, the group record and the sealing of store values
// (transport/group_secret.h). The expected digests were computed apart from this code, with
// Python's hashlib and hmac, from the formats the header documents; PBKDF2 against RFC 7914's
// test vectors.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "check.h"
#include "common/error.h"
#include "transport/group_secret.h"

using namespace hetcomm;

namespace {

std::string hex(const uint8_t* p, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += kDigits[p[i] >> 4];
    out += kDigits[p[i] & 15];
  }
  return out;
}

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

Nonce counting(uint8_t from) {
  Nonce n{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(from + i);
  return n;
}

// A file with these contents and mode, removed at the end of the scope.
struct TempFile {
  std::string path;
  TempFile(const std::string& contents, mode_t mode) {
    char name[] = "/tmp/hetcomm-secret-XXXXXX";
    const int fd = ::mkstemp(name);
    path = name;
    if (fd >= 0) {
      (void)!::write(fd, contents.data(), contents.size());
      ::fchmod(fd, mode);
      ::close(fd);
    }
  }
  ~TempFile() { ::unlink(path.c_str()); }
};

const std::string kSecret = "correct horse battery staple";
const std::vector<int64_t> kJobRanks = {0, 1};
const std::string kScope = "job/0//";  // the group's keys under PrefixStore("0/") over PrefixStore("job")

Sha256Digest master() { return *outOfBandSecret("", kSecret); }
std::vector<uint8_t> twoRankRecord() { return groupRecord(master(), kScope, kJobRanks, {counting(0), counting(16)}); }

}  // namespace

TEST_CASE(pbkdf2_matches_rfc_7914) {
  const Sha256Digest one = pbkdf2Sha256("password", 8, "salt", 4, 1);
  CHECK_EQ(hex(one.data(), one.size()), std::string("120fb6cffcf8b32c43e7225256c4f837a86548c92ccc35480805987cb70be17b"));
  const Sha256Digest many = pbkdf2Sha256("password", 8, "salt", 4, 4096);
  CHECK_EQ(hex(many.data(), many.size()), std::string("c5e478d59288c841aa530db6845c4c8d962893a001ce4e11a4963873aa98134a"));
}

TEST_CASE(the_keys_match_an_independent_implementation) {
  const Sha256Digest m = master();
  CHECK_EQ(hex(m.data(), m.size()), std::string("f31d10f303336ab196bc64257cf1cfec95925f319d0125a5c0afa60586c703e6"));
  const std::vector<uint8_t> record = twoRankRecord();
  REQUIRE(record.size() == 2 * kNonceBytes + kMacBytes);
  CHECK_EQ(hex(record.data() + 2 * kNonceBytes, kMacBytes),
           std::string("62b0ad9e21772ab40d933ab7a8993659b2c4d9d87733d2065bba13b618cb5ac5"));
  const std::optional<GroupKeys> keys = openGroupRecord(m, kScope, kJobRanks, 1, counting(16), record);
  REQUIRE(keys.has_value() && keys->seal.has_value());
  CHECK_EQ(keys->incarnation, std::string("3018fec6db480930"));
  const std::vector<uint8_t> sealed = sealValue(*keys->seal, "hetcomm/addr/1", bytes("10.0.0.2:4242"));
  REQUIRE(sealed.size() == 13 + kMacBytes);
  CHECK_EQ(hex(sealed.data() + 13, kMacBytes), std::string("0b011d8b1e18faca68dbe7b13f3a71fffb18e1c33f87d13d499af98c98799700"));
}

TEST_CASE(every_rank_takes_the_same_keys_from_the_record) {
  const std::vector<uint8_t> record = twoRankRecord();
  const auto a = openGroupRecord(master(), kScope, kJobRanks, 0, counting(0), record);
  const auto b = openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), record);
  REQUIRE(a && b);
  CHECK(a->mesh == b->mesh);
  CHECK(*a->seal == *b->seal);
  CHECK_EQ(a->incarnation, b->incarnation);
}

TEST_CASE(a_record_of_another_group_or_creation_or_secret_is_refused) {
  const std::vector<uint8_t> record = twoRankRecord();
  // Not this rank's fresh nonce (an earlier creation under the same prefix, or a replay).
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, 1, counting(17), record));
  // Another group: other job ranks, another size, or the same ranks under another prefix (a store
  // writer who gave this rank's nonce to that group's rank 0 and moved its record here).
  CHECK(!openGroupRecord(master(), "job/1//", kJobRanks, 1, counting(16), record));
  CHECK(!openGroupRecord(master(), "", kJobRanks, 1, counting(16), record));
  CHECK(!groupRecordAuthentic(master(), "other/0//", kJobRanks, record));
  CHECK(!openGroupRecord(master(), kScope, {0, 2}, 1, counting(16), record));
  CHECK(!openGroupRecord(master(), kScope, {0, 1, 2}, 1, counting(16), record));
  // Another secret, a flipped bit anywhere, cut short, extended, a rank out of range.
  CHECK(!openGroupRecord(*outOfBandSecret("", kSecret + "!"), kScope, kJobRanks, 1, counting(16), record));
  int opened = 0;
  for (size_t i = 0; i < record.size(); ++i) {
    std::vector<uint8_t> bad = record;
    bad[i] ^= 0x10;
    opened += openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), bad).has_value();
  }
  CHECK_EQ(opened, 0);
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), std::vector<uint8_t>(record.begin(), record.end() - 1)));
  std::vector<uint8_t> longer = record;
  longer.push_back(0);
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), longer));
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, 2, counting(16), record));
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, -1, counting(16), record));
  CHECK(!openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), {}));
  // A second creation of the same group: new nonces, new keys.
  const auto first = openGroupRecord(master(), kScope, kJobRanks, 1, counting(16), record);
  const auto second = openGroupRecord(master(), kScope, kJobRanks, 1, counting(16),
                                      groupRecord(master(), kScope, kJobRanks, {counting(100), counting(16)}));
  REQUIRE(first && second);
  CHECK(first->mesh != second->mesh);
  CHECK(first->incarnation != second->incarnation);
}

TEST_CASE(a_sealed_value_opens_only_unchanged_under_its_own_key) {
  const Sha256Digest seal = *openGroupRecord(master(), kScope, kJobRanks, 0, counting(0), twoRankRecord())->seal;
  const std::vector<uint8_t> value = bytes("10.0.0.2:4242");
  const std::vector<uint8_t> sealed = sealValue(seal, "hetcomm/addr/1", value);
  CHECK(openValue(seal, "hetcomm/addr/1", sealed) == value);
  CHECK(openValue(seal, "hetcomm/addr/1", sealValue(seal, "hetcomm/addr/1", {})) == std::vector<uint8_t>{});
  int opened = 0;
  for (size_t i = 0; i < sealed.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> bad = sealed;
      bad[i] ^= static_cast<uint8_t>(1 << bit);
      opened += openValue(seal, "hetcomm/addr/1", bad).has_value();
    }
  }
  CHECK_EQ(opened, 0);
  CHECK(!openValue(seal, "hetcomm/addr/0", sealed));  // moved to another key
  CHECK(!openValue(seal, "hetcomm/addr/1", std::vector<uint8_t>(sealed.begin(), sealed.end() - 1)));
  CHECK(!openValue(seal, "hetcomm/addr/1", value));
  CHECK(!openValue(seal, "hetcomm/addr/1", {}));
}

TEST_CASE(the_store_secret_keeps_its_old_meaning) {
  std::array<uint8_t, kSecretBytes> secret{};
  secret[0] = 7;
  const GroupKeys plain = keysFromStoreSecret(secret);
  CHECK(plain.mesh == secret);
  CHECK(!plain.seal.has_value());
  CHECK_EQ(plain.incarnation.size(), size_t{16});
}

TEST_CASE(the_secret_comes_from_one_variable_of_sufficient_length) {
  CHECK(!outOfBandSecret("", "").has_value());
  CHECK_THROWS_AS(outOfBandSecret("", "too short"), CommError);
  CHECK_THROWS_AS(outOfBandSecret("", std::string(kMinOutOfBandSecretBytes - 1, 'x')), CommError);
  CHECK_NOTHROW(outOfBandSecret("", std::string(kMinOutOfBandSecretBytes, 'x')));
  TempFile file(kSecret + "\n", 0600);
  CHECK_THROWS_AS(outOfBandSecret(file.path, kSecret), CommError);
  // `echo secret > file` on one rank, HETCOMM_SECRET=secret on another: the same key.
  CHECK(outOfBandSecret(file.path, "") == outOfBandSecret("", kSecret));
  CHECK(outOfBandSecret("", kSecret + "\r\n") == outOfBandSecret("", kSecret));
  TempFile readable(kSecret, 0644);  // used, with a warning
  CHECK(outOfBandSecret(readable.path, "") == outOfBandSecret("", kSecret));
  TempFile writable(kSecret, 0666);  // others could replace it: refused
  CHECK_THROWS_AS(outOfBandSecret(writable.path, ""), CommError);
  TempFile shortFile("short\n", 0600);
  CHECK_THROWS_AS(outOfBandSecret(shortFile.path, ""), CommError);
  CHECK_THROWS_AS(outOfBandSecret("/nonexistent/hetcomm-secret", ""), CommError);
  CHECK_THROWS_AS(outOfBandSecret("/tmp", ""), CommError);
  TempFile huge(std::string(kMaxOutOfBandSecretBytes + 1, 'x'), 0600);
  CHECK_THROWS_AS(outOfBandSecret(huge.path, ""), CommError);
}

TEST_CASE(fresh_nonces_differ) {
  CHECK(freshNonce() != freshNonce());
}

// HETCOMM_JOB_ID goes before the scope, with a zero byte between, without the white space around
// it (as Python's str.strip() compares it in the elastic runs' agreed settings); unset or blank,
// the scope alone.
TEST_CASE(the_job_id_goes_before_the_scope) {
  ::setenv("HETCOMM_JOB_ID", " \trun-7\n", 1);
  CHECK_EQ(jobIdFromEnv(), std::string("run-7"));
  CHECK(withJobId("job/0//") == std::string("run-7\0job/0//", 13));
  ::setenv("HETCOMM_JOB_ID", "  ", 1);
  CHECK_EQ(withJobId("job/0//"), std::string("job/0//"));
  ::unsetenv("HETCOMM_JOB_ID");
  CHECK_EQ(withJobId("job/0//"), std::string("job/0//"));
}
