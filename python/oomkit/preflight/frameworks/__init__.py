"""What other libraries need to run under preflight: their models, loaders and optimizers without a GPU or weights.

``huggingface`` builds a Hugging Face model from its config on the fake
GPU (with LoRA adapters and 4-bit layers, as PEFT and transformers add
them); ``bitsandbytes`` makes its 8-bit optimizers by name or in place of
PyTorch's. A new framework's loader (a ``from_pretrained`` that must read
no weights, a library's own optimizer) goes here, in a module named for
the framework, and is installed through the world's ledger where it
replaces something.
"""
