"""Inference and generation under `oomkit preflight`: measured as they run, to their end.

A script with no optimizer step and no backward (a forward under
``no_grad``, or with autograd on and no backward, a Hugging Face
``generate()``) used to end with "preflight measures training steps". It is
now measured whole: the same answer, with ``mode`` ``inference``, the
number of forwards, and the tensors held across forwards and read by a
later one (a generation's cache) as ``kv_cache``.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
from preflight_cli import allocator_bytes, preflight_run

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (Python 3.10+ only)"
)

FORWARD = """
    import sys
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().eval()
    x = torch.randn(512, 1024, device="cuda")
    if sys.argv[1] == "no_grad":
        with torch.no_grad():
            y = model(x)
    else:
        y = model(x)  # autograd on, no backward: every layer's input is kept
    print(tuple(y.shape))
"""


@pytest.mark.parametrize("how", ["no_grad", "autograd"])
def test_a_forward_only_script_is_measured_as_inference(tmp_path: Path, how: str) -> None:
    script = tmp_path / "infer.py"
    script.write_text(textwrap.dedent(FORWARD))
    run = preflight_run(script, "--capacity", "24GiB", args=(how,), cwd=tmp_path)
    assert run["mode"] == "inference" and run["forwards"] == 1, run
    assert run["steps"] == 0 and run["fits"]
    weights = 4 * (1024 * 1024 + 1024) * 4
    assert weights <= run["by_role"]["parameters"] <= weights + 8 * 512
    assert sum(run["by_role"].values()) == run["peak_allocated_bytes"]
    assert any("no optimizer step and no backward" in n for n in run["notes"])
    assert not any("nothing was trained" in n for n in run["notes"])
    # With autograd on, each layer's input is kept for a backward that never comes.
    x = 512 * 1024 * 4
    held = run["by_role"]["activations"]
    assert (held >= 3 * x) if how == "autograd" else (held <= 2 * x), run["by_role"]


GENERATE = """
    import sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cache, new = sys.argv[1], int(sys.argv[2])
    BEAMS = 3
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4000, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(3, 4000, (4, 128)).cuda()
    kw = dict(max_new_tokens=new, pad_token_id=0, attention_mask=torch.ones_like(ids), do_sample=False)
    if cache == "static":
        kw.update(cache_implementation="static")
    elif cache == "sample":
        kw.update(do_sample=True, top_k=50, top_p=0.9, temperature=0.7)
    elif cache == "beam":
        kw.update(num_beams=BEAMS, early_stopping=True)
    with torch.no_grad():
        out = model.generate(ids, **kw)
    print("GENERATED", tuple(out.shape))
"""


@needs_transformers
@pytest.mark.parametrize("cache", ["dynamic", "static", "sample", "beam"])
def test_a_generation_is_measured_to_its_longest_sequence_with_its_cache(tmp_path: Path, cache: str) -> None:
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(GENERATE))
    short = preflight_run(script, "--capacity", "24GiB", args=(cache, "16"), cwd=tmp_path)
    long = preflight_run(script, "--capacity", "24GiB", args=(cache, "256"), cwd=tmp_path)
    for run, new in ((short, 16), (long, 256)):
        assert run["mode"] == "inference", run
        # One forward for the prompt, one per new token after it: no early end.
        assert run["forwards"] == new, run
    # The cache at the longest sequence: layers x (keys, values) x sequences
    # x key-value heads x tokens x head dim, in fp32; a static cache holds its
    # whole length from the start, and a beam search keeps one sequence per
    # beam, its cache reordered (copied) between forwards.
    sequences = 4 * (3 if cache == "beam" else 1)

    def cache_bytes(tokens: int) -> int:
        return 4 * 2 * sequences * 4 * tokens * 64 * 4

    for run, tokens in ((short, 128 + 16), (long, 128 + 256)):
        held = run["by_role"]["kv_cache"]
        # A beam search's prompt runs over 12 sequences at once: with grouped keys not repeated
        # (CUDA's kernels take them as they are) its forward can hold more than any later one,
        # and the peak is there, holding the prompt's cache.
        least = cache_bytes(128) if cache == "beam" else cache_bytes(tokens)
        assert 0.85 * least <= held <= 1.3 * cache_bytes(tokens), (held, cache_bytes(tokens), run["by_role"])
    if cache == "beam":
        assert long["peak_allocated_bytes"] >= short["peak_allocated_bytes"]
    else:
        assert long["peak_allocated_bytes"] > short["peak_allocated_bytes"]


HAND_WRITTEN = """
    import sys
    import torch
    from torch import nn

    LAYERS, DIM, VOCAB, EOS = 4, 512, 4000, 2

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.out = nn.Linear(DIM, DIM)

        def forward(self, x, cache):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            if cache is not None:  # the hand-written cache: keys and values grown by concatenation
                k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
            a = torch.softmax(q @ k.transpose(1, 2) / DIM**0.5, -1) @ v
            return x + self.out(a), (k, v)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, ids, caches):
            x, new = self.emb(ids), []
            for block, cache in zip(self.blocks, caches):
                x, kv = block(x, cache)
                new.append(kv)
            return self.head(x[:, -1]), new

    model = LM().cuda().eval()
    ids, caches = torch.randint(3, VOCAB, (4, 128)).cuda(), [None] * LAYERS
    with torch.no_grad():
        for _ in range(int(sys.argv[1])):
            logits, caches = model(ids, caches)
            ids = logits.argmax(-1, keepdim=True)
            if (ids == EOS).all():  # an early end the data decides
                break
    print("DONE")
