#pragma once
// A point-to-point Link (link.h) between two ranks of one host whose bytes go through a ring in
// shared memory instead of the kernel's loopback TCP.
//
// It upgrades an established, authenticated TCP link of the point-to-point engine, which carries
// one direction of data only (sender -> receiver):
//  * the sender makes a private segment (segment.h) and offers its name on the TCP link
//    (`offerRing`: a ShmOffer frame); the receiver opens it, unlinks the name and answers one
//    byte, yes or no (`acceptRing`, `refuseRing`). On "no", or any failure before the answer,
//    the link stays TCP; the sender unlinks the name either way. A name whose creator was killed
//    before the answer carries that creator's pid and is removed by the next engine of this user
//    on the host (`removeStaleRings`).
//  * then the data goes through the ring (a single-producer single-consumer byte ring). The TCP
//    link stays as the doorbell, and as the sign of a peer that died or closed: a side that finds
//    the ring empty (receiver) or full (sender) raises its "waiting" flag and sleeps on the TCP
//    socket; the other side rings (writes one byte) when it sees the flag after moving bytes.
//    Flags and indices are ordered with sequentially consistent fences (Dekker's pattern), so a
//    wake-up cannot be lost: either the waiter sees the new bytes or the mover sees the flag.
//  * one thread at a time uses each end, as the engine does; every index read from the shared
//    memory is checked (a ring that claims more bytes than it holds fails the link: EPROTO).
//
// Only TCP links are upgraded (a TLS link keeps its encryption); HETCOMM_P2P_SHM_BYTES sets the
// ring's size (0: never upgrade).
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/error.h"
#include "transport/link.h"

namespace hetcomm {

// The first frame on a point-to-point link when the sender offers a ring (the same size as a
// P2PHeader, so that the receiver reads it where it reads a header).
struct ShmOffer {
  static constexpr size_t kBytes = 24;
  static constexpr uint32_t kMagic = 0x5032534d;  // "MS2P"
  static constexpr uint16_t kVersion = 1;
  uint64_t ringBytes = 0;
  uint64_t id = 0;  // the segment's name is ringSegmentName(id): the creator's pid, then 40 random bits
  std::array<uint8_t, kBytes> encode() const;
  // "" or why `bytes` is not an offer this build can take.
  static std::string decode(const uint8_t* bytes, ShmOffer& out);
  static bool looksLikeOffer(const uint8_t* bytes);  // its magic, nothing else checked
};

std::string ringSegmentName(uint64_t id);

// The ring's size from HETCOMM_P2P_SHM_BYTES (default 4 MiB; 0 turns the upgrade off; otherwise
// 64 KiB to 1 GiB, a multiple of 4 KiB). Throws CommError naming the variable otherwise.
size_t ringBytesSetting();
// Unlinks the ring names in /dev/shm of this user whose creating process no longer runs.
void removeStaleRings();

// Sender side: offers a ring of `ringBytes` on `tcp` and waits for the answer until `deadline`.
// Returns the ring link, or `tcp` itself when the peer refused or the segment could not be made
// (logged). Throws (CommError, TimeoutError, CancelledError) only when the TCP link itself failed.
std::unique_ptr<Link> offerRing(std::unique_ptr<Link> tcp, size_t ringBytes, Deadline deadline,
                                const Cancelled& cancelled = {});

// Receiver side, after reading `offer` off `tcp`: opens the ring, unlinks its name and says yes;
// returns the ring link. When the ring cannot be opened, says no and returns `tcp` (logged).
// Throws CommError when the answer cannot be written.
std::unique_ptr<Link> acceptRing(std::unique_ptr<Link> tcp, const ShmOffer& offer);
// Receiver side: says no (this rank takes no rings); the sender unlinks the name.
void refuseRing(Link& tcp);

}  // namespace hetcomm
