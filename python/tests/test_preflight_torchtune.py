"""torchtune's recipes run unchanged through `tune run` under `oomkit preflight`, with every memory
switch of theirs, and "what would make it fit" speaks in those switches.

The model is a two-layer Llama 3.2 of the real architecture (torchtune's own builder), its
weights a Hugging Face checkpoint written here; the tokenizer is a byte-level tiktoken file and
the data an Alpaca-shaped JSON file: stand-ins for the downloads, nothing fetched.
torchtune 0.6.1 and torchao 0.15.0 (the newest whose APIs it imports that loads on this torch)
are installed by scripts/test.sh into their own folder, `.venv/torchtune-site`, so that nothing
else the tests run sees them. VALIDATION.md's torchtune ladder runs the same recipes at full size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from preflight_cli import OOMKIT

#: Where scripts/test.sh installs torchtune and what it imports.
SITE = Path(sys.prefix) / "torchtune-site"

pytestmark = pytest.mark.skipif(
    not (SITE / "torchtune").is_dir(), reason=f"torchtune is not installed in {SITE} (scripts/test.sh installs it)"
)

#: The tiny model: Llama 3.2's vocabulary (the tokenizer's special tokens need it) and two layers,
#: each weight a whole number of torchao's NF4 blocks (64 weights, their scales in blocks of 256).
MODEL = {"vocab_size": 128256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 256, "max_seq_len": 2048, "intermediate_dim": 512}

ASSETS = """
import base64, json, os, sys
from safetensors.torch import save_file
from torchtune.models.convert_weights import tune_to_hf
from torchtune.models.llama3_2 import llama3_2

out, model = sys.argv[1], json.loads(sys.argv[2])
weights = tune_to_hf(llama3_2(**model).state_dict(), num_heads=model["num_heads"], num_kv_heads=model["num_kv_heads"], dim=model["embed_dim"])
weights.pop("lm_head.weight", None)  # tied to the embedding, as Llama 3.2's checkpoints have it
save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
config = {"num_attention_heads": model["num_heads"], "num_key_value_heads": model["num_kv_heads"], "hidden_size": model["embed_dim"], "tie_word_embeddings": True}
json.dump(config, open(os.path.join(out, "config.json"), "w"))
with open(os.path.join(out, "tokenizer.model"), "w") as f:
    f.writelines(base64.b64encode(bytes([i])).decode() + f" {i}\\n" for i in range(256))
