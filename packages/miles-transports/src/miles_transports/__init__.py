"""Miles weight transports: how a trainer's new weights reach the rollout engines.

- ``broadcast`` (:class:`miles_transports.broadcast.BroadcastTransport`): a
  torch.distributed group between trainer rank 0 and the engines (gloo or NCCL).
- ``colocated`` (:class:`miles_transports.colocated.ColocatedTransport`): safetensors
  files in a hand-off directory shared with engines on the same machine.

Both send the model bucket by bucket through :mod:`miles_transports.bucket`, so an
engine is called once per bucket rather than once per tensor.
"""
