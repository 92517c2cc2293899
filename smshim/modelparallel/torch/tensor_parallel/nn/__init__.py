"""The distributed modules behind `smp.nn` (re-exported there): layers, the transformer family,
and the tensor-parallel forms of Hugging Face blocks (`hf_*.py`)."""
