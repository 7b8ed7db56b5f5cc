#!/usr/bin/env python3
"""Write the snapshot that `oomkit demo` bundles.

No GPU was lent when this was written, so instead of a real run this script
imitates one: a GPT-style model trained with AdamW in bf16, step by step,
on a simulated CUDA caching allocator (2 MiB small segments, 20 MiB or
exact large segments, 512-byte rounding, block splitting and merging).
It writes exactly the dict that torch.cuda.memory._dump_snapshot() writes
(segments, device_traces, allocator_settings, external_annotations), with
shared frame objects as PyTorch pickles them.

The run has a planted bug: the eval phase keeps every batch's logits on the
GPU (outputs.append(logits)), so the next training step runs out of memory.

    python3 scripts/make_demo_snapshot.py crates/oomkit-cli/assets/demo_snapshot.pickle
"""
import pickle
import sys

MiB = 1 << 20
GPU_BYTES = 24 << 30           # a 24 GiB card
H, LAYERS, VOCAB, SEQ, BATCH = 1024, 24, 50304, 1024, 7
BF16, FP32 = 2, 4

CPP_TOP = [
    {"name": "torch::unwind::unwind()", "filename": "??", "line": 0},
    {"name": "torch::CapturedTraceback::gather(bool, bool, bool)", "filename": "??", "line": 0},
    {"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)",
     "filename": "CUDACachingAllocator.cpp", "line": 0},
]
TORCH = "/opt/venv/lib/python3.11/site-packages/torch"
APP = "/home/user/gpt"
_frames, _stacks = {}, {}


def frame(name, filename, line):
    key = (name, filename, line)
    if key not in _frames:
        _frames[key] = {"name": name, "filename": filename, "line": line}
    return _frames[key]


def stack(*py):
    """A shared frames list: C++ allocator frames, then Python frames, innermost first."""
    if py not in _stacks:
        _stacks[py] = CPP_TOP + [frame(*f) for f in py]
    return _stacks[py]


def native(node):
    key = ("native", node)
    if key not in _stacks:
        _stacks[key] = CPP_TOP + [
            frame(f"torch::autograd::generated::{node}::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)", "??", 0)
            if node != "AccumulateGrad" else
            frame("torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)", "??", 0),
            frame("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)", "??", 0),
        ]
    return _stacks[key]


MODULE = (  "_call_impl", f"{TORCH}/nn/modules/module.py", 1750)
STEP = ("train_step", f"{APP}/train.py", 52)
MAIN = ("<module>", f"{APP}/train.py", 131)
EVAL = ("evaluate", f"{APP}/train.py", 88)


class OOM(Exception):
    pass


class Allocator:
    def __init__(self):
        self.segments = []          # dicts: address, size, pool, blocks [[addr, size, req, state, frames]]
        self.trace = []
        self.recording = False
        self.t = 1_700_000_000_000_000
        self.next_addr = 0x7F0000000000
        self.live = {}              # addr -> block
        self.inflight = set()       # tensors of the running step, freed when an exception unwinds it

    def tick(self, us=7):
        self.t += us
        return self.t

    def event(self, action, addr, size, frames):
        if self.recording:
            e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.tick()}
            if action == "oom":
                e = {"action": "oom", "device_free": addr, "size": size, "stream": 0, "time_us": self.t}
            if frames is not None:
                e["frames"] = frames
            self.trace.append(e)
        else:
            self.tick()

    def reserved(self):
        return sum(s["size"] for s in self.segments)

    def malloc(self, req, frames):
        size = max(512, (req + 511) // 512 * 512)
        pool = "small" if size <= MiB else "large"
        for seg in self.segments:
            if seg["pool"] != pool:
                continue
            for i, b in enumerate(seg["blocks"]):
                if b[3] == "inactive" and b[1] >= size:
                    return self._take(seg, i, size, req, frames)
        seg_size = 2 * MiB if pool == "small" else (20 * MiB if size < 10 * MiB else (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB))
        if self.reserved() + seg_size > GPU_BYTES:
            self.empty_cache()
        if self.reserved() + seg_size > GPU_BYTES:
            self.event("oom", GPU_BYTES - self.reserved(), req, frames)
            raise OOM(req)
        addr = self.next_addr
        self.next_addr += seg_size + 64 * MiB
        seg = {"address": addr, "size": seg_size, "pool": pool, "blocks": [[addr, seg_size, 0, "inactive", []]], "frames": frames}
        self.segments.append(seg)
        self.event("segment_alloc", addr, seg_size, frames)
        return self._take(seg, 0, size, req, frames)

    def _take(self, seg, i, size, req, frames):
        b = seg["blocks"][i]
        rest = b[1] - size
        if rest >= (512 if seg["pool"] == "small" else MiB):
            seg["blocks"].insert(i + 1, [b[0] + size, rest, 0, "inactive", []])
            b[1] = size
        b[2], b[3], b[4] = req, "active_allocated", frames if self.recording else []
        self.live[b[0]] = (seg, b)
        self.inflight.add(b[0])
        self.event("alloc", b[0], b[1], frames)
        return b[0]

    def free(self, addr, frames=None):
        seg, b = self.live.pop(addr)
        self.inflight.discard(addr)
        self.event("free_requested", addr, b[1], frames)
        self.event("free_completed", addr, b[1], frames)
        b[2], b[3], b[4] = 0, "inactive", []
        blocks = seg["blocks"]
        i = blocks.index(b)
        if i + 1 < len(blocks) and blocks[i + 1][3] == "inactive":
            b[1] += blocks.pop(i + 1)[1]
        if i > 0 and blocks[i - 1][3] == "inactive":
            blocks[i - 1][1] += blocks.pop(i)[1]

    def empty_cache(self):
        for seg in list(self.segments):
            if all(b[3] == "inactive" for b in seg["blocks"]):
                self.segments.remove(seg)
                self.event("segment_free", seg["address"], seg["size"], None)

    def dump(self, annotations):
        segments = []
        for s in sorted(self.segments, key=lambda s: s["address"]):
            blocks = [{"address": b[0], "size": b[1], "requested_size": b[2], "state": b[3], "frames": b[4]} for b in s["blocks"]]
            active = sum(b[1] for b in s["blocks"] if b[3] != "inactive")
            segments.append({
                "device": 0, "address": s["address"], "total_size": s["size"],
                "allocated_size": active, "active_size": active,
                "requested_size": sum(b[2] for b in s["blocks"] if b[3] != "inactive"),
                "stream": 0, "segment_type": s["pool"], "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": [], "blocks": blocks,
            })
        return {
            "segments": segments,
            "device_traces": [self.trace],
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                "expandable_segments": False, "pinned_num_register_threads": 1,
                "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
                "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
            },
            "external_annotations": annotations,
        }


