"""``from_pretrained`` under preflight reads no weight file: a model is built from its config alone,
from a folder that holds only ``config.json`` or from the hub's cache offline, with the figures of
the same step run with the weights present; and a module moved to the GPU keeps its parameters'
objects (tied weights stay tied), as on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from preflight_cli import OOMKIT, allocator_bytes, preflight_run

transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")
import torch  # noqa: E402

#: A small Llama of the real architecture: grouped-query attention, untied head, bf16 as its config says.
LLAMA: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "dtype": "bfloat16",
}  # fmt: skip

#: A small GPT-2: its head tied to its embedding, and (as GPT-2's own config) no dtype named.
GPT2: dict[str, Any] = {"n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 8192, "n_positions": 512}

TRAIN = """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(2):
    ids = torch.randint(0, 4096, (2, 256), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _folder(root: Path, name: str, kind: str, config: dict[str, Any], *, weights: bool) -> Path:
    """A model folder of ``config``: ``config.json`` alone, or with the weights ``save_pretrained`` writes."""
    cfg = transformers.AutoConfig.for_model(kind, **config)
    cfg.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    out = root / name
    if weights:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.to(cfg.dtype or torch.float32).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out


def _notes(run: dict[str, Any]) -> list[str]:
    return [n for n in run["notes"] if "built from its config" in n]


def test_a_folder_with_only_its_config_answers_as_with_its_weights(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    full = _folder(tmp_path, "full", "llama", LLAMA, weights=True)
    assert sorted(os.listdir(bare)) == ["config.json"]
    without = preflight_run(script, args=(str(bare),))
    withw = preflight_run(script, args=(str(full),))
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_role", "steps"):
        assert without[key] == withw[key], (key, without[key], withw[key])
    # The weights are those of the config, in bf16 as it says: the head untied, each tensor a block of its own;
    # the rotary embedding's buffers (far below a block each) beside them.
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(bare))
    expected = allocator_bytes(p.to(torch.bfloat16) for p in model.parameters()) + allocator_bytes(model.buffers())
    assert without["by_role"]["parameters"] == expected, (without["by_role"], expected)
    (note,) = _notes(without)
    assert note.startswith("LlamaForCausalLM was built from its config; no weight file was read"), note
    assert f"its {len(model.state_dict())} tensors" in note, note
    assert any(n.startswith("each measured step ran at 2 x 256 tokens") for n in without["notes"]), without["notes"]


def test_a_hub_id_offline_reads_its_config_from_the_cache_and_ties_the_head(tmp_path: Path) -> None:
    # The hub cache's layout: one repository, its ref, one snapshot holding config.json and nothing else.
    revision = "0" * 40
    repo = tmp_path / "hub" / "models--someorg--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    config = transformers.GPT2Config(**GPT2).to_dict()
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    config["architectures"] = ["GPT2LMHeadModel"]
    (snapshot / "config.json").write_text(json.dumps(config))
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("4096", "8192").replace("sys.argv[1]", '"someorg/tiny-gpt2"'))
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2, run
    # fp32 (no dtype anywhere), the head tied to the embedding: its weight counted once, with one gradient and one state.
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    assert model.lm_head.weight is model.transformer.wte.weight
    expected = allocator_bytes(model.parameters())
    assert run["by_role"]["parameters"] == expected, (run["by_role"], expected)
    assert any("no dtype" in n and "float32" in n for n in run["notes"]), run["notes"]
    assert len(_notes(run)) == 1, run["notes"]


