"""The engine room: the loop that negotiates and runs one process's collectives.

`engine` (what the kinds see, and what lasts the engine's life), `scheduler` (who runs the
next cycle: a waiting caller or the engine thread), `cycle` (the one cycle: negotiate, plan,
run), `counters`, `negotiation` (every rank's message to one plan), `exchange` (the messages
on the wire), `carried` (data inside the messages), `batches` (a plan's running order),
`handles` (requests and the callers' handles), `stalls` (who is missing, and for how long).
"""
