"""What the fleet measured, kept in Redis as counters any process reads back alike:
`generation` (generating calls' tokens, time to first token, inter-token latency and the
KV cache they hold), `cache` (the model cache's loads, restores, misses, eviction ages,
and each GPU's LRU age) and `histograms` (the bucket counts both keep, and Prometheus's
cumulative form built when read).

Plain counters written beside the ledger, not the ledger's records: one `MULTI` of
`HINCRBY`s per figure, except the eviction ages, which the evicting scripts count.
"""
