"""Worker: the GPU side. GPU discovery, the resident-model manager and the process lifecycle.

Imports `placement`, never `tasks`.
"""
