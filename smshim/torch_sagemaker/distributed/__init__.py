"""`torch.sagemaker.distributed`: the checkpoint API (`distributed.checkpoint`) on torch DCP."""
