"""Text generation: calls that share decode steps, sampling, chats, stop strings and streamed
text, inside the KV-cache budget the ledger reserves.

`params` checks a call (no torch), `chat` renders messages, `sampling` picks tokens per row,
`text` follows a sequence's text, `engine` runs the continuous batch over the paged KV
cache (`kv`; `paging` is the engine's half that drives it), and `serving` feeds it calls
and answers them. Imports `placement` and `worker.payloads` only.
"""
