"""Model and optimizer state: the state dicts of a partitioned, tensor-parallel model
(`state_dicts.py`), optimizer-state sharding over data parallel ranks (`optimizer_sharding.py`),
the checkpoint format with safe loading (`checkpoint.py`: `smp.save`, `smp.load`,
`smp.save_checkpoint`, `smp.resume_from_checkpoint`), and the signatures on the files smshim
writes (`signing.py`).

May import the face's ground modules (`..errors`, `..state`, `..comm`) and `..tensor_parallel`;
never the API (`..model`, `..optimizer`) or `..pipeline`.
"""
