"""The paged KV cache of a generation engine: blocks and their prefix keys (`blocks`), the
store and the cache a forward pass sees over it (`paged`), a CPU's working copy in buckets
(`ragged`, over `slots`' in-place layers, which the left-padded engine uses alone), and
decode steps in fixed shapes replayed from CUDA graphs (`graphs`). It knows nothing of
sequences or scheduling: the engine (`worker.generation.engine`, `paging`) drives it."""
