"""The smp step functions and gather helpers exactly as Hugging Face's trainer_pt_utils defines
them: at import time, possibly before smp.init() has run."""

import torch

import smdistributed.modelparallel.torch as smp


@smp.step()
def smp_forward_backward(model, inputs, gradient_accumulation_steps=1):
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    loss /= gradient_accumulation_steps
    model.backward(loss)
    return loss


@smp.step()
def smp_forward_only(model, inputs):
    return model(**inputs)


def smp_gather(tensor):
    all_tensors = smp.allgather(tensor, smp.CommGroup.DP_GROUP)
    all_tensors = [torch.atleast_1d(t) for t in all_tensors]
    return torch.cat([t.cpu() for t in all_tensors], dim=0)


def smp_nested_concat(tensor):
    return tensor.concat().detach().cpu()