"""


def test_a_hand_written_generation_loop_runs_to_its_bound_with_its_cache(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(HAND_WRITTEN))
    run = preflight_run(script, "--capacity", "24GiB", args=("64",), cwd=tmp_path)
    assert run["mode"] == "inference", run
    # The end-of-sequence check reads data that does not exist: it ends nothing.
    assert run["forwards"] == 64, run
    # Layers x (keys, values) x batch x tokens x width, fp32, at the longest
    # sequence: the last forward makes the cache of the prompt and the 63
    # tokens fed back while the script still holds the one before it (its
    # ``caches`` is replaced only when the forward returns), as a GPU would.
    def cache(tokens: int) -> int:
        return 4 * 2 * 4 * tokens * 512 * 4

    both = cache(128 + 63) + cache(128 + 62)
    assert 0.95 * both <= run["by_role"]["kv_cache"] <= 1.1 * both, (both, run["by_role"])


def test_a_script_without_a_forward_says_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    from preflight_cli import OOMKIT

    script = tmp_path / "nothing.py"
    script.write_text("import torch\nx = torch.zeros(4, device='cuda')\n")
    p = subprocess.run([OOMKIT, "preflight", "--", sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("oomkit: preflight: the script ended before its model's first forward")


KNOB = """
    import sys
    import torch

    model = torch.nn.Linear(1024, 1024).cuda()
    cache = torch.zeros(0, 256, 1024, device="cuda")
    with torch.no_grad():
        for _ in range(int(sys.argv[1])):  # each step keeps 1 MiB more, as a cache does
            step = model(torch.randn(256, 1024, device="cuda"))
            cache = torch.cat([cache, step[None]])
    print("CACHED", tuple(cache.shape))
"""


def test_any_placeholder_is_searched_by_the_one_search(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from preflight_cli import OOMKIT

    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(KNOB))

    def preflight(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [OOMKIT, "preflight", "--json", "--capacity", "96MiB", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
        )

    p = preflight("--search", "steps=1..200", "--", sys.executable, str(script), "{steps}")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["searched"] == "steps" and doc["largest_micro_batch"] is None
    best = doc["largest"]
    tried = dict(doc["tried"])
    assert 1 < best < 200 and tried[best] and tried[best + 1] is False, doc["tried"]
    assert [v for v, _ in doc["tried"]] == sorted(tried)
    # The run reported is the one at the smallest value; the boundary is what a run there says.
    assert doc["run"]["mode"] == "inference" and doc["run"]["forwards"] == 1
    # Each value alone, as a user would check it (the answer only: no fixes for the one that does not fit).
    for steps, fits in ((best, True), (best + 1, False)):
        one = preflight("--no-fixes", "--", sys.executable, str(script), str(steps))
        assert json.loads(one.stdout)["run"]["fits"] is fits, (steps, one.stdout[-500:])


TRAIN_WITH_EVAL = """
    import sys
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    eval_batch = int(sys.argv[1])
    for it in range(3):
        if it == 0:  # as nanoGPT does: evaluate before training, without gradients
            model.eval()
            with torch.no_grad():
                model(torch.randn(eval_batch, 1024, device="cuda")).square().mean()
            model.train()
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


def test_an_evaluation_inside_training_has_its_own_peak(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_WITH_EVAL))
    small = preflight_run(script, args=("64",), cwd=tmp_path)
    large = preflight_run(script, args=("4096",), cwd=tmp_path)
    for run in (small, large):
        assert run["mode"] == "training" and set(run["phase_peaks"]) >= {"eval", "forward", "backward", "optimizer"}, run
        assert max(run["phase_peaks"].values()) == run["peak_allocated_bytes"]
    # The evaluation's batch moves its own peak (4096 x 4096 floats of GELU
    # input and output, 64 MiB each), not training's.
    assert large["phase_peaks"]["eval"] - small["phase_peaks"]["eval"] >= 100 << 20
    training = ("forward", "backward", "optimizer")
    assert [large["phase_peaks"][p] for p in training] == [small["phase_peaks"][p] for p in training]


