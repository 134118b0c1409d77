// The caller's side of a kExternal save (chunk_pipeline.h). Per chunk: Acquire a staging slot,
// write the chunk's extent pieces into it (layout() says where), Submit it once the bytes are
// there. Finish() when done or on failure: chunks never submitted make the save fail, and the
// handle completes only after Finish (the destructor calls it).
//
// Threading: thread-safe; mu_ guards job_, submitted_, held_ and count_. Acquire may block (pool
// dry), never under mu_: the writers that free slots never need it.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "format.h"
#include "status.h"

namespace alpsck {

class ChunkPipeline;
struct SaveJob;

class ExternalFill {
 public:
  ExternalFill(ChunkPipeline* pipeline, SaveJob* j);
  ~ExternalFill();
  ExternalFill(const ExternalFill&) = delete;
  ExternalFill& operator=(const ExternalFill&) = delete;

  const ShardLayout& layout() const { return layout_; }
  uint64_t num_chunks() const { return layout_.num_chunks(); }
  // A free slot for chunk i, with the bytes of chunk i that belong to no extent (padding)
  // zeroed; nullptr if the pool is closed, the save already failed or was finished. With
  // block=false, also nullptr at once when no slot is free.
  char* Acquire(uint64_t chunk, bool block);
  // Queues chunk i (its bytes are in slot) for writing. Invalid: a chunk out of range or
  // submitted twice, or a slot this filler does not hold.
  Status Submit(uint64_t chunk, char* slot);
  // Returns a slot acquired but not to be submitted.
  void Release(char* slot);
  // The save fails with this reason (the handle reports it); call Finish afterwards.
  void Fail(const std::string& why);
  // Nothing more will be submitted: the save commits once its chunks are written (or fails if
  // some were never submitted). Slots still held go back to the pool, so call it only when no
  // copy into them can still land. Idempotent.
  void Finish();
  uint64_t submitted() const;

 private:
  ChunkPipeline* const pipeline_;
  const ShardLayout layout_;
  mutable std::mutex mu_;
  SaveJob* job_;  // nullptr once finished
  std::vector<bool> submitted_;
  std::vector<char*> held_;  // acquired, not yet submitted or released
  uint64_t count_ = 0;
};

}  // namespace alpsck
