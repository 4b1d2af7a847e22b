"""The broker side: what every gpufleet worker does with the messages it takes, below Celery.

`transport` (kombu's Redis transport, without its windows for losing a message),
`intake` (what a worker checks in each message before anything can raise outside a
task), `quarantine` (a call that stops its worker twice is put aside), `presence` (which
workers are alive, and what becomes of the calls of those that are not), `claim` (one
fleet per broker database), `results` (the result backend) and `run_log` (each call a
worker ran, recorded outside Redis).

Imports `tasks.config`, `tasks.context`, `placement` and the broker's libraries.
"""