@needs_transformers
def test_the_generation_example_holds_its_weights_as_parameters_and_the_prompts_cache(tmp_path: Path) -> None:
    # docs/preflight.md's generation: a bf16 Llama whose peak is at the prompt's forward. Its
    # weights, made before any forward and read by every one, are parameters, not a cache.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    example = Path(__file__).resolve().parents[2] / "examples" / "preflight" / "generate.py"
    run = preflight_run(example, "--capacity", "24GiB", args=("--max-new-tokens", "8"), cwd=tmp_path)
    assert run["mode"] == "inference" and run["forwards"] == 8, run
    config = LlamaConfig(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4000, max_position_embeddings=4096)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # bf16 weights, and the rotary table, a float32 buffer the cast leaves as it is.
    held = [*(p.to(torch.bfloat16) for p in model.parameters()), *model.buffers()]
    assert run["by_role"]["parameters"] == allocator_bytes(held), run["by_role"]
    # At the prompt's forward: layers x (keys, values) x batch x key-value heads x 128 tokens x head size, bf16.
    assert run["by_role"]["kv_cache"] == 4 * 2 * 4 * 4 * 128 * 64 * 2, run["by_role"]


def test_an_image_decoder_peaks_at_its_last_stage_as_counted_by_hand(tmp_path: Path) -> None:
    """examples/preflight/decode.py (a latent diffusion model's image decoder, bf16, no gradients): its peak
    is the weights, cuBLAS's workspace and, as the last stage's first block narrows 256 channels to 128 at
    the image's full side, three tensors of 256 channels there: its input, its normalisation and its SiLU."""
    import torch

    example = Path(__file__).resolve().parents[2] / "examples" / "preflight" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_example", example)
    assert spec is not None and spec.loader is not None
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    with torch.device("meta"):
        params = list(decode.Decoder(16).to(torch.bfloat16).parameters())
    weights = allocator_bytes(params)
    # A block of more than 1 MiB is not split when less than 1 MiB of its segment would be left: the
    # allocator counts that remainder as allocated (CUDACachingAllocator.cpp, should_split).
    remainders = sum(1 for p in params if p.nbytes > 1 << 20) << 20
    side = 256
    run = preflight_run(example, "--capacity", "H100", args=("--size", str(side)), cwd=tmp_path)
    assert run["mode"] == "inference" and weights <= run["by_role"]["parameters"] < weights + remainders, run["by_role"]
    wide = side * side * decode.STAGES[-2] * 2
    cublas_workspace = 32 << 20  # one, on an H100, made at the attention's first projection
    latent = allocator_bytes([torch.empty(1, 16, side // 8, side // 8, dtype=torch.bfloat16, device="meta")])
    assert run["peak_allocated_bytes"] == run["by_role"]["parameters"] + 3 * wide + cublas_workspace + latent, run["by_line"]


ADAM_STEPS = """
    import torch

    model = torch.nn.Linear(1024, 1024, bias=False).cuda()  # 4 MiB of weights
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        x = torch.randn(16384, 1024, device="cuda")  # 64 MiB: the forward and backward peak, not the optimizer's step
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


def test_each_steps_own_peak_and_the_first_lacks_the_optimizers_state(tmp_path: Path) -> None:
    script = tmp_path / "adam.py"
    script.write_text(textwrap.dedent(ADAM_STEPS))
    run = preflight_run(script, "--steps", "3", "--capacity", "H100", cwd=tmp_path)
    first, second, third = run["step_peaks"]
    # AdamW makes its two moments (2 x 4 MiB) at the first step, after that step's backward, and
    # autograd's thread makes its cuBLAS workspace (32 MiB on an H100) at its first matrix multiply,
    # after the first backward's peak: every later step's backward runs beside both, and is
    # otherwise the same.
    assert run["by_role"]["optimizer_state"] == 2 * (4 << 20), run["by_role"]
    backward_thread_workspace = 32 << 20
    assert second - first == run["by_role"]["optimizer_state"] + backward_thread_workspace, run["step_peaks"]
    assert third == second == run["peak_allocated_bytes"], run["step_peaks"]
    assert max(run["phase_peaks"][p] for p in ("forward", "backward")) == run["peak_allocated_bytes"], run["phase_peaks"]
