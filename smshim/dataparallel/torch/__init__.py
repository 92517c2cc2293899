"""`smdistributed.dataparallel.torch`: the `distributed` function API, `parallel.DistributedDataParallel`
and the `smddp` torch.distributed backend (`torch_smddp`)."""
