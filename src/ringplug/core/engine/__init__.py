"""The engine room: the loop that negotiates and runs one process's collectives.

`engine` (the cycles and who runs them), `negotiation` (every rank's message to one plan),
`exchange` (the messages on the wire), `express` (the cycle of a lone call of a form agreed
before), `handles` (requests and the callers' handles), `stalls` (who is missing, and for
how long).
"""
