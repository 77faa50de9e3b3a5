// How a thread walks its tasks: a fixed share [begin, end), or claims on a counter the threads
// share (TaskQueue), one task at a time, so a thread that runs faster takes more of them.
//
// Why claims: the cores of these machines do not run at one speed. On a 2-core cloud VM (the AMX
// Xeon host) two threads running the same AMX loop on their own data finished 0.87-1.93x apart
// over ten runs of ~8 ms (the other tenant of each physical core takes its share when it likes),
// and with a fixed split the faster thread then waits at the next barrier: libgomp's spin was 16%
// of a prefill run's samples.
//
// Each stream also knows the task it runs after the current one (`ahead`): the kernels fetch that
// task's weights or keys while computing this one. With claims, `ahead` is claimed one task early,
// so a thread holds at most one task it has not started.
#pragma once

#include <atomic>
#include <cstdint>

class TaskQueue {
 public:
  explicit TaskQueue(int64_t size) : size_(size) {}
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;
  int64_t claim() {  // the next unclaimed task, or -1 when none is left
    const int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < size_ ? task : -1;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t size_;
};

class TaskStream {
 public:
  TaskStream(int64_t begin, int64_t end)  // the share [begin, end)
      : end_(end), task_(begin < end ? begin : -1), ahead_(begin + 1 < end ? begin + 1 : -1) {}
  explicit TaskStream(TaskQueue& queue) : queue_(&queue), task_(queue.claim()) {
    ahead_ = task_ < 0 ? -1 : queue.claim();
  }
  bool done() const { return task_ < 0; }
  int64_t task() const { return task_; }
  int64_t ahead() const { return ahead_; }  // the task after this one on this thread, or -1
  void advance() {
    task_ = ahead_;
    if (task_ >= 0) ahead_ = queue_ ? queue_->claim() : (task_ + 1 < end_ ? task_ + 1 : -1);
  }

 private:
  TaskQueue* queue_ = nullptr;
  int64_t end_ = 0;
  int64_t task_, ahead_;
};