def test_an_id_missing_from_the_cache_offline_says_so_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("sys.argv[1]", '"someorg/no-such-model"'))
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    p = subprocess.run(
        [OOMKIT, "preflight", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    # No answer (exit 2), said in the last line: transformers' own words, at the script's line.
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("oomkit: preflight: the script failed under preflight after 0 optimizer step(s): OSError:"), last
    assert "couldn't find them in the cached files" in last and "(at train.py:3 (<module>)" in last, last


FOUR_BIT = """
import sys, torch, transformers
q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=q, device_map={"": 0})
model.lm_head.weight.requires_grad_(True)
ids = torch.randint(0, 4096, (2, 128), device="cuda")
model(input_ids=ids, labels=ids).loss.backward()
"""


def test_4bit_weights_from_the_config_hold_their_real_size(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")
    script = tmp_path / "qlora.py"
    script.write_text(FOUR_BIT)
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    full = _folder(tmp_path, "full", "llama", LLAMA, weights=True)
    without = preflight_run(script, args=(str(bare),))
    withw = preflight_run(script, args=(str(full),))
    assert without["by_role"] == withw["by_role"] and without["peak_allocated_bytes"] == withw["peak_allocated_bytes"]
    # bitsandbytes' NF4: two weights a byte, an fp32 scale per block of 64 and the 16 values of the code book
    # (each quantized weight's own), for every linear layer but the head; the head, the embedding and the norms
    # stay bf16. Every tensor is a block of its own.
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(bare))
    quantized = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    packed = sum(-(-w.numel() // 2 // 512) * 512 + -(-(w.numel() // 64 * 4) // 512) * 512 + 512 for w in quantized)
    kept = allocator_bytes(p.to(torch.bfloat16) for n, p in model.named_parameters() if not any(p is w for w in quantized))
    kept += allocator_bytes(model.buffers())
    assert without["by_role"]["parameters"] == packed + kept, (without["by_role"], packed, kept)


ADAPTED = """
import sys, torch, transformers, peft
base = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map={"": 0})
model = peft.PeftModel.from_pretrained(base, sys.argv[2], is_trainable=True)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
for _ in range(2):
    ids = torch.randint(0, 4096, (2, 128), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_peft_adapter_folder_without_weights_is_built_from_its_config(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="PEFT is not installed for this Python")
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    adapter = tmp_path / "adapter"
    peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM").save_pretrained(adapter)
    assert sorted(os.listdir(adapter)) == ["adapter_config.json"]
    script = tmp_path / "adapted.py"
    script.write_text(ADAPTED)
    run = preflight_run(script, args=(str(bare), str(adapter)))
    assert run["steps"] == 2, run
    # The base in bf16 (its config's dtype), and LoRA's A (r x in) and B (out x r) in fp32 on each query and value.
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(bare))
    width, kv = LLAMA["hidden_size"], LLAMA["num_key_value_heads"] * LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    adapters = [torch.empty(16, width), torch.empty(width, 16), torch.empty(16, width), torch.empty(kv, 16)] * LLAMA["num_hidden_layers"]
    base = allocator_bytes(p.to(torch.bfloat16) for p in model.parameters()) + allocator_bytes(model.buffers())
    assert run["by_role"]["parameters"] == base + allocator_bytes(adapters), (run["by_role"], base)
    assert any(f"the PEFT adapter {str(adapter)!r} was built from its adapter_config.json alone" in n for n in run["notes"]), run["notes"]


def test_a_module_moved_to_the_gpu_keeps_its_parameters_objects(tmp_path: Path) -> None:
    # Host tensors with data (as a checkpoint's are), a head tied to the embedding, and an optimizer made before the move.
    script = tmp_path / "tied.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "emb, head = nn.Embedding(8192, 512), nn.Linear(512, 8192, bias=False)\n"
        "emb.weight = nn.Parameter(torch.frombuffer(bytearray(8192 * 512 * 4), dtype=torch.float32).view(8192, 512))\n"
        "head.weight = emb.weight\n"
        "model = nn.Sequential(emb, head)\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "kept = emb.weight\n"
        "model.cuda()\n"
        "assert model[0].weight is model[1].weight is kept, 'untied'\n"
        "assert kept.is_cuda\n"
        "for _ in range(2):\n"
        "    model(torch.randint(0, 8192, (4, 64), device='cuda')).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )
    run = preflight_run(script)
    weight = 8192 * 512 * 4
    assert run["by_role"]["parameters"] == weight, run["by_role"]
    # AdamW's two states of the one weight (and its step counter, a 4-byte tensor in a block of its own).
    assert run["by_role"]["optimizer_state"] >= 2 * weight and run["by_role"]["optimizer_state"] < 2 * weight + 4096, run["by_role"]


TRUNCATED = """
import sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {"<pad>": 0, **{f"w{i}": i + 1 for i in range(999)}}
words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>")
texts = [" ".join(f"w{j}" for j in range(50 + 10 * i)) for i in range(4)]  # 50, 60, 70 and 80 words
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).cuda()
opt = torch.optim.AdamW(model.parameters())
for i in range(2):
    batch = tokenizer(texts[2 * i : 2 * i + 2], truncation=True, max_length=int(sys.argv[2]), padding="longest", return_tensors="pt")
    batch = batch.to("cuda")
    model(**batch, labels=batch["input_ids"]).loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_later_step_runs_at_the_longest_sequence_the_script_keeps(tmp_path: Path) -> None:
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    script = tmp_path / "truncated.py"
    script.write_text(TRUNCATED)
    long, short = (preflight_run(script, args=(str(bare), str(n))) for n in (512, 60))
    said = [n for n in long["notes"] if "at each step's first embedding lookup" in n]
    # The data pads each batch to its longest (60, then 80 words), below the truncation's 512: the
    # first step runs as the data gives it, the second padded to the 512 the script keeps.
    assert said == [
        "the measured steps ran at 2 x 60, 2 x 512 tokens (batch x sequence, at each step's first embedding lookup): "
        "the longest sequence the script keeps (512 tokens, the tokenizer's max_length)"
    ], long["notes"]
    assert any("each training batch was padded to the longest sequence the script keeps (512 tokens" in n for n in long["notes"])
    # Truncated at 60, every batch is already at the longest: nothing is padded.
    said = [n for n in short["notes"] if "at each step's first embedding lookup" in n]
    assert said == [
        "each measured step ran at 2 x 60 tokens (batch x sequence, at each step's first embedding lookup): "
        "the longest sequence the script keeps (60 tokens, the tokenizer's max_length)"
    ], short["notes"]
    assert not any("was padded" in n for n in short["notes"]), short["notes"]
    # The longest batch's loss upcasts its logits (2 x 512 x 4,096) to float32: at least that much more.
    assert long["peak_allocated_bytes"] - short["peak_allocated_bytes"] >= 2 * (512 - 60) * 4096 * 4, (long, short)


def test_a_script_that_cannot_take_the_padded_batch_answers_with_its_first_step(tmp_path: Path) -> None:
    # The loss is taken outside the model against the batch as the data gave it: the padded
    # step's logits and those labels disagree. The first step's figures stand, said so.
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    script = tmp_path / "outside.py"
    outside = "    logits = model(input_ids=batch['input_ids']).logits\n"
    outside += "    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch['input_ids'].flatten()).backward()\n"
    script.write_text(TRUNCATED.replace('    model(**batch, labels=batch["input_ids"]).loss.backward()\n', outside))
    run = preflight_run(script, args=(str(bare), "512"))
    assert run["steps"] == 1, run
    assert any("failed under preflight after 1 step(s)" in n for n in run["notes"]), run["notes"]
    assert any("did not complete a step (the failure above): the figures are at the data's own lengths" in n for n in run["notes"])


QLORA_AS_ESTIMATED = """
import sys, torch, transformers, peft
q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, quantization_config=q, attn_implementation="sdpa")
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=["k_proj", "o_proj", "q_proj", "v_proj"]))
model.train()  # from_pretrained leaves it in eval mode, where checkpointing is off
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
for _ in range(2):
    ids = torch.randint(0, 4096, (2, 128))
    batch = {"input_ids": ids.to("cuda"), "labels": ids.to("cuda")}
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_estimate_traces_the_model_a_script_makes_from_the_same_config(tmp_path: Path) -> None:
    # `estimate --trace` builds its model with from_pretrained, BitsAndBytesConfig and PEFT, as a
    # QLoRA script does: the same step from the same config-only folder has the same figures.
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")
    pytest.importorskip("peft", reason="PEFT is not installed for this Python")
    bare = _folder(tmp_path, "bare", "llama", LLAMA, weights=False)
    script = tmp_path / "qlora.py"
    script.write_text(QLORA_AS_ESTIMATED)
    run = preflight_run(script, args=(str(bare),))
    flags = ["--batch", "2", "--seq", "128", "--lora-rank", "16", "--load-in-4bit", "--flash-attention", "--grad-checkpointing"]
    p = subprocess.run(
        [OOMKIT, "estimate", "--config", str(bare), "--gpu", "80GiB", *flags, "--trace", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc.get("traced_error") is None, doc["traced_error"]
    traced = doc["traced"]
    for role in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs"):
        assert traced["by_role"][role] == run["by_role"][role], (role, traced["by_role"], run["by_role"])
    # The step's own small tensors beside it (the loss scaled, a counter) differ by a block or two.
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(traced[key] - run[key]) <= 4 * 512, (key, traced[key], run[key])
    assert any(n.startswith("LlamaForCausalLM was built from its config") for n in traced["notes"]), traced["notes"]
    # Nothing but the answer: no progress bar or deprecation warning of the libraries that built the model.
    assert p.stderr == "", p.stderr


#: Inference with the model spread by accelerate over every GPU there is (``device_map="auto"``).
SPREAD_BY_DEVICE_MAP = """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto")
print("placed", sorted(set(getattr(model, "hf_device_map", {}).values())))
with torch.no_grad():
    model(input_ids=torch.randint(0, 4096, (2, 64), device="cuda"))
"""


def test_device_map_auto_over_several_gpus_is_said_to_be_measured_as_one(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama", "llama", LLAMA, weights=False)
    script = tmp_path / "spread.py"
    script.write_text(SPREAD_BY_DEVICE_MAP)
    # The model's weights in bf16, counted from the config: embedding and head, and each layer's
    # attention (query and output 256 x 256, key and value 128 x 256), MLP (3 x 688 x 256) and two norms, and the final norm.
    layer = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 688 * 256 + 2 * 256
    # Beside them, the rotary embedding's two buffers of inverse frequencies (32 float32 each), a 512-byte block each.
    weights = 2 * (2 * 4096 * 256 + 2 * layer + 256) + 2 * 512
    spread = preflight_run(script, "--gpus", "2", args=(str(folder),))
    # accelerate put the layers on both GPUs; the one fake GPU holds all of them, and the note says so.
    assert spread["by_role"]["parameters"] == weights, spread["by_role"]
    assert any(n.startswith("the script put tensors on cuda:0, cuda:1 in one process") for n in spread["notes"]), spread["notes"]
    alone = preflight_run(script, args=(str(folder),))
    assert alone["by_role"]["parameters"] == weights and not any("in one process" in n for n in alone["notes"]), alone["notes"]
