"""Tasks: the Celery app, every gpufleet task, call routing and the `gpufleet` CLI.

Wires `placement` and `worker` together.
"""
