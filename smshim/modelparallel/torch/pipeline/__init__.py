"""The pipeline engine: everything that moves a microbatch between pipeline ranks.

- `partitioner.py`: which module runs on which pp rank; `microbatch.py`: splitting a step's
  inputs into microbatches and joining their outputs; `scheduler.py`: the schedules (`simple`,
  `interleaved`) as data, and the compute lock that orders work by them.
- `pipeline.py`: one step on every rank (pp_rank 0 runs the step body per microbatch).
- `server.py` and its parts: calls to modules on another rank become requests
  (`calls.py`, the caller's side; `serving.py`, the owner's; `admission.py`, how many
  microbatches a rank holds; `step_end.py`, the end of a step and nested calls), with
  `run_queue.py`, `turns.py`, `value_store.py`, `remote_tensor.py`, `weight_grad.py`.
- `transport.py` (with `messages.py`, `frames.py`, `outbox.py`): frames between the ranks of one pipeline, on
  gloo groups of their own; `channels.py`: CUDA tensors on NCCL pair groups beside the frames;
  `workers.py`: the threads.
- `activation_checkpointing.py`: recomputation of marked modules, served through the engine.

May import the face's ground modules (`..errors`, `..state`, `..comm`), `..precision` and
`smshim.timeline`; never the API (`..model`, `..optimizer`), `..tensor_parallel` or
`..checkpointing`.
"""
