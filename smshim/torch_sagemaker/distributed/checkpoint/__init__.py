"""`torch.sagemaker.distributed.checkpoint`: SMP's sharded, local and full checkpoints on
torch.distributed.checkpoint (DCP). Modules: state_dict_saver (save, async_save,
maybe_finalize_async_calls), state_dict_loader (load), filesystem (reader/writer with hooks),
async_utils (AsyncCallsQueue), state_dict_utils (SM_LOCAL_STATE_DICT, init_optim_state), full
(whole-model save/load in the HF layout). May import torch and smshim.torch_sagemaker's state."""
