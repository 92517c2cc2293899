"""A training module that initialises smp when it is imported, as many scripts do at the top."""

import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

CONFIG = {"partitions": 2, "microbatches": 2, "pipeline": "interleaved"}
smp.init(CONFIG)


@smp.step
def train_step(model, x, y):
    out = model(x)
    loss = F.cross_entropy(out["logits"], y)
    model.backward(loss)
    correct = (out["logits"].argmax(1) == y).sum().item()
    # A dict of tensors and Python numbers: tensors come back as StepOutputs, the rest as lists.
    return {"loss": loss, "logits": out["logits"], "correct": correct, "tag": "train"}
