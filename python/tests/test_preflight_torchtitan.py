"""torchtitan's own trainer, run unchanged through torchrun under `oomkit preflight`, as rank 0
of 8 GPUs: FSDP alone, FSDP with tensor parallelism, pipeline parallelism, context parallelism,
and compiled.

The model is torchtitan's debug Llama 3 (its own config, `llama3_debugmodel`); the tokenizer
and the data set are stand-ins written here (a word-level tokenizer, generated text in the
folder the trainer's `c4_test` data set names), nothing fetched. torchtitan 0.3.0 and what it
imports are installed by scripts/test.sh into their own folder, `.venv/torchtitan-site`, which
only these tests put on the path.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from preflight_cli import OOMKIT

#: Where scripts/test.sh installs torchtitan and what it imports.
SITE = Path(sys.prefix) / "torchtitan-site"

pytestmark = pytest.mark.skipif(
    not (SITE / "torchtitan").is_dir(), reason=f"torchtitan is not installed in {SITE} (scripts/test.sh installs it)"
)

#: The debug model's shape, as torchtitan 0.3.0's `llama3_debugmodel` sets it: width 256, six
#: layers of 16 heads (keys and values as many), a feed-forward of 768 (2/3 of 4 x 256, rounded
#: up to 256), a vocabulary of 2,048.
WIDTH, LAYERS, FFN, VOCAB = 256, 6, 768, 2048

#: Its parameters, by hand: the embedding and the output layer; per layer the fused query, key
#: and value projection, the output projection, three feed-forward matrices and two norms; the
#: final norm.
PARAMETERS = 2 * VOCAB * WIDTH + LAYERS * (3 * WIDTH * WIDTH + WIDTH * WIDTH + 3 * WIDTH * FFN + 2 * WIDTH) + WIDTH

#: The words the stand-in text is made of, each one token of the stand-in tokenizer.
WORDS = ("memory", "batch", "layer", "token", "gpu", "step", "model", "train", "data", "of", "the", "attention")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out as the trainer expects: tests/assets/tokenizer and tests/assets/c4_test."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("torchtitan")
    tokenizer_dir = root / "tests" / "assets" / "tokenizer"
    data_dir = root / "tests" / "assets" / "c4_test"
    tokenizer_dir.mkdir(parents=True)
    data_dir.mkdir(parents=True)
    vocab = {w: i for i, w in enumerate(("<unk>", "<|begin_of_text|>", "<|end_of_text|>", *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    with open(data_dir / "data.json", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(2000))}) + "\n")
    return root


def _titan(workdir: Path, *options: str, cuda_graphs: bool = False) -> dict[str, Any]:
    """``oomkit preflight --json -- torchrun --nproc-per-node 8 -m torchtitan.train`` on the debug
    model with ``options`` (and without CUDA graphs unless ``cuda_graphs``); its ``run``."""
    command = [
        OOMKIT, "preflight", "--json", "--capacity", "H100", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
        "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
        "--training.steps", "2", *([] if cuda_graphs else ["--training.disable_cuda_graphs"]),
        "--profiler.no-enable-profiling", "--metrics.no-enable-tensorboard", *options,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(SITE), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=workdir, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    run: dict[str, Any] = json.loads(p.stdout)["run"]
    assert run["steps"] == 2, run
    assert any("rank 0 of 8 GPUs" in n for n in run["notes"]), run["notes"]
    return run


def test_fsdp_over_eight_gpus_keeps_an_eighth_of_adamws_state(workdir: Path) -> None:
    run = _titan(workdir)
    # AdamW's two moments of rank 0's eighth of every weight, in float32; each of FSDP's shards
    # is padded to a whole number of rows and rounded by the allocator: a little over.
    state = 2 * PARAMETERS * 4 // 8
    assert state <= run["by_role"]["optimizer_state"] <= state * 1.02, run["by_role"]
    # Each measured step is the trainer's batch of 8 sequences of 2,048 tokens.
    assert any("8 x 2048 tokens" in n for n in run["notes"]), run["notes"]


def test_cpu_offload_keeps_the_shards_and_adamws_state_on_the_host(workdir: Path) -> None:
    run = _titan(workdir, "--training.enable_cpu_offload")
    # FSDP2's CPU offload: rank 0's eighth of every weight pinned on the host (a little over,
    # each shard padded to whole rows), and AdamW stepping there: no optimizer state on the GPU.
    shards = PARAMETERS * 4 // 8
    assert shards <= run["host_pinned_peak_bytes"] <= shards * 1.02, run
    assert run["by_role"]["optimizer_state"] == 0 and run["by_role"]["parameters"] > 0, run["by_role"]


def test_tensor_parallel_inside_fsdp_splits_the_same_state_eight_ways(workdir: Path) -> None:
    run = _titan(workdir, "--parallelism.tensor_parallel_degree", "2")
    # FSDP over 4 and tensor parallelism over 2: the matrices split eight ways, the norms (which
    # sequence parallelism keeps whole on each tensor-parallel GPU) four ways.
    norms = (2 * LAYERS + 1) * WIDTH
    state = 2 * 4 * ((PARAMETERS - norms) // 8 + norms // 4)
    assert state <= run["by_role"]["optimizer_state"] <= state * 1.02, run["by_role"]


def test_pipeline_parallel_holds_rank_zeros_stages(workdir: Path) -> None:
    run = _titan(workdir, "--parallelism.pipeline_parallel_degree", "2")
    # The debug config's schedule is interleaved 1F1B: two stages on each of the two pipeline
    # GPUs, rank 0 holding the first (the embedding) and the third, sharded by FSDP over 4.
    assert any("pipeline parallelism: rank 0's stage(s) 0, 2 measured" in n for n in run["notes"]), run["notes"]
    # Its layers' share of AdamW's state: at most the half of the model its stages hold, over 4.
    whole = 2 * PARAMETERS * 4 // 4
    assert whole * 0.25 < run["by_role"]["optimizer_state"] < whole * 0.75, run["by_role"]


def test_context_parallel_runs_each_gpus_share_of_the_sequence(workdir: Path) -> None:
    run = _titan(workdir, "--parallelism.context_parallel_degree", "2")
    # Two GPUs share each sequence of 2,048 tokens: rank 0 runs its 1,024 of each of the 8.
    assert any("8 x 1024 tokens" in n for n in run["notes"]), run["notes"]
    # FSDP shards over all 8 (its mesh takes the context-parallel GPUs in): an eighth of the state.
    state = 2 * PARAMETERS * 4 // 8
    assert state <= run["by_role"]["optimizer_state"] <= state * 1.02, run["by_role"]


def test_compiled_blocks_are_captured_inside_fsdps_hooks(workdir: Path) -> None:
    # torchtitan compiles each block (its own compile()), then shards it: FSDP's hooks run eager
    # around the block's captured forward, as Dynamo skips them; nothing is left eager.
    run = _titan(workdir, "--compile.enable", "--compile.components", "model")
    assert any("torch.compile (inductor) was modelled" in n for n in run["notes"]), run["notes"]
    assert not any("FSDPCheckpointWrapper's forward" in n for n in run["notes"]), run["notes"]


def test_cuda_graphs_as_the_trainer_has_them_by_default(workdir: Path) -> None:
    # torchtitan captures each step after an eager warm-up: the capture allocates from the
    # graph's own pool, and the driver that creating a graph needs is not asked for.
    run = _titan(workdir, cuda_graphs=True)
    assert any("a CUDA graph was captured" in n for n in run["notes"]), run["notes"]
    state = 2 * PARAMETERS * 4 // 8
    assert state <= run["by_role"]["optimizer_state"] <= state * 1.02, run["by_role"]
