"""Multi-process tensor parallelism: rank 0 drives, follower ranks replay its steps.

    rank 0 (the engine)            follower ranks (python -m pdserve.engine.tp.follower)
    scheduler ─► StepPlan          ─ wait for a message on the control group
    broadcast(step message) ─────► decode it; same chunks, same block tables
    forward (all-reduce/gather) ◄─► forward (all-reduce/gather)
    sample (rank 0 only)           logits discarded; loop

Only rank 0 schedules, holds the block pool and samples; every rank holds its shard of the
weights and its KV heads of every block, with identical block ids. Control messages are
msgpack bytes broadcast as uint8 tensors over a gloo group; the model's collectives use a gloo
group (CPU) or an NCCL group (CUDA). A rank that dies breaks the next collective: rank 0's
engine loop fails and the worker reports itself unhealthy; followers exit when rank 0 is gone.
"""
