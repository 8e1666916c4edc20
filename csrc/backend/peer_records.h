#pragma once
// What ranks learn about each other through the group's store: a peer's record (its address, its
// site) waited for until it opens, and which links HETCOMM_TLS covers (from the declared sites
// where they decide, else from the site labels the ranks publish).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backend/sealed_store.h"
#include "transport/tcp_mesh.h"
#include "transport/tls.h"

namespace hetcomm {

// Where a rank publishes its site label (HETCOMM_TLS=inter-site, before its address).
std::string siteKey(const std::string& incarnation, int rank);
// Where a rank publishes the address its mesh listens on.
std::string addressKey(const std::string& incarnation, int rank);

// A peer's record, polled rather than one long store wait, so that an abort or a shutdown
// interrupts it; a value that fails its seal counts as none yet. Throws TimeoutError at `deadline`
// (saying whether forged values were seen; `hint` says what to check otherwise), CancelledError,
// or StoreUnreachableError (c10's own errors would escape the handlers of the threads that look
// records up).
std::string awaitPeerRecord(SealedStore& store, const std::string& key, int rank, int peer, const char* what,
                            const char* hint, Deadline deadline, const Cancelled& cancelled);

// Which links of the group TLS covers (HETCOMM_TLS): every one, or those between sites. Where
// HETCOMM_SITES and the job ranks (`globalRanks`) decide every rank's site, each rank computes them
// alike and the store plays no part. Otherwise the ends publish their labels (`publish`) and look
// the peer's up (once per peer, polled like an address); with an out-of-band secret the labels are
// sealed, so a store writer cannot swap them to make a link skip TLS.
TcpMesh::LinkPolicy tlsPolicy(const tls::Config& config, const c10::intrusive_ptr<SealedStore>& store,
                             const std::string& incarnation, int rank, int size, const std::vector<int64_t>& globalRanks,
                             const std::function<void(const std::string&, const std::string&)>& publish);

}  // namespace hetcomm
