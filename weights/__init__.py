"""The weight channel: each LoRA adapter version from learner rank 0 to the actors.

publisher.py (the learner's end, `Publisher`), subscriber.py (the actors' end, `WeightSource`),
local.py (both ends in one process), transports.py (the data paths: chunks on sockets, shared
memory on one host), chunks.py and format.py (the adapter on the wire), wire.py (the messages).
The adapter itself is the policy's `policy.adapter.Adapter`, the one part imported here.
"""
