#include "external_fill.h"

#include <algorithm>
#include <string>
#include <vector>

#include "chunk_pipeline.h"
#include "save_job.h"

namespace alpsck {

ExternalFill::ExternalFill(ChunkPipeline* pipeline, SaveJob* j)
    : pipeline_(pipeline), layout_(j->index.layout), job_(j), submitted_(layout_.num_chunks(), false) {}

ExternalFill::~ExternalFill() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (job_ && count_ < submitted_.size())
      job_->Fail(Status::Error(Code::kAborted, "the snapshot of step " + std::to_string(job_->step) +
                                                   " was abandoned before all its chunks were filled"));
  }
  Finish();
}

char* ExternalFill::Acquire(uint64_t chunk, bool block) {
  if (chunk >= submitted_.size()) return nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_ || job_->failed.load(std::memory_order_acquire)) return nullptr;
  }
  // Not under mu_: blocking here waits for writers, which never need mu_.
  // Only slots of the first mapping: the caller names them by their offset from staging_base()
  // and may have registered just that mapping with CUDA (the pool may have grown since).
  char* slot = block ? pipeline_->pool_.Acquire(true) : pipeline_->pool_.TryAcquire(true);
  if (!slot) return nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_) {
      pipeline_->pool_.Release(slot);
      return nullptr;
    }
    held_.push_back(slot);
  }
  ZeroChunkGaps(layout_, chunk, slot);
  return slot;
}

Status ExternalFill::Submit(uint64_t chunk, char* slot) {
  std::lock_guard<std::mutex> l(mu_);
  if (!job_) return Status::Invalid("the snapshot is already finished");
  if (chunk >= submitted_.size())
    return Status::Invalid("chunk " + std::to_string(chunk) + " out of range (" + std::to_string(submitted_.size()) +
                           " chunks)");
  if (submitted_[chunk]) return Status::Invalid("chunk " + std::to_string(chunk) + " submitted twice");
  auto it = std::find(held_.begin(), held_.end(), slot);
  if (it == held_.end()) return Status::Invalid("submitted memory is not a staging slot this filler holds");
  held_.erase(it);
  submitted_[chunk] = true;
  ++count_;
  pipeline_->Push({job_, chunk, slot});
  return Status::Ok();
}

void ExternalFill::Release(char* slot) {
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = std::find(held_.begin(), held_.end(), slot);
    if (it == held_.end()) return;  // not ours (or already returned): never double-free a slot
    held_.erase(it);
  }
  pipeline_->pool_.Release(slot);
}

void ExternalFill::Fail(const std::string& why) {
  std::lock_guard<std::mutex> l(mu_);
  if (job_) job_->Fail(Status::Error(Code::kAborted, why));
}

void ExternalFill::Finish() {
  SaveJob* j;
  uint64_t missing;
  std::vector<char*> held;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!job_) return;
    j = job_;
    job_ = nullptr;
    held.swap(held_);
    missing = submitted_.size() - count_;
    if (missing && !j->failed.load(std::memory_order_acquire))
      j->Fail(Status::Error(Code::kAborted, std::to_string(missing) + " chunk(s) of step " + std::to_string(j->step) +
                                                " were never filled"));
    j->t_snap = Clock::now();
  }
  for (char* slot : held) pipeline_->pool_.Release(slot);
  pipeline_->ChunkDone(j, missing + 1);  // the unsubmitted chunks and the filler's own count
}

uint64_t ExternalFill::submitted() const {
  std::lock_guard<std::mutex> l(mu_);
  return count_;
}

}  // namespace alpsck
