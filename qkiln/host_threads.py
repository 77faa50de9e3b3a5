"""How long torch's OpenMP workers spin before they sleep; set up once by `import qkiln`.

libgomp (torch's CPU thread pool) lets a worker that finds no work spin GOMP_SPINCOUNT times, then
sleep on a futex; waking it costs the next parallel region or barrier tens of microseconds. A
batch-1 decode step is ~120 short GEMVs with barriers between them in one region (the decode
stack) plus a few parallel ops around Python code, so it pays that often. A spin count of 1M
(about 30 ms of one core spinning after the last region when the process goes idle, measured;
libgomp's default, 300k, spins about 9 ms here, 10M about 290 ms) against the default, SmolLM2
W4A16 batch-1 128/128 runs, median of 6-7 runs a process, processes in turn (libgomp reads the
variable when it loads, so no same-process A/B): 0.41 -> 0.385 s, 0.43 -> 0.38, 0.383 -> 0.373,
0.425 -> 0.39, 0.433 -> 0.405; one `qkiln bench latency` pair of two went the other way (399.5 vs
357.4 tok/s, on a host swinging 250-400). 64-sequence offline runs, whose steps take 40 ms and
more, showed no difference beyond the host's noise. Why the default still costs the batch-1 step
was not pinned down (its ~9 ms outlasts every gap in a step): this setting rests on the measured
effect only.
An explicit GOMP_SPINCOUNT (or OMP_WAIT_POLICY) in the environment is respected. Like
host_memory, it only takes effect when qkiln is imported before torch.
"""

import os


def set_up() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000000")
