#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>

#include <memory>

#include "backend/completion_pool.h"

namespace hetcomm {

// A hetcomm operation as seen by torch: wait() (from c10d::Work) blocks until the worker has
// finished it and rethrows its error; getFuture() completes with the output tensors, on a
// completion-pool thread, after wait() would return.
class WorkHetcomm : public c10d::Work {
 public:
  WorkHetcomm(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs, uint64_t seq,
              std::shared_ptr<CompletionPool> pool);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  uint64_t getSequencenumber() const override { return seq_; }

  // Called once, by whoever finished the operation (the worker or the point-to-point engine).
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  const uint64_t seq_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<CompletionPool> pool_;
};

}  // namespace hetcomm
