"""Warm copies in host memory: the arena they live in (`arena`: pinned ahead of need and
reused), and their publication to the host's other GPU workers, which load from them
instead of the disk (`sharing`)."""
