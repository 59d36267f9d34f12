"""tokenpipe's own bucket boundaries and label values for ``/metrics``
(``tokenizer_proc/request_metrics.py``); a ``--metrics-compat`` family's are in
``tokenizer_proc/peer_buckets.py``."""

# SGLang's bucket boundaries, extended downwards: on a CPU-sized model a token takes
# milliseconds, and SGLang's smallest latency buckets (0.1 s TTFT, 2 ms ITL) would put
# every observation of a small deployment into one bucket.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
    60.0,
    120.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    90.0,
    120.0,
    300.0,
    600.0,
)
QUEUE_BUCKETS = (
    0.0001,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
    120.0,
    300.0,
)
RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50)
TOOL_FINISH_REASONS = ("tool_calls", "stop", "length", "abort")
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536
# A grammar found in the scheduler's cache waits 0 s; xgrammar compiles a small schema or
# regex in milliseconds and a large schema or grammar in up to seconds.
GRAMMAR_WAIT_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
REJECTION_REASONS = ("body_too_large", "queue_full", "read_timeout")
