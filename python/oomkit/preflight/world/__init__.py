"""The world a preflight runs in: the fake GPU, and every stand-in for what CUDA does.

``fake_gpu`` holds the one ledger of stand-ins, installed on entry and
undone on exit; the stand-ins themselves are grouped by what they stand in
for: ``cuda`` (devices, attention kernels, foreach kernels, streams),
``autocast`` (CUDA autocast's regions, and what it casts, asked of
PyTorch), ``checkpoints`` (``torch.load`` onto the GPU, its data unread),
``memory`` (``torch.cuda``'s memory queries, answered from the
allocator model), ``kernels`` (PyTorch's C++ meta kernels made current),
``compile`` (``torch.compile``'s graphs partitioned as its backend
would) and ``dist`` (several GPUs: the fake process group, FSDP and DDP).
A new stand-in for CUDA goes in the module of what it stands in for, and
one entry in ``FakeGpu.ledger``.
"""
