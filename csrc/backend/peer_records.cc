#include "backend/peer_records.h"

#include <sys/stat.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

#include "common/env.h"
#include "common/error.h"
#include "common/logging.h"

namespace hetcomm {
namespace {


// HETCOMM_SITES's labels, one per job rank (spaces dropped).
std::vector<std::string> siteItems(const std::string& all) {
  std::vector<std::string> items(1);
  for (char c : all) {
    if (c == ',') {
      items.emplace_back();
    } else if (c != ' ') {
      items.back() += c;
    }
  }
  return items;
}

// This process's site for HETCOMM_TLS=inter-site: HETCOMM_SITE, else its entry of HETCOMM_SITES
// (by the job's RANK, as torchrun and the simulator set it), else its host (boot id and network
// namespace): without a declaration of sites, every link that leaves a host is encrypted.
std::string siteLabel(int rank) {
  const std::string own = envStr("HETCOMM_SITE");
  if (!own.empty()) return "site:" + own;
  const std::string all = envStr("HETCOMM_SITES"), job = envStr("RANK");
  if (!all.empty() && !job.empty()) {
    const std::vector<std::string> items = siteItems(all);
    const int64_t r = envInt("RANK", -1);
    if (r >= 0 && r < static_cast<int64_t>(items.size())) return "site:" + items[r];
  }
  std::string boot = "unknown-boot";
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) boot = buf;
    std::fclose(f);
  }
  struct stat st {};
  const unsigned long long netns = ::stat("/proc/self/ns/net", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0;
  static std::once_flag said;
  std::call_once(said, [rank] {
    HC_LOG(kInfo, "rank ", rank, ": HETCOMM_TLS=inter-site without HETCOMM_SITE or HETCOMM_SITES (with RANK): "
           "every link that leaves a host is encrypted");
  });
  return strCat("host:", boot, ":", netns);
}

// Every group rank's site from HETCOMM_SITES (one label per job rank) and the group's job ranks,
// when those decide them: no HETCOMM_SITE of this process's own, and a label for every rank.
std::optional<std::vector<std::string>> declaredSites(const std::vector<int64_t>& globalRanks, int size) {
  const std::string all = envStr("HETCOMM_SITES");
  if (!envStr("HETCOMM_SITE").empty() || all.empty() || static_cast<int>(globalRanks.size()) != size) {
    return std::nullopt;
  }
  const std::vector<std::string> items = siteItems(all);
  std::vector<std::string> sites;
  for (int64_t g : globalRanks) {
    if (g < 0 || g >= static_cast<int64_t>(items.size())) return std::nullopt;
    sites.push_back(items[g]);
  }
  return sites;
}

}  // namespace

std::string siteKey(const std::string& incarnation, int rank) { return strCat("hetcomm/site/", incarnation, "/", rank); }
std::string addressKey(const std::string& incarnation, int rank) { return strCat("hetcomm/addr/", incarnation, "/", rank); }

std::string awaitPeerRecord(SealedStore& store, const std::string& key, int rank, int peer, const char* what,
                            const char* hint, Deadline deadline, const Cancelled& cancelled) {
  bool forged = false;
  try {
    while (true) {
      std::vector<uint8_t> v;
      const SealedStore::Read read = store.tryGet(key, v);
      if (read == SealedStore::Read::kValue) return std::string(v.begin(), v.end());
      forged = forged || read == SealedStore::Read::kForged;
      if (cancelled && cancelled()) {
        throw CancelledError(strCat("hetcomm: rank ", rank, " gave up waiting for rank ", peer, "'s ", what,
                                    ": the process group is shutting down"));
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError(forged ? strCat("hetcomm: rank ", rank, " found no authentic ", what, " of rank ", peer,
                                           " in the store ('", key, "' fails its MAC: HETCOMM_SECRET differs between "
                                           "ranks, or someone without it wrote it)")
                                  : strCat("hetcomm: rank ", rank, " timed out waiting for rank ", peer,
                                           " to publish its ", what, " ", hint));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(kCancelPollMs));
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw StoreUnreachableError(strCat("hetcomm: rank ", rank, " cannot look up rank ", peer, "'s ", what,
                                       ": the store is unreachable: ", e.what()));
  }
}

TcpMesh::LinkPolicy tlsPolicy(const tls::Config& config, const c10::intrusive_ptr<SealedStore>& store,
                             const std::string& incarnation, int rank, int size, const std::vector<int64_t>& globalRanks,
                             const std::function<void(const std::string&, const std::string&)>& publish) {
  if (config.mode == tls::Config::Mode::kAll) return [](int, Deadline, const Cancelled&) { return true; };
  const std::optional<std::vector<std::string>> sites = declaredSites(globalRanks, size);
  const std::string own = sites ? "site:" + (*sites)[rank] : siteLabel(rank);
  publish(siteKey(incarnation, rank), own);  // for a peer whose own settings leave it to the store
  if (sites) {
    return [sites = *sites, rank](int peer, Deadline, const Cancelled&) { return sites[peer] != sites[rank]; };
  }
  struct Cache {
    std::mutex mu;
    std::vector<std::optional<std::string>> sites;
  };
  auto cache = std::make_shared<Cache>();
  cache->sites.resize(size);
  return [store, incarnation, rank, own, cache](int peer, Deadline deadline, const Cancelled& cancelled) {
    {
      std::lock_guard<std::mutex> lock(cache->mu);
      if (cache->sites[peer]) return *cache->sites[peer] != own;
    }
    std::string site = awaitPeerRecord(*store, siteKey(incarnation, peer), rank, peer, "site",
                                       "(HETCOMM_TLS=inter-site: are HETCOMM_TLS, and HETCOMM_SITE or "
                                       "HETCOMM_SITES, set alike on every rank?)",
                                       deadline, cancelled);
    std::lock_guard<std::mutex> lock(cache->mu);
    cache->sites[peer] = std::move(site);
    return *cache->sites[peer] != own;
  };
}

}  // namespace hetcomm