def main(out):
    a = Allocator()
    ann = []

    def phase(name, stage):
        if a.recording:
            ann.append({"stage": stage, "name": name, "device": 0, "time_us": a.tick(3)})

    # The model, loaded before recording starts: bf16 weights.
    shapes = [("wte", VOCAB * H)] + [(f"h.{i}.{p}", n) for i in range(LAYERS)
              for p, n in (("attn.qkv", 3 * H * H), ("attn.proj", H * H), ("mlp.fc", 4 * H * H), ("mlp.proj", 4 * H * H))]
    params = [(name, a.malloc(n * BF16, None), n) for name, n in shapes]
    a.inflight = set()
    a.recording = True                      # torch.cuda.memory._record_memory_history()

    grads, states = {}, {}
    tokens = BATCH * SEQ

    def forward(keep, caller=STEP):
        acts = []
        x = a.malloc(tokens * H * BF16, stack(("forward", f"{APP}/model.py", 96), MODULE, caller, MAIN))
        acts.append(x)
        for _layer in range(LAYERS):
            blk = ("forward", f"{APP}/model.py", 102)
            for line, size in ((41, 3 * tokens * H), (44, BATCH * 16 * SEQ * SEQ), (45, BATCH * 16 * SEQ * SEQ),
                               (47, tokens * H), (58, 4 * tokens * H), (59, 4 * tokens * H), (60, tokens * H)):
                acts.append(a.malloc(size * BF16, stack(("forward", f"{APP}/model.py", line), MODULE, blk, MODULE, caller, MAIN)))
            if not keep:
                for addr in acts[-7:]:
                    a.free(addr)
        logits = a.malloc(tokens * VOCAB * BF16, stack(("forward", f"{APP}/model.py", 112), MODULE, caller, MAIN))
        return acts, logits

    def train_step(step):
        phase("forward", "START")
        acts, logits = forward(keep=True)
        loss = a.malloc(4, stack(("train_step", f"{APP}/train.py", 53), MAIN))
        phase("forward", "END")
        phase("backward", "START")
        dlogits = a.malloc(tokens * VOCAB * BF16, native("LogSoftmaxBackward0"))
        a.free(logits)
        for name, _, n in reversed(params):
            tmp = a.malloc(max(n * BF16 // 8, 512), native("MmBackward0"))
            if name not in grads:
                grads[name] = a.malloc(n * BF16, native("AccumulateGrad"))
            a.free(tmp)
            while acts and len(acts) > 1 and name.endswith("mlp.proj"):
                for addr in acts[-7:]:
                    a.free(addr)
                del acts[-7:]
                break
        for addr in acts:
            a.free(addr)
        a.free(dlogits)
        a.free(loss)
        phase("backward", "END")
        phase("Optimizer.step#AdamW.step", "START")
        for name, _, n in params:
            if name not in states:
                for line in (92, 93):
                    states.setdefault(name, []).append(
                        a.malloc(n * FP32, stack(("_init_group", f"{TORCH}/optim/adamw.py", line),
                                                 ("step", f"{TORCH}/optim/adamw.py", 187), STEP, MAIN)))
        phase("Optimizer.step#AdamW.step", "END")
        phase("Optimizer.zero_grad#AdamW.zero_grad", "START")
        for name in list(grads):
            a.free(grads.pop(name))
        phase("Optimizer.zero_grad#AdamW.zero_grad", "END")

    kept = []
    try:
        for step in range(8):
            a.inflight = set()
            train_step(step)
            if step == 2:
                phase("eval", "START")
                for _ in range(8):
                    acts, logits = forward(keep=False, caller=EVAL)
                    a.free(acts[0])
                    kept.append(logits)           # the bug: outputs.append(logits)
                phase("eval", "END")
                a.inflight = set()
    except OOM:
        # The exception unwinds train_step: its tensors are freed before the dump.
        for addr in sorted(a.inflight):
            a.free(addr)
    with open(out, "wb") as f:
        pickle.dump(a.dump(ann), f, protocol=4)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo_snapshot.pickle")