rows = [{"instruction": f"Say something about the number {i} " * 8, "input": "", "output": f"The number {i} is fine. " * 20} for i in range(64)]
json.dump(rows, open(os.path.join(out, "alpaca.json"), "w"))
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(SITE), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The checkpoint in a folder of its own: torchtune refuses an output folder inside it.
    out = tmp_path_factory.mktemp("torchtune")
    (out / "ckpt").mkdir()
    p = subprocess.run([sys.executable, "-c", ASSETS, str(out / "ckpt"), json.dumps(MODEL)], capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _tune(
    assets: Path,
    recipe: str,
    config: str,
    *overrides: str,
    flags: tuple[str, ...] = (),
    checkpoint: str = "ckpt",
    launcher: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``tune run LAUNCHER RECIPE --config CONFIG`` on the tiny model and the stand-ins, under ``oomkit
    preflight FLAGS``, its weights read from the folder ``checkpoint`` (``LAUNCHER``: ``--nproc_per_node 2``)."""
    model = [f"model.{k}={v}" for k, v in MODEL.items()]
    builder = "torchtune.models.llama3_2.lora_llama3_2" if recipe.startswith("lora") else "torchtune.models.llama3_2.llama3_2"
    common = (
        f"model._component_={builder}", *model,
        f"checkpointer.checkpoint_dir={assets / checkpoint}", "checkpointer.checkpoint_files=[model.safetensors]",
        f"tokenizer.path={assets / 'ckpt' / 'tokenizer.model'}", "tokenizer.max_seq_len=1024",
        "dataset._component_=torchtune.datasets.alpaca_dataset", "dataset.source=json",
        f"dataset.data_files={assets / 'ckpt' / 'alpaca.json'}", "dataset.split=train", "dataset.packed=True",
        f"output_dir={assets / 'out'}", "max_steps_per_epoch=2", "batch_size=2", "gradient_accumulation_steps=1",
    )  # fmt: skip
    command = [sys.executable, "-m", "torchtune._cli.tune", "run", *launcher, recipe, "--config", config, *common, *overrides]
    return subprocess.run(
        [OOMKIT, "preflight", "--steps", "2", *flags, "--", *command],
        capture_output=True, text=True, timeout=900, cwd=assets, env=_env(),
    )  # fmt: skip


def _answer(p: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert p.returncode in (0, 5), p.stderr[-4000:]
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def test_the_fixes_of_a_torchtune_recipe_are_its_own_switches_each_run(assets: Path) -> None:
    # Packed (FlexAttention with a block mask), the plain loss, AdamW fused as torchtune's configs set it,
    # checkpointing already on: the recipe as a user starts it, on a GPU too small for it.
    overrides = (
        "loss=torch.nn.CrossEntropyLoss", "optimizer=torch.optim.AdamW", "optimizer.fused=True",
        "optimizer_in_bwd=False", "enable_activation_checkpointing=True", "enable_activation_offloading=False", "compile=False",
    )  # fmt: skip
    out = _answer(_tune(assets, "full_finetune_single_device", "llama3_2/3B_full_single_device", *overrides, flags=("--json", "--capacity", "1GiB")))
    run = out["run"]
    assert run["steps"] == 2 and not run["fits"], run
    rows = {row["change"]: row for row in out["fixes"]}
    eight_bit = "optimizer=bitsandbytes.optim.PagedAdamW8bit (optimizer.fused off the command)"
    expected = {
        "compile=True", "enable_activation_checkpointing=True", "optimizer_in_bwd=True", "enable_activation_offloading=True",
        "loss=torchtune.modules.loss.CEWithChunkedOutputLoss", eight_bit,
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "batch_size=1 gradient_accumulation_steps=2", "all of the above",
    }  # fmt: skip
    assert set(rows) == expected, (list(rows), out.get("fix_notes"))
    # What the recipe already does is said, with its own figures; the rest were each run.
    assert rows["enable_activation_checkpointing=True"]["already"] == "the recipe sets enable_activation_checkpointing=True already"
    assert rows["enable_activation_checkpointing=True"]["peak_allocated_bytes"] == run["peak_allocated_bytes"]
    measured = [row for name, row in rows.items() if row["already"] is None]
    assert len(measured) == len(expected) - 1
    # The chunked loss keeps the logits in bf16 chunks (their fp32 copies are the plain loss's
    # peak here), compiling fuses the rest, and the 8-bit optimizer runs once the fused flag it
    # does not take is off the command (its large state paged, outside the figures).
    assert rows["loss=torchtune.modules.loss.CEWithChunkedOutputLoss"]["peak_allocated_bytes"] < run["peak_allocated_bytes"]
    assert rows["compile=True"]["peak_allocated_bytes"] < run["peak_allocated_bytes"]
    assert rows[eight_bit]["peak_allocated_bytes"] < run["peak_allocated_bytes"]
    everything = rows["all of the above"]
    assert everything["peak_allocated_bytes"] <= min(r["peak_allocated_bytes"] for r in measured), rows


def _weights() -> int:
    """The tiny model's weights, counted from MODEL: the embedding (the output projection is tied to
    it), each layer's attention (grouped keys and values), its SwiGLU and two norms, the last norm."""
    d, head = MODEL["embed_dim"], MODEL["embed_dim"] // MODEL["num_heads"]
    kv = MODEL["num_kv_heads"] * head
    layer = 2 * d * d + 2 * d * kv + 3 * d * MODEL["intermediate_dim"] + 2 * d
    return MODEL["vocab_size"] * d + MODEL["num_layers"] * layer + d


def test_a_distributed_recipe_with_its_weights_offloaded_to_the_host(assets: Path) -> None:
    # full_finetune_distributed over 2 GPUs with fsdp_cpu_offload: each rank loads its DTensor shards
    # and moves them to the host (.cpu()) before FSDP2 offloads them, and AdamW steps there.
    overrides = ("--nproc_per_node", "2")
    p = _tune(assets, "full_finetune_distributed", "llama3_2/1B_full", "fsdp_cpu_offload=True", "optimizer.fused=False",
              "dataset.packed=False", flags=("--json",), launcher=overrides)  # fmt: skip
    run = _answer(p)["run"]
    assert run["steps"] == 2 and any("rank 0 of 2 GPUs" in n for n in run["notes"]), run
    # Rank 0's half of the bf16 weights, pinned on the host; no optimizer state on the GPU.
    assert run["host_pinned_peak_bytes"] == _weights() * 2 // 2, (run["host_pinned_peak_bytes"], _weights())
    assert run["by_role"]["optimizer_state"] == 0, run["by_role"]


def test_an_unpacked_recipe_runs_its_second_step_at_the_tokenizers_longest(assets: Path) -> None:
    # Unpacked, each batch is as long as its longest example (well under 1,024 tokens); the
    # recipe's tokenizer keeps 1,024, and its second batch is padded there, tokens and labels.
    overrides = ("dataset.packed=False", "loss=torch.nn.CrossEntropyLoss", "compile=False", "batch_size=2")
    run = _answer(_tune(assets, "full_finetune_single_device", "llama3_2/3B_full_single_device", *overrides, flags=("--json",)))["run"]
    assert run["steps"] == 2, run
    said = [n for n in run["notes"] if "at each step's first embedding lookup" in n]
    assert said and said[0].endswith(", 2 x 1024 tokens (batch x sequence, at each step's first embedding lookup): "
                                     "the longest sequence the script keeps (1024 tokens, the recipe's tokenizer.max_seq_len)"), said
    assert any("each training batch was padded to the longest sequence the script keeps (1024 tokens" in n for n in run["notes"])


def test_qlora_runs_with_its_4bit_weights_on_the_fake_gpu(assets: Path) -> None:
    # torchao's NF4 weights (a tensor subclass made where the weight says it is) and LoRA, with the
    # switches of torchtune's last row: compiled, chunked loss, checkpointing, offloading.
    overrides = (
        "model.lora_attn_modules=[q_proj,v_proj,output_proj]", "model.apply_lora_to_mlp=True", "model.lora_rank=8",
        "model.lora_alpha=16", "model.quantize_base=True", "compile=True", "enable_activation_checkpointing=True",
        "enable_activation_offloading=True", "loss=torchtune.modules.loss.CEWithChunkedOutputLoss",
    )  # fmt: skip
    run = _answer(_tune(assets, "lora_finetune_single_device", "llama3_2/3B_qlora_single_device", *overrides, flags=("--json", "--capacity", "24GiB")))["run"]
    assert run["steps"] == 2, run
    notes = " ".join(run["notes"])
    assert "torch.compile (inductor) was modelled" in notes and "could not capture" not in notes, run["notes"]
    # The base weights in 4 bits: the two layers' linear weights at half a byte each (with their
    # scales, the LoRA adapters and the rotary table beside), not the two bytes of bf16; the
    # embedding (tied to the output) stays bf16.
    linear = 2 * (256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 256 * 512)
    embedding = 128256 * 256 * 2
    assert embedding + linear // 2 < run["by_role"]["parameters"] < embedding + 2 * linear, run["by_role"]
    # Activation offloading pins its copies on the host.
    assert run["host_pinned_peak_bytes"] > 0, run


def test_a_script_that_is_no_recipe_keeps_the_changes_made_inside_it(tmp_path: Path) -> None:
    # The recipe's switches are offered only where its config was read; a plain script that
    # imports torchtune (and not its recipes) gets the changes preflight makes inside scripts.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torchtune.modules  # imported, never configured as a recipe
            from torch import nn

            model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).cuda()
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                model(torch.randn(64, 512, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--fixes", "--capacity", "24GiB", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=_env(),
    )  # fmt: skip
    changes = [row["change"] for row in _answer(p)["fixes"]]
    assert "activation checkpointing of the model's repeated blocks" in changes, changes
    assert not any("=True" in c and not c.startswith("PYTORCH") for c in changes), changes


def test_a_recipe_runs_from_a_checkpoint_folder_holding_only_its_config(assets: Path) -> None:
    # The Hugging Face repository's config.json (as `tune download` fetches it) without the weights.
    bare = assets / "bare"
    bare.mkdir(exist_ok=True)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": MODEL["vocab_size"],
        "hidden_size": MODEL["embed_dim"], "intermediate_size": MODEL["intermediate_dim"], "num_hidden_layers": MODEL["num_layers"],
        "num_attention_heads": MODEL["num_heads"], "num_key_value_heads": MODEL["num_kv_heads"],
        "max_position_embeddings": MODEL["max_seq_len"], "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (bare / "config.json").write_text(json.dumps(config))
    overrides = ("optimizer=torch.optim.AdamW", "optimizer.fused=True", "enable_activation_checkpointing=True", "compile=False")
    recipe = ("full_finetune_single_device", "llama3_2/3B_full_single_device", *overrides)
    without = _answer(_tune(assets, *recipe, flags=("--json",), checkpoint="bare"))["run"]
    withw = _answer(_tune(assets, *recipe, flags=("--json",)))["run"]
    assert without["steps"] == 2, without
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_role"):
        assert without[key] == withw[key], (key, without[key], withw[key])
    assert any(n.startswith(f"the checkpoint {bare} has a config.json and no weight file") for n in without["notes"]), without["notes"]
