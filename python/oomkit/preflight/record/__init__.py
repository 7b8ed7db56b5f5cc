"""The recorder: every allocation and free a step makes on tensors without data, and what it knows of each.

``recorder`` records them below autograd (a dispatch mode), with each
one's stack and phase; ``values`` carries the values of small tensors the
step makes known; ``frames`` says which line of a stack is the user's;
``roles`` knows the role of what the model, the optimizer and the batch
hold; ``recording`` is what a finished run hands the answer. Nothing here
stands in for CUDA (that is ``world/``) or tells the answer (``answer``).
"""
