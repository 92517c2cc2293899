"""`smdistributed.modelparallel.torch.nn.huggingface`: the state-dict translators SMP documents
for the Hugging Face models it replaces by its distributed transformer (SPEC §7.6), one module per
family: gpt2, bert, roberta, gptj, gptneo. Public face only: each module re-exports the exact,
mutually inverse translations of ../hf_layouts.py under SMP's names; nothing here imports the
engine beyond that file.
"""

from smshim.modelparallel.torch.nn.huggingface import bert, gpt2, gptj, gptneo, roberta

__all__ = ["gpt2", "bert", "roberta", "gptj", "gptneo"]
