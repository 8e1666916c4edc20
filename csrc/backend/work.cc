#include "backend/work.h"

namespace hetcomm {

WorkHetcomm::WorkHetcomm(int rank, c10d::OpType type, const char* profilingTitle, std::vector<at::Tensor> outputs,
                         uint64_t seq, std::shared_ptr<CompletionPool> pool)
    : c10d::Work(rank, type, profilingTitle),
      outputs_(std::move(outputs)),
      seq_(seq),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      pool_(std::move(pool)) {}

void WorkHetcomm::complete(std::exception_ptr error) {
  finish(error);  // wakes wait(); never runs user callbacks
  auto future = future_;
  auto outputs = outputs_;
  pool_->post([future, outputs, error]() {
    if (error) {
      future->setError(error);
    } else {
      future->markCompleted(c10::IValue(outputs));
    }
  });
}

}  // namespace hetcomm
