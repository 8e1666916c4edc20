#include "algorithms/flow_pipeline.h"

#include <algorithm>
#include <array>

#include "algorithms/pipeline.h"
#include "algorithms/pipeline_io.h"
#include "common/error.h"
#include "kernels/reduce.h"

namespace hetcomm {

uint32_t FlowGraph::add(char* ptr, size_t bytes, bool reduce, std::vector<uint32_t> deps) {
  HC_ENFORCE(items.size() < UINT32_MAX, "too many pipeline items for one collective");
  items.push_back({ptr, bytes, reduce, std::move(deps)});
  return static_cast<uint32_t>(items.size() - 1);
}

Flow& FlowGraph::flow(int peer, bool send) {
  for (Flow& f : flows) {
    if (f.peer == peer && f.send == send) return f;
  }
  flows.push_back({peer, send, {}});
  return flows.back();
}

using namespace pipeline_io;

namespace {

// One flow's progress.
struct FlowState {
  const Flow* flow = nullptr;
  Link* link = nullptr;
  PipelineSpec spec;                         // header fields and the peer, for pipeline_io
  std::array<uint8_t, kHeaderBytes> hdr{};   // outgoing (send) or incoming (receive) header
  CollectiveHeader want;                     // receive: the header expected
  size_t hdrDone = 0;
  size_t next = 0;                           // index into flow->items
  size_t offset = 0;                         // bytes of items[next] moved
  std::vector<char> scratch;                 // receive: where reducing items land first
  bool blocked = false;                      // send: the socket took nothing last time

  bool finished() const { return hdrDone == kHeaderBytes && next == flow->items.size(); }
};

}  // namespace

void runFlows(const CollectiveContext& ctx, const FlowGraph& graph) {
  HC_ENFORCE(ctx.device == nullptr, "runFlows moves host memory only");
  const size_t es = elementSize(graph.dtype);
  std::vector<char> done(graph.items.size(), 0);
  auto ready = [&](uint32_t item) {
    for (uint32_t d : graph.items[item].deps) {
      if (!done[d]) return false;
    }
    return true;
  };

  std::vector<FlowState> states(graph.flows.size());
  for (size_t i = 0; i < graph.flows.size(); ++i) {
    const Flow& f = graph.flows[i];
    FlowState& s = states[i];
    s.flow = &f;
    s.link = &ctx.linkOf(f.peer);
    uint64_t total = 0, scratch = 0;
    for (uint32_t it : f.items) {
      total += graph.items[it].bytes;
      if (graph.items[it].reduce) scratch = std::max<uint64_t>(scratch, graph.items[it].bytes);
    }
    s.spec.dtype = graph.dtype;
    s.spec.op = graph.op;
    s.spec.step = f.step >= 0 ? static_cast<uint32_t>(f.step) : graph.step;
    if (f.send) {
      s.spec.sendPeer = f.peer;
      s.spec.sendBytesField = total;
      s.hdr = outgoingHeader(ctx, s.spec).encode();
    } else {
      s.spec.recvPeer = f.peer;
      s.spec.expectBytesField = total;
      s.want = expectedHeader(ctx, s.spec);
      s.scratch.resize(scratch);
    }
  }

  while (true) {
    bool allDone = true, progressed = false;
    for (FlowState& s : states) {
      if (s.finished()) continue;
      allDone = false;
      const Flow& f = *s.flow;
      if (f.send) {
        s.blocked = false;
        while (!s.finished()) {
          const char* p;
          size_t left;
          if (s.hdrDone < kHeaderBytes) {
            p = reinterpret_cast<const char*>(s.hdr.data()) + s.hdrDone;
            left = kHeaderBytes - s.hdrDone;
          } else {
            const uint32_t it = f.items[s.next];
            if (s.offset == 0 && !ready(it)) break;
            p = graph.items[it].ptr + s.offset;
            left = graph.items[it].bytes - s.offset;
          }
          const size_t n = left == 0 ? 0 : sendSome(ctx, *s.link, f.peer, p, left);
          if (n == 0 && left > 0) {
            s.blocked = true;
            break;
          }
          progressed = true;
          if (s.hdrDone < kHeaderBytes) {
            s.hdrDone += n;
          } else if ((s.offset += n) == graph.items[f.items[s.next]].bytes) {
            done[f.items[s.next]] = 1;
            ++s.next;
            s.offset = 0;
          }
        }
      } else {
        // Receive until the socket is drained or one item completes (then let the others move).
        while (!s.finished()) {
          char* p;
          size_t left;
          if (s.hdrDone < kHeaderBytes) {
            p = reinterpret_cast<char*>(s.hdr.data()) + s.hdrDone;
            left = kHeaderBytes - s.hdrDone;
          } else {
            const uint32_t it = f.items[s.next];
            if (s.offset == 0 && !ready(it)) break;
            const FlowItem& item = graph.items[it];
            p = (item.reduce ? s.scratch.data() : item.ptr) + s.offset;
            left = item.bytes - s.offset;
          }
          const size_t n = left == 0 ? 0 : recvSome(ctx, *s.link, f.peer, p, left);
          if (n == 0 && left > 0) break;
          progressed = true;
          if (s.hdrDone < kHeaderBytes) {
            if ((s.hdrDone += n) == kHeaderBytes) checkHeader(ctx, s.spec, s.hdr.data(), s.want);
            continue;
          }
          const uint32_t it = f.items[s.next];
          const FlowItem& item = graph.items[it];
          if ((s.offset += n) == item.bytes) {
            if (item.reduce) reduceInto(item.ptr, s.scratch.data(), item.bytes / es, graph.dtype, graph.op);
            done[it] = 1;
            ++s.next;
            s.offset = 0;
            break;
          }
        }
      }
    }
    if (allDone) return;
    if (progressed) continue;

    // Wait for a socket that can move something: writable for a blocked send, readable for a
    // receive whose next item may start (waitLinks merges the entries of one link).
    std::vector<LinkWait> waits;
    for (const FlowState& s : states) {
      if (s.finished()) continue;
      const bool headerPending = s.hdrDone < kHeaderBytes;
      if (s.flow->send) {
        if (s.blocked) waits.push_back({s.link, /*send=*/true, /*recv=*/false});
      } else if (headerPending || s.offset > 0 || ready(s.flow->items[s.next])) {
        waits.push_back({s.link, /*send=*/false, /*recv=*/true});
      }
    }
    if (waits.empty()) {
      throw CommError(strCat(ctx.prefix(), ": internal error: a dataflow schedule stalled with nothing in "
                                           "flight (a dependency cycle); please report it"));
    }
    if (!waitReady(ctx, waits.data(), static_cast<int>(waits.size()), -1)) {
      // Name a peer we wait for: the first unfinished receive that may progress, else a send.
      const FlowState* waiting = nullptr;
      for (const FlowState& s : states) {
        if (!s.finished() && (waiting == nullptr || (!s.flow->send && waiting->flow->send))) waiting = &s;
      }
      size_t recvd = 0, toRecv = 0, sent = 0, toSend = 0;
      for (const FlowState& s : states) {
        (s.flow->send ? sent : recvd) += s.next;
        (s.flow->send ? toSend : toRecv) += s.flow->items.size();
      }
      PipelineSpec summary;
      summary.recvPeer = waiting->flow->send ? -1 : waiting->flow->peer;
      summary.sendPeer = waiting->flow->send ? waiting->flow->peer : -1;
      throwTimeout(ctx, summary, waiting->flow->peer, recvd, toRecv, sent, toSend);
    }
  }
}

}  // namespace hetcomm
