// The collectives of ProcessGroupHetcomm: torch's tensor-level API turned into the core's buffer
// algorithms (algorithms/collectives.h).
//
// Each one validates on the caller's thread (failing fast with "hetcomm <op>: ..."), describes
// the operation for the wire header (collective_header.h: dtype, op, bytes and the layout of
// every tensor, always), and queues a body that the group's worker runs in issue order: it lays
// the tensors out as one buffer when the algorithm needs that, runs the algorithm and copies the
// results back. Tensor operations in a body run on the group's stream for CUDA tensors (see
// ProcessGroupHetcomm::runWorker), so the same code serves both devices.
#include <c10/util/Exception.h>

#include "backend/collective_header.h"
#include "backend/process_group_hetcomm.h"
#include "backend/tensor_checks.h"

namespace hetcomm {

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  checkCount(tensors, 1, "allreduce", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "allreduce");
  const DType dt = toDType(t, "allreduce");
  const RedOp op = toRedOp(opts.reduceOp, "allreduce");
  checkReduce(dt, op, "allreduce");
  const RingPlan plan = this->plan().forBytes(t.nbytes());
  CollectiveShape shape{dt, op, t.nbytes()};
  shape.add(t);
  shape.algo = chooseAllreduceAlgo(t.nbytes(), size_);
  if (*shape.algo == AllreduceAlgo::kRing) shape.plan = plan.fingerprint();
  return enqueue(c10d::OpType::ALLREDUCE, "hetcomm:all_reduce", CollectiveKind::kAllreduce, {t}, {t},
                 makeHeader(shape), effectiveTimeout(opts.timeout), [t, dt, op, plan](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(t);
                   hetcomm::allreduce(ctx, static_cast<char*>(c.data_ptr()), c.numel(), dt, op, plan);
                   copyBackIfNeeded(t, c);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                        const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "hetcomm allreduce_coalesced: needs at least one tensor");
  checkDense(tensors[0], "allreduce_coalesced");
  checkSame(tensors, tensors[0].scalar_type(), -1, "allreduce_coalesced", "tensors");
  const DType dt = toDType(tensors[0], "allreduce_coalesced");
  const RedOp op = toRedOp(opts.reduceOp, "allreduce_coalesced");
  checkReduce(dt, op, "allreduce_coalesced");
  size_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.nbytes();
  const RingPlan plan = this->plan().forBytes(bytes);
  CollectiveShape shape{dt, op, bytes};
  shape.add(tensors);
  shape.algo = chooseAllreduceAlgo(bytes, size_);
  if (*shape.algo == AllreduceAlgo::kRing) shape.plan = plan.fingerprint();
  std::vector<at::Tensor> ts = tensors;
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "hetcomm:all_reduce_coalesced", CollectiveKind::kAllreduce, ts,
                 ts, makeHeader(shape), effectiveTimeout(opts.timeout), [ts, dt, op, plan](CollectiveContext& ctx) {
                   at::Tensor flat = flattenAll(ts);
                   hetcomm::allreduce(ctx, static_cast<char*>(flat.data_ptr()), flat.numel(), dt, op, plan);
                   int64_t off = 0;
                   for (const at::Tensor& t : ts) {
                     const_cast<at::Tensor&>(t).copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
                     off += t.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  checkCount(tensors, 1, "reduce", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "reduce");
  checkRoot(opts.rootRank, size_, "reduce");
  const int root = static_cast<int>(opts.rootRank);
  const DType dt = toDType(t, "reduce");
  const RedOp op = toRedOp(opts.reduceOp, "reduce");
  checkReduce(dt, op, "reduce");
  const RingPlan plan = this->plan().forBytes(t.nbytes());
  CollectiveShape shape{dt, op, t.nbytes()};
  shape.add(t);
  shape.root = root;
  shape.algo = chooseAllreduceAlgo(t.nbytes(), size_);
  if (*shape.algo == AllreduceAlgo::kRing) shape.plan = plan.fingerprint();
  const int rank = rank_;
  // Reduced as an allreduce on a private copy, so that non-root inputs stay untouched.
  return enqueue(c10d::OpType::REDUCE, "hetcomm:reduce", CollectiveKind::kReduce, {t}, {t}, makeHeader(shape),
                 effectiveTimeout(opts.timeout), [t, dt, op, plan, root, rank](CollectiveContext& ctx) {
                   at::Tensor c = rank == root ? contiguousOf(t) : t.contiguous().clone();
                   hetcomm::allreduce(ctx, static_cast<char*>(c.data_ptr()), c.numel(), dt, op, plan);
                   if (rank == root) copyBackIfNeeded(t, c);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  checkCount(tensors, 1, "broadcast", "input");
  at::Tensor t = tensors[0];
  checkDense(t, "broadcast");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "hetcomm broadcast: rootTensor must be 0");
  checkRoot(opts.rootRank, size_, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  CollectiveShape shape{toDType(t, "broadcast"), std::nullopt, t.nbytes()};
  shape.add(t);
  shape.root = root;
  return enqueue(c10d::OpType::BROADCAST, "hetcomm:broadcast", CollectiveKind::kBroadcast, {t}, {t},
                 makeHeader(shape), effectiveTimeout(opts.timeout), [t, root](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(t);
                   hetcomm::broadcast(ctx, static_cast<char*>(c.data_ptr()), c.nbytes(), root);
                   copyBackIfNeeded(t, c);
                 });
}

namespace {

// Gathers every rank's bytes into `flat` (rank r's block at the prefix offset of blockBytes), this
// rank's block from `mine` (tensors laid back to back), with the ring all-gather.
void allgatherBlocks(CollectiveContext& ctx, at::Tensor& flat, const std::vector<size_t>& blockBytes,
                  const std::vector<at::Tensor>& mine, const RingPlan& plan) {
  size_t off = 0;
  for (int r = 0; r < ctx.rank; ++r) off += blockBytes[r];
  for (const at::Tensor& t : mine) {
    at::Tensor c = contiguousOf(t);
    if (c.nbytes() > 0) flat.narrow(0, off, c.nbytes()).copy_(asBytes(c));
    off += c.nbytes();
  }
  hetcomm::allgatherv(ctx, static_cast<char*>(flat.data_ptr()), blockBytes, plan);
}

// Copies consecutive pieces of the byte tensor `flat` (from byte `off` on) into `outs`, each piece
// viewed as its output's dtype and shape.
size_t unflattenInto(const at::Tensor& flat, size_t off, const std::vector<at::Tensor>& outs) {
  for (const at::Tensor& o : outs) {
    const int64_t nb = static_cast<int64_t>(o.nbytes());
    if (nb > 0) {
      at::Tensor piece = flat.narrow(0, static_cast<int64_t>(off), nb).view(o.scalar_type());
      const_cast<at::Tensor&>(o).copy_(piece.view(o.sizes()));
    }
    off += static_cast<size_t>(nb);
  }
  return off;
}

at::TensorOptions byteOptions(const std::vector<at::Tensor>& like) {
  return (like.empty() ? at::TensorOptions() : like[0].options()).dtype(at::kByte);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  checkCount(inputs, 1, "allgather", "input");
  TORCH_CHECK_VALUE(outputs.size() == 1, "hetcomm allgather: expects one output list per process, got ",
                    outputs.size());
  at::Tensor in = inputs[0];
  checkDense(in, "allgather");
  std::vector<at::Tensor> outs = outputs[0];
  checkCount(outs, static_cast<size_t>(size_), "allgather", "output");
  checkSame(outs, in.scalar_type(), -1, "allgather", "output");
  TORCH_CHECK_VALUE(outs[rank_].numel() == in.numel(), "hetcomm allgather: output[", rank_, "] has ",
                    outs[rank_].numel(), " elements but this rank's input has ", in.numel());
  std::vector<size_t> blockBytes;
  size_t total = 0;
  for (const at::Tensor& o : outs) {
    blockBytes.push_back(o.nbytes());
    total += o.nbytes();
  }
  const RingPlan plan = this->plan();
  CollectiveShape shape{toDType(in, "allgather"), std::nullopt, total};
  shape.add(outs);
  shape.plan = plan.fingerprint();
  return enqueue(c10d::OpType::ALLGATHER, "hetcomm:all_gather", CollectiveKind::kAllgather, {in}, outs,
                 makeHeader(shape), effectiveTimeout(opts.timeout), [in, outs, blockBytes, total, plan](CollectiveContext& ctx) {
                   at::Tensor flat = at::empty({static_cast<int64_t>(total)}, in.options().dtype(at::kByte));
                   allgatherBlocks(ctx, flat, blockBytes, {in}, plan);
                   unflattenInto(flat, 0, outs);
                 });
}

// output_lists[r][k] receives rank r's k-th input; every rank's tensors are gathered as one block.
c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(!inputs.empty(), "hetcomm allgather_coalesced: needs at least one input tensor");
  TORCH_CHECK_VALUE(outputLists.size() == static_cast<size_t>(size_), "hetcomm allgather_coalesced: needs one output "
                    "list per rank (", size_, "), got ", outputLists.size());
  for (const at::Tensor& t : inputs) checkDense(t, "allgather_coalesced");
  std::vector<at::Tensor> outs;  // rank-major: rank 0's tensors, then rank 1's, ...
  std::vector<size_t> blockBytes;
  size_t total = 0;
  for (int r = 0; r < size_; ++r) {
    const std::vector<at::Tensor>& list = outputLists[r];
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "hetcomm allgather_coalesced: output list ", r, " has ",
                      list.size(), " tensors for ", inputs.size(), " inputs");
    size_t block = 0;
    for (size_t k = 0; k < list.size(); ++k) {
      checkDense(list[k], "allgather_coalesced");
      TORCH_CHECK_TYPE(list[k].scalar_type() == inputs[k].scalar_type(), "hetcomm allgather_coalesced: output [",
                       r, "][", k, "] has dtype ", list[k].scalar_type(), " but input ", k, " has ",
                       inputs[k].scalar_type());
      TORCH_CHECK_VALUE(r != rank_ || list[k].numel() == inputs[k].numel(), "hetcomm allgather_coalesced: output [",
                        r, "][", k, "] has ", list[k].numel(), " elements but input ", k, " has ", inputs[k].numel());
      block += list[k].nbytes();
      outs.push_back(list[k]);
    }
    blockBytes.push_back(block);
    total += block;
  }
  const RingPlan plan = this->plan();
  CollectiveShape shape{toDType(inputs[0], "allgather_coalesced"), std::nullopt, total};
  shape.add(outs);
  shape.plan = plan.fingerprint();
  std::vector<at::Tensor> ins = inputs;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "hetcomm:all_gather_coalesced", CollectiveKind::kAllgather, ins,
                 outs, makeHeader(shape), effectiveTimeout(opts.timeout),
                 [ins, outs, blockBytes, total, plan](CollectiveContext& ctx) {
                   at::Tensor flat = at::empty({static_cast<int64_t>(total)}, byteOptions(ins));
                   allgatherBlocks(ctx, flat, blockBytes, ins, plan);
                   unflattenInto(flat, 0, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::AllgatherOptions& opts) {
  checkDense(input, "allgather_into_tensor");
  checkDense(output, "allgather_into_tensor");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm allgather_into_tensor: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "hetcomm allgather_into_tensor: output has ",
                    output.numel(), " elements, expected input numel x world size = ", input.numel() * size_);
  const RingPlan plan = this->plan();
  CollectiveShape shape{toDType(input, "allgather_into_tensor"), std::nullopt, output.nbytes()};
  shape.add(input).add(output);
  shape.plan = plan.fingerprint();
  at::Tensor in = input, out = output;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "hetcomm:all_gather_into_tensor", CollectiveKind::kAllgather, {in},
                 {out}, makeHeader(shape), effectiveTimeout(opts.timeout), [in, out, plan, rank, size](CollectiveContext& ctx) {
                   at::Tensor o = contiguousOf(out);
                   at::Tensor i = contiguousOf(in);
                   const size_t block = i.nbytes();
                   char* base = static_cast<char*>(o.data_ptr());
                   // FSDP passes an input that is a view of its own slot of the output: nothing to copy.
                   if (block > 0 && base + rank * block != i.data_ptr()) {
                     asBytes(o).narrow(0, rank * block, block).copy_(asBytes(i));
                   }
                   hetcomm::allgatherv(ctx, base, std::vector<size_t>(size, block), plan);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(), "hetcomm allgather_into_tensor_coalesced: ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs (needs as many, and at least one)");
  // Gathered as one flat allgather: block r is every input's rank-r share, back to back.
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkDense(inputs[k], "allgather_into_tensor_coalesced");
    checkDense(outputs[k], "allgather_into_tensor_coalesced");
    TORCH_CHECK_VALUE(outputs[k].numel() == inputs[k].numel() * size_ &&
                          outputs[k].scalar_type() == inputs[k].scalar_type(),
                      "hetcomm allgather_into_tensor_coalesced: output ", k, " must hold world size x input ", k);
  }
  const RingPlan plan = this->plan();
  size_t block = 0;
  for (const at::Tensor& t : inputs) block += t.nbytes();
  CollectiveShape shape{toDType(inputs[0], "allgather_into_tensor_coalesced"), std::nullopt, block * size_};
  shape.add(inputs);
  shape.plan = plan.fingerprint();
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  const int size = size_;
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "hetcomm:all_gather_into_tensor_coalesced",
                 CollectiveKind::kAllgather, ins, outs, makeHeader(shape), effectiveTimeout(opts.timeout),
                 [ins, outs, block, plan, size](CollectiveContext& ctx) {
                   at::Tensor flat = at::empty({static_cast<int64_t>(block * size)}, byteOptions(outs));
                   allgatherBlocks(ctx, flat, std::vector<size_t>(size, block), ins, plan);
                   // Block r holds every input's rank-r share: output k takes its piece of each block.
                   const at::Tensor blocks = flat.view({size, static_cast<int64_t>(block)});
                   int64_t inner = 0;
                   for (size_t k = 0; k < ins.size(); ++k) {
                     const int64_t nb = static_cast<int64_t>(ins[k].nbytes());
                     at::Tensor o = contiguousOf(outs[k]);
                     if (nb > 0) asBytes(o).view({size, nb}).copy_(blocks.narrow(1, inner, nb));
                     copyBackIfNeeded(outs[k], o);
                     inner += nb;
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::GatherOptions& opts) {
  checkCount(inputs, 1, "gather", "input");
  at::Tensor in = inputs[0];
  checkDense(in, "gather");
  checkRoot(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> outs = rootOnlyList(outputs, rank_ == root, size_, in, "gather", "output");
  CollectiveShape shape{toDType(in, "gather"), std::nullopt, in.nbytes()};
  shape.add(in);
  shape.root = root;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::GATHER, "hetcomm:gather", CollectiveKind::kGather, {in}, outs, makeHeader(shape),
                 effectiveTimeout(opts.timeout), [in, outs, root, rank, size](CollectiveContext& ctx) {
                   at::Tensor c = contiguousOf(in);
                   const size_t block = c.nbytes();
                   if (rank != root) {
                     hetcomm::gather(ctx, static_cast<const char*>(c.data_ptr()), nullptr, block, root);
                     return;
                   }
                   at::Tensor flat = at::empty({static_cast<int64_t>(block * size)}, c.options().dtype(at::kByte));
                   hetcomm::gather(ctx, static_cast<const char*>(c.data_ptr()), static_cast<char*>(flat.data_ptr()),
                                   block, root);
                   unflattenInto(flat, 0, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ScatterOptions& opts) {
  checkCount(outputs, 1, "scatter", "output");
  at::Tensor out = outputs[0];
  checkDense(out, "scatter");
  checkRoot(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> ins = rootOnlyList(inputs, rank_ == root, size_, out, "scatter", "input");
  CollectiveShape shape{toDType(out, "scatter"), std::nullopt, out.nbytes()};
  shape.add(out);
  shape.root = root;
  const int rank = rank_;
  return enqueue(c10d::OpType::SCATTER, "hetcomm:scatter", CollectiveKind::kScatter, ins, {out}, makeHeader(shape),
                 effectiveTimeout(opts.timeout), [ins, out, root, rank](CollectiveContext& ctx) {
                   at::Tensor o = contiguousOf(out);
                   at::Tensor flat = rank == root ? flattenAll(ins) : at::Tensor();
                   hetcomm::scatter(ctx, rank == root ? static_cast<const char*>(flat.data_ptr()) : nullptr,
                                    static_cast<char*>(o.data_ptr()), o.nbytes(), root);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  checkCount(outputs, 1, "reduce_scatter", "output");
  TORCH_CHECK_VALUE(inputs.size() == 1, "hetcomm reduce_scatter: expects one input list per process");
  at::Tensor out = outputs[0];
  checkDense(out, "reduce_scatter");
  std::vector<at::Tensor> ins = inputs[0];
  checkCount(ins, static_cast<size_t>(size_), "reduce_scatter", "input");
  checkSame(ins, out.scalar_type(), -1, "reduce_scatter", "input");
  TORCH_CHECK_VALUE(ins[rank_].numel() == out.numel(), "hetcomm reduce_scatter: input[", rank_, "] has ",
                    ins[rank_].numel(), " elements but the output has ", out.numel());
  const DType dt = toDType(out, "reduce_scatter");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter");
  checkReduce(dt, op, "reduce_scatter");
  std::vector<size_t> counts;
  size_t bytes = 0;
  for (const at::Tensor& t : ins) {
    counts.push_back(t.numel());
    bytes += t.nbytes();
  }
  const RingPlan plan = this->plan();
  CollectiveShape shape{dt, op, bytes};
  shape.add(ins);
  shape.plan = plan.fingerprint();
  const int rank = rank_;
  return enqueue(c10d::OpType::REDUCE_SCATTER, "hetcomm:reduce_scatter", CollectiveKind::kReduceScatter, ins, {out},
                 makeHeader(shape), effectiveTimeout(opts.timeout), [ins, out, counts, dt, op, plan, rank](CollectiveContext& ctx) {
                   at::Tensor work = flattenAll(ins);
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), counts, dt, op, plan);
                   int64_t off = 0;
                   for (int r = 0; r < rank; ++r) off += counts[r];
                   const_cast<at::Tensor&>(out).copy_(work.narrow(0, off, counts[rank]).view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  checkDense(input, "reduce_scatter_tensor");
  checkDense(output, "reduce_scatter_tensor");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm reduce_scatter_tensor: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "hetcomm reduce_scatter_tensor: input has ",
                    input.numel(), " elements, expected output numel x world size = ", output.numel() * size_);
  const DType dt = toDType(input, "reduce_scatter_tensor");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter_tensor");
  checkReduce(dt, op, "reduce_scatter_tensor");
  const RingPlan plan = this->plan();
  CollectiveShape shape{dt, op, input.nbytes()};
  shape.add(input).add(output);
  shape.plan = plan.fingerprint();
  at::Tensor in = input, out = output;
  const int rank = rank_, size = size_;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "hetcomm:reduce_scatter_tensor", CollectiveKind::kReduceScatter,
                 {in}, {out}, makeHeader(shape), effectiveTimeout(opts.timeout),
                 [in, out, dt, op, plan, rank, size](CollectiveContext& ctx) {
                   at::Tensor work = in.contiguous().clone();  // the input stays untouched
                   const size_t n = static_cast<size_t>(out.numel());
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), std::vector<size_t>(size, n), dt,
                                           op, plan);
                   const_cast<at::Tensor&>(out).copy_(work.reshape({-1}).narrow(0, rank * n, n).view(out.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size() && !inputs.empty(),
                    "hetcomm reduce_scatter_tensor_coalesced: needs as many outputs as inputs, and at least one");
  const DType dt = toDType(inputs[0], "reduce_scatter_tensor_coalesced");
  const RedOp op = toRedOp(opts.reduceOp, "reduce_scatter_tensor_coalesced");
  checkReduce(dt, op, "reduce_scatter_tensor_coalesced");
  size_t block = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkDense(inputs[k], "reduce_scatter_tensor_coalesced");
    checkDense(outputs[k], "reduce_scatter_tensor_coalesced");
    TORCH_CHECK_VALUE(inputs[k].scalar_type() == inputs[0].scalar_type() &&
                          outputs[k].scalar_type() == inputs[0].scalar_type() &&
                          inputs[k].numel() == outputs[k].numel() * size_,
                      "hetcomm reduce_scatter_tensor_coalesced: input ", k,
                      " must hold world size x output ", k, " elements, all of one dtype");
    block += outputs[k].numel();
  }
  const RingPlan plan = this->plan();
  CollectiveShape shape{dt, op, block * size_ * elementSize(dt)};
  shape.add(outputs);
  shape.plan = plan.fingerprint();
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  const int rank = rank_, size = size_;
  // One reduce-scatter over a buffer whose block r is every input's rank-r slice, back to back.
  // OpType::COALESCED: torch 2.11 has no REDUCE_SCATTER_TENSOR_COALESCED (2.13 added it).
  return enqueue(c10d::OpType::COALESCED, "hetcomm:reduce_scatter_tensor_coalesced",
                 CollectiveKind::kReduceScatter, ins, outs, makeHeader(shape), effectiveTimeout(opts.timeout),
                 [ins, outs, block, dt, op, plan, rank, size](CollectiveContext& ctx) {
                   std::vector<at::Tensor> pieces;
                   for (int r = 0; r < size; ++r) {
                     for (size_t k = 0; k < ins.size(); ++k) {
                       const int64_t n = outs[k].numel();
                       pieces.push_back(ins[k].reshape({-1}).narrow(0, r * n, n));
                     }
                   }
                   at::Tensor work = at::cat(pieces);
                   hetcomm::reduceScatterv(ctx, static_cast<char*>(work.data_ptr()), std::vector<size_t>(size, block),
                                           dt, op, plan);
                   int64_t off = static_cast<int64_t>(rank * block);
                   for (const at::Tensor& o : outs) {
                     const_cast<at::Tensor&>(o).copy_(work.narrow(0, off, o.numel()).view(o.sizes()));
                     off += o.numel();
                   }
                 });
}

namespace {

// Byte offsets/sizes of dim-0 splits (empty split list: equal split).
void splitBytes(const at::Tensor& t, const std::vector<int64_t>& splits, int size, const char* which,
                std::vector<size_t>& offsets, std::vector<size_t>& bytes) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t rowBytes = rows == 0 ? 0 : t.nbytes() / rows;
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "hetcomm alltoall: ", which, " dim 0 (", rows,
                      ") is not divisible by the world size ", size, " and no split sizes were given");
    s.assign(size, rows / size);
  }
  TORCH_CHECK_VALUE(static_cast<int>(s.size()) == size, "hetcomm alltoall: ", which, " split sizes have ", s.size(),
                    " entries, expected ", size);
  int64_t sum = 0;
  offsets.clear();
  bytes.clear();
  for (int64_t v : s) {
    TORCH_CHECK_VALUE(v >= 0, "hetcomm alltoall: negative split size");
    offsets.push_back(static_cast<size_t>(sum) * rowBytes);
    bytes.push_back(static_cast<size_t>(v) * rowBytes);
    sum += v;
  }
  TORCH_CHECK_VALUE(sum == rows, "hetcomm alltoall: ", which, " split sizes sum to ", sum, " but dim 0 is ", rows);
}

}  // namespace

// The layout of an all-to-all differs between ranks by nature (each sends its own splits), so
// the header fingerprints none; each message's header carries its own size instead (exchange()).
c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                  std::vector<int64_t>& outputSplitSizes,
                                                                  std::vector<int64_t>& inputSplitSizes,
                                                                  const c10d::AllToAllOptions& opts) {
  checkDense(input, "alltoall");
  checkDense(output, "alltoall");
  TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(), "hetcomm alltoall: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  std::vector<size_t> sendOff, sendBytes, recvOff, recvBytes;
  splitBytes(input, inputSplitSizes, size_, "input", sendOff, sendBytes);
  splitBytes(output, outputSplitSizes, size_, "output", recvOff, recvBytes);
  const CollectiveShape shape{toDType(input, "alltoall")};
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "hetcomm:all_to_all_single", CollectiveKind::kAlltoall, {in}, {out},
                 makeHeader(shape), effectiveTimeout(opts.timeout),
                 [in, out, sendOff, sendBytes, recvOff, recvBytes](CollectiveContext& ctx) {
                   at::Tensor i = contiguousOf(in);
                   at::Tensor o = contiguousOf(out);
                   hetcomm::alltoallv(ctx, static_cast<const char*>(i.data_ptr()), sendOff, sendBytes,
                                      static_cast<char*>(o.data_ptr()), recvOff, recvBytes);
                   copyBackIfNeeded(out, o);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  checkCount(inputs, static_cast<size_t>(size_), "alltoall", "input");
  checkCount(outputs, static_cast<size_t>(size_), "alltoall", "output");
  checkDense(inputs[0], "alltoall");
  checkSame(inputs, inputs[0].scalar_type(), -1, "alltoall", "input");
  checkSame(outputs, inputs[0].scalar_type(), -1, "alltoall", "output");
  std::vector<size_t> sendOff, sendBytes, recvOff, recvBytes;
  size_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    sendOff.push_back(so);
    sendBytes.push_back(inputs[r].nbytes());
    so += inputs[r].nbytes();
    recvOff.push_back(ro);
    recvBytes.push_back(outputs[r].nbytes());
    ro += outputs[r].nbytes();
  }
  const CollectiveShape shape{toDType(inputs[0], "alltoall")};
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return enqueue(c10d::OpType::ALLTOALL, "hetcomm:all_to_all", CollectiveKind::kAlltoall, ins, outs,
                 makeHeader(shape), effectiveTimeout(opts.timeout),
                 [ins, outs, sendOff, sendBytes, recvOff, recvBytes, ro](CollectiveContext& ctx) {
                   at::Tensor in = flattenAll(ins);
                   at::Tensor flat = at::empty({static_cast<int64_t>(ro)}, in.options().dtype(at::kByte));
                   hetcomm::alltoallv(ctx, static_cast<const char*>(in.data_ptr()), sendOff, sendBytes,
                                      static_cast<char*>(flat.data_ptr()), recvOff, recvBytes);
                   unflattenInto(flat, 0, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHetcomm::barrier(const c10d::BarrierOptions& opts) {
  CollectiveShape shape;
  shape.bytes = 1;
  return enqueue(c10d::OpType::BARRIER, "hetcomm:barrier", CollectiveKind::kBarrier, {}, {}, makeHeader(shape),
                 effectiveTimeout(opts.timeout), [](CollectiveContext& ctx) { hetcomm::barrier(ctx); });
}

}  // namespace hetcomm
