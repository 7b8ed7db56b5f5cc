"""The entry points that registry packages ship, run unchanged under `oomkit preflight`.

Each is the package's own command (``trl sft``, ``trl dpo``), run as its
documentation says, on a small model made here from a config (random
weights saved locally), a tokenizer made here, and small data sets written
here: nothing is downloaded. Each answer is checked against what can be
worked out by hand from the model: its weights, the optimizer's two
moments (and a fused AdamW's step counter) per trained weight, a LoRA
adapter's weights, DPO's reference copy.
The corpus, with versions, is listed in ``corpus.md`` beside this file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from preflight_cli import OOMKIT, allocator_bytes

transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")

#: TRL's console script, installed beside this Python as pip installs it.
TRL = Path(sys.executable).parent / "trl"

needs_trl = pytest.mark.skipif(
    not TRL.exists() or subprocess.run([sys.executable, "-c", "import trl, peft, datasets"], capture_output=True).returncode != 0,
    reason=f"TRL, PEFT and datasets are not installed beside {sys.executable} (scripts/test.sh installs them)",
)

#: The model: a Llama of 4 layers, grouped keys (8 query heads, 4 key-value heads).
LAYERS, WIDTH, FFN, HEADS, KV_HEADS = 4, 256, 512, 8, 4
WORDS = 500


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal LM saved as a hub model would be, its tokenizer, and two data sets."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("corpus")
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out / "model")
    fast.save_pretrained(out / "model")
    # The same model as a hub repository before its weights are fetched: config and tokenizer only.
    config.save_pretrained(out / "bare")
    fast.save_pretrained(out / "bare")
    (out / "text").mkdir()
    (out / "prefs").mkdir()
    with open(out / "text" / "train.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": " ".join(words[(i * 7 + j) % WORDS] for j in range(120))}) + "\n")
    with open(out / "prefs" / "train.jsonl", "w") as f:
        for i in range(64):
            prompt = " ".join(words[(i + j) % WORDS] for j in range(40))
            chosen = " ".join(words[(i * 3 + j) % WORDS] for j in range(30))
            rejected = " ".join(words[(i * 5 + j) % WORDS] for j in range(30))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return out


def _model(assets: Path) -> Any:
    """The saved model built again from its config, on ``meta`` (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets / "model"))


def _weights(assets: Path) -> int:
    """The model's weights and buffers (the rotary table's) in float32, as the allocator holds them."""
    model = _model(assets)
    return allocator_bytes([*model.parameters(), *model.buffers()])


def _adamw_state(tensors: list[torch.Tensor]) -> int:
    """The Trainer's fused AdamW's state for these weights: two moments each, and a step
    counter each, which the fused kernel keeps on the GPU (a 512-byte block)."""
    return 2 * allocator_bytes(tensors) + 512 * len(tensors)


def _trained(assets: Path) -> int:
    """The state of a full fine-tune's optimizer: every weight trains."""
    return _adamw_state(list(_model(assets).parameters()))


def _trl(assets: Path, *args: str) -> dict[str, Any]:
    """``trl ARGS`` under ``oomkit preflight --json``, offline, from the assets' folder: its answer."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    common = ("--output_dir", "out", "--max_steps", "5", "--report_to", "none", "--save_strategy", "no", "--max_length", "128")
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", str(TRL), *args, *common],
        capture_output=True, text=True, timeout=600, cwd=assets, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout)


@needs_trl
def test_trl_sft_full_fine_tuning(assets: Path) -> None:
    # TRL's launcher runs its SFT script as a child process (accelerate's launcher): that child is measured.
    run = _trl(assets, "sft", "--model_name_or_path", "model", "--dataset_name", "text", "--per_device_train_batch_size", "4")["run"]
    assert run["steps"] == 2 and run["mode"] == "training", run
    assert run["by_role"]["parameters"] == _weights(assets), run["by_role"]
    assert run["by_role"]["optimizer_state"] == _trained(assets), run["by_role"]


@needs_trl
def test_trl_sft_with_lora(assets: Path) -> None:
    run = _trl(
        assets, "sft", "--model_name_or_path", "model", "--dataset_name", "text", "--per_device_train_batch_size", "4",
        "--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj",
    )["run"]  # fmt: skip
    # Adapters A (r x in) and B (out x r) on each query and value projection, float32.
    head_dim = WIDTH // HEADS
    adapters = [torch.empty(8, WIDTH), torch.empty(WIDTH, 8), torch.empty(8, WIDTH), torch.empty(KV_HEADS * head_dim, 8)] * LAYERS
    assert run["by_role"]["parameters"] == _weights(assets) + allocator_bytes(adapters), run["by_role"]
    # Only the adapters train: the optimizer's state is theirs, once made. On a CUDA device TRL
    # scores only the label positions (its Triton log-probability kernels), so the step whose
    # batch holds the most of them peaks, and the first one peaks before any state is made.
    assert run["by_role"]["optimizer_state"] in (0, _adamw_state(adapters)), run["by_role"]


@needs_trl
def test_trl_sft_qlora_from_the_config_alone(assets: Path) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")
    assert not [f for f in os.listdir(assets / "bare") if f.endswith((".safetensors", ".bin"))]
    run = _trl(
        assets, "sft", "--model_name_or_path", "bare", "--dataset_name", "text", "--per_device_train_batch_size", "4",
        "--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj", "--load_in_4bit",
    )["run"]  # fmt: skip
    assert run["steps"] == 2, run
    # The linear layers in NF4 (two weights a byte, an fp32 scale per 64, each weight's 16-value code book);
    # the embedding, the head and the norms in float32 (TRL's default dtype); the adapters in bf16, to which
    # TRL's SFTTrainer converts them for a quantized model, as the QLoRA paper recommends.
    model = _model(assets)
    linear = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    nf4 = sum(-(-w.numel() // 2 // 512) * 512 + -(-(w.numel() // 64 * 4) // 512) * 512 + 512 for w in linear)
    rest = allocator_bytes([p for p in model.parameters() if not any(p is w for w in linear)] + list(model.buffers()))
    head_dim = WIDTH // HEADS
    shapes = [(8, WIDTH), (WIDTH, 8), (8, WIDTH), (KV_HEADS * head_dim, 8)] * LAYERS
    adapters = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
    assert run["by_role"]["parameters"] == nf4 + rest + allocator_bytes(adapters), (run["by_role"], nf4, rest)
    assert any("LlamaForCausalLM was built from its config; no weight file was read" in n for n in run["notes"]), run["notes"]


@needs_trl
def test_trl_dpo(assets: Path) -> None:
    run = _trl(assets, "dpo", "--model_name_or_path", "model", "--dataset_name", "prefs", "--per_device_train_batch_size", "2")["run"]
    assert run["steps"] == 2, run
    # The policy and its frozen reference copy, and the policy's moments.
    assert run["by_role"]["parameters"] == 2 * _weights(assets), run["by_role"]
    assert run["by_role"]["optimizer_state"] == _trained(assets), run["by_role"]


LIGHTNING_DEMO = """
import lightning as L
from torch.utils.data import DataLoader
from lightning.pytorch.demos import WikiText2
from lightning.pytorch.demos.transformer import LightningTransformer

dataset = WikiText2()  # ./data/wikitext-2.txt is there: nothing is downloaded
model = LightningTransformer(vocab_size=dataset.vocab_size)
trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(model, DataLoader(dataset, batch_size=16))
"""


def test_lightnings_transformer_demo_through_its_trainer(tmp_path: Path) -> None:
    # Lightning's shipped demo (its LightningModule, model and data set) trained by its Trainer,
    # whose automatic optimization runs forward and backward in a closure the optimizer's step calls.
    pytest.importorskip("lightning", reason="lightning is not installed for this Python")
    from lightning.pytorch.demos.transformer import LightningTransformer, PositionalEncoding

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "wikitext-2.txt").write_text("".join(f"w{i % 97} w{i % 89} w{i % 83} w{i % 7}\n" for i in range(600)))
    (tmp_path / "train.py").write_text(LIGHTNING_DEMO)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", sys.executable, "train.py"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2 and run["forwards"] == 2 and run["mode"] == "training", run
    vocab = len({w for line in (tmp_path / "data" / "wikitext-2.txt").read_text().splitlines() for w in line.split()}) + 1  # and <eos>
    with torch.device("meta"):
        weights = list(LightningTransformer(vocab_size=vocab).parameters())
        table = PositionalEncoding(200)._init_pos_encoding(device=torch.device("meta"))  # built by the first forward and kept
    # So is the model's causal mask over the data set's 35-token blocks (``src_mask``).
    mask = torch.empty(35, 35)
    assert run["by_role"]["parameters"] == allocator_bytes(weights) + allocator_bytes([table, mask]), run["by_role"]
    assert run["by_role"]["gradients"] == allocator_bytes(weights), run["by_role"]
    # Plain SGD keeps no state.
    assert run["by_role"]["optimizer_state"] == 0, run["by_role"]
    # The closure's forward is the step's forward: what it saves for backward is activations.
    assert run["by_role"]["activations"] > 10 * run["by_role"]["temporaries"], run["by_role"]


#: A classifier trained as accelerate's example scripts train (in this project's words): the
#: Accelerator's bf16 mixed precision and gradient accumulation, ``prepare``, ``accumulate``,
#: ``backward``, and an evaluation gathered for its metric.
ACCELERATE_SCRIPT = """
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(gradient_accumulation_steps=2)  # bf16 comes from `accelerate launch`
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
train = DataLoader(TensorDataset(torch.randn(256, 512), torch.randint(0, 10, (256,))), batch_size=32, shuffle=True)
evaluate = DataLoader(TensorDataset(torch.randn(64, 512), torch.randint(0, 10, (64,))), batch_size=32)
model, opt, train, evaluate = accelerator.prepare(model, opt, train, evaluate)
for epoch in range(2):
    model.train()
    for x, y in train:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    model.eval()
    correct = 0
    for x, y in evaluate:
        with torch.no_grad():
            guesses, labels = accelerator.gather_for_metrics((model(x).argmax(-1), y))
        correct += (guesses == labels).sum().item()
    accelerator.print(f"epoch {epoch}: accuracy {correct / 64:.3f}")
"""


def test_an_accelerate_script_through_accelerate_launch(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed for this Python")
    (tmp_path / "train.py").write_text(ACCELERATE_SCRIPT)
    # `accelerate launch`, as its console script runs it (the module is the command's entry point).
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--fixes", "--capacity", "24GiB", "--",
         sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "bf16", "train.py"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=dict(os.environ, ACCELERATE_USE_CPU="false"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads(p.stdout)
    run = doc["run"]
    # Two backward passes per optimizer step: the Accelerator's accumulation, measured.
    assert run["steps"] == 2 and run["grad_accum"] == 2 and run["mode"] == "training", run
    weights = list(torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 10)).parameters())
    assert run["by_role"]["parameters"] == allocator_bytes(weights), run["by_role"]
    # AdamW on CUDA takes its foreach kernels: two moments per weight, the step counters on the host.
    assert run["by_role"]["optimizer_state"] == 2 * allocator_bytes(weights), run["by_role"]
    rows = {row["change"]: row for row in doc["fixes"]}
    # `--mixed_precision bf16` is autocast around the forward: a row saying so, not a change.
    autocast = rows["bf16 autocast around the model's forward"]
    assert autocast["already"] == "the script already runs its model's forward under bfloat16 autocast", autocast


needs_litgpt = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import litgpt.__main__, jsonargparse"], capture_output=True).returncode != 0,
    reason=f"LitGPT and jsonargparse are not installed beside {sys.executable} (scripts/test.sh installs them)",
)

#: LitGPT's model: Pythia's smallest shape with two layers and a vocabulary padded to the tokenizer's.
LIT_LAYERS, LIT_VOCAB = 2, 512


@pytest.fixture(scope="module")
def lit_assets(assets: Path) -> Path:
    """A LitGPT checkpoint folder (its config, random weights, the tokenizer made above) and an instruction data set."""
    import shutil

    from litgpt import GPT, Config
    from litgpt.utils import save_config

    out = assets / "lit"
    (out / "ckpt").mkdir(parents=True)
    config = Config.from_name("pythia-14m", n_layer=LIT_LAYERS, vocab_size=WORDS + 4, padded_vocab_size=LIT_VOCAB)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), out / "ckpt" / "lit_model.pth")
    save_config(config, out / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets / "model" / name, out / "ckpt" / name)
    words = [f"w{i}" for i in range(WORDS)]
    rows = [
        {"instruction": " ".join(words[(i * 3 + j) % WORDS] for j in range(20)), "input": "",
         "output": " ".join(words[(i * 7 + j) % WORDS] for j in range(30))}
        for i in range(64)
    ]  # fmt: skip
    (out / "data.json").write_text(json.dumps(rows))
    return out


def _litgpt(lit_assets: Path, command: str, *args: str, checkpoint: str = "ckpt", data: str = "data.json") -> tuple[dict[str, Any], int]:
    """``python -m litgpt COMMAND ckpt`` on the instruction data, in bf16, under ``oomkit preflight --json``: its
    run, and the longest sequence LitGPT found in the data (its rotary tables are made that long)."""
    common = (
        "--data", "JSON", "--data.json_path", data, "--data.val_split_fraction", "0.1",
        "--train.max_steps", "2", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--eval.interval", "1000", "--eval.initial_validation", "false", "--eval.final_validation", "false",
        "--precision", "bf16-true", "--devices", "1", "--out_dir", f"out_{command}",
    )  # fmt: skip
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", sys.executable, "-m", "litgpt", command, checkpoint, *common, *args],
        capture_output=True, text=True, timeout=600, cwd=lit_assets, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    found = re.search(r"longest sequence length in the train data is (\d+)", p.stderr)
    assert found, p.stderr[-4000:]
    return json.loads(p.stdout)["run"], int(found.group(1))


def _lit_kept(lit_assets: Path, longest: int) -> list[torch.Tensor]:
    """What LitGPT's model keeps beside its weights: the rotary cosines and sines, float32, as long as the longest sequence."""
    model = _lit_model(lit_assets)
    return [torch.empty(longest, model.cos.shape[-1])] * 2


def _lit_model(lit_assets: Path) -> Any:
    """LitGPT's model of the checkpoint, in bf16 (``--precision bf16-true``), on ``meta``."""
    from litgpt import GPT, Config

    with torch.device("meta"):
        return GPT(Config.from_file(lit_assets / "ckpt" / "model_config.yaml")).to(torch.bfloat16)


@needs_litgpt
def test_litgpt_finetune_full(lit_assets: Path) -> None:
    # Fabric refuses an optimizer over parameters that say they are on meta: the fake GPU's say cuda.
    run, longest = _litgpt(lit_assets, "finetune_full")
    weights = list(_lit_model(lit_assets).parameters())
    kept = allocator_bytes(_lit_kept(lit_assets, longest))
    assert run["by_role"]["parameters"] == allocator_bytes(weights) + kept, run["by_role"]
    assert run["by_role"]["gradients"] == allocator_bytes(weights), run["by_role"]
    # AdamW's two moments per weight, in the weights' bf16 (its step counters are on the host).
    assert run["by_role"]["optimizer_state"] == 2 * allocator_bytes(weights), run["by_role"]


@needs_litgpt
@pytest.mark.parametrize("checkpoint", ["ckpt", "bare"])
def test_litgpt_finetune_lora(lit_assets: Path, checkpoint: str) -> None:
    if checkpoint == "bare":
        # The folder as it is before its weights are converted: config and tokenizer, no lit_model.pth.
        import shutil

        shutil.copytree(lit_assets / "ckpt", lit_assets / "bare", ignore=shutil.ignore_patterns("lit_model.pth"), dirs_exist_ok=True)
    run, longest = _litgpt(lit_assets, "finetune_lora", "--lora_r", "8", checkpoint=checkpoint)
    if checkpoint == "bare":
        assert any(n.startswith("LitGPT's checkpoint bare/lit_model.pth is not there") for n in run["notes"]), run["notes"]
    weights = list(_lit_model(lit_assets).parameters())
    kept = allocator_bytes(_lit_kept(lit_assets, longest))
    # LitGPT's defaults adapt the fused query-key-value projection: A (r x in) and B (3 x width x r) per layer, bf16.
    width = weights[0].shape[1]
    adapters = [torch.empty(8, width, dtype=torch.bfloat16), torch.empty(3 * width, 8, dtype=torch.bfloat16)] * LIT_LAYERS
    # Each adapted projection keeps the indices of the outputs it adapts (queries' and values'), int64, built on its first forward.
    indices = [torch.empty(2 * width, dtype=torch.int64)] * LIT_LAYERS
    expected = allocator_bytes(weights) + allocator_bytes(adapters) + allocator_bytes(indices) + kept
    assert run["by_role"]["parameters"] == expected, run["by_role"]
    assert run["by_role"]["gradients"] == allocator_bytes(adapters), run["by_role"]
    assert run["by_role"]["optimizer_state"] == 2 * allocator_bytes(adapters), run["by_role"]
    # The checkpoint Fabric loads lazily is read through meta tensors of its own: no device memory.
    assert not [line for line in run["by_line"] if "load.py" in line["line"]], run["by_line"]


needs_litdata = pytest.mark.skipif(
    importlib.util.find_spec("litdata") is None,
    reason=f"litdata, which LitGPT's pretrain prepares and streams its data with, is not installed beside {sys.executable} (scripts/test.sh installs it)",
)


@needs_litgpt
@needs_litdata
def test_litgpt_pretrain(lit_assets: Path) -> None:
    # LitGPT's pretrain on plain text files: litdata tokenizes them into chunks (worker processes of
    # its own) and streams fixed-length blocks; the model is compiled, AdamW fused on a CUDA device.
    words = [f"w{i}" for i in range(WORDS)]
    (lit_assets / "text").mkdir()
    for k in range(3):
        lines = (" ".join(words[(i * 7 + j + k) % WORDS] for j in range(120)) for i in range(32))
        (lit_assets / "text" / f"part{k}.txt").write_text("\n".join(lines))
    seq = 64
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", sys.executable, "-m", "litgpt", "pretrain",
         "pythia-14m", "--model_config", "ckpt/model_config.yaml", "--tokenizer_dir", "ckpt",
         "--data", "TextFiles", "--data.train_data_path", "text", "--data.num_workers", "2",
         "--train.max_steps", "2", "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
         "--train.max_seq_length", str(seq), "--train.lr_warmup_steps", "1", "--logger_name", "csv",
         "--eval.interval", "1000", "--eval.final_validation", "false",
         "--precision", "bf16-true", "--devices", "1", "--out_dir", "out_pretrain"],
        capture_output=True, text=True, timeout=600, cwd=lit_assets, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    run = json.loads(p.stdout)["run"]
    # Two optimizer steps of two micro-batches each, after its sanity check's two forwards without gradients.
    assert (run["steps"], run["forwards"], run["grad_accum"]) == (2, 6, 2), run
    model = _lit_model(lit_assets)
    weights = list(model.parameters())
    # The rotary tables are remade at --train.max_seq_length, then made bf16 with the model by Fabric.
    kept = [torch.empty(seq, model.cos.shape[-1], dtype=torch.bfloat16)] * 2
    assert run["by_role"]["parameters"] == allocator_bytes(weights) + allocator_bytes(kept), run["by_role"]
    assert run["by_role"]["gradients"] == allocator_bytes(weights), run["by_role"]
    # Fused AdamW: two moments per weight, and each weight's step count, a float32 on the device.
    steps = [torch.empty((), dtype=torch.float32)] * len(weights)
    assert run["by_role"]["optimizer_state"] == 2 * allocator_bytes(weights) + allocator_bytes(steps), run["by_role"]
    # Lightning counts the FLOPs on a copy of the model on meta: no memory, no cuBLAS workspace of its own.
    assert not [line for line in run["by_line"] if "throughput.py" in line["line"]], run["by_line"]


@needs_litgpt
def test_litgpt_runs_its_steps_at_its_datas_longest_sequence(lit_assets: Path) -> None:
    # LitGPT sets model.max_seq_length to its train data's longest sequence and pads each batch only
    # to its own longest, in data loader workers: the first batches here are short, one row is long.
    words = [f"w{i}" for i in range(WORDS)]

    def row(i: int, n: int) -> dict[str, str]:
        return {"instruction": " ".join(words[(i * 3 + j) % WORDS] for j in range(n)), "input": "",
                "output": " ".join(words[(i * 7 + j) % WORDS] for j in range(n))}  # fmt: skip

    rows = [row(i, 4) for i in range(63)]
    rows.insert(40, row(99, 60))
    (lit_assets / "varied.json").write_text(json.dumps(rows))
    run, longest = _litgpt(lit_assets, "finetune_lora", "--lora_r", "8", data="varied.json")
    ran = next(n for n in run["notes"] if n.startswith("the measured steps ran at"))
    steps = [int(t) for _, t in re.findall(r"(\d+) x (\d+)", ran.split("(")[0])]
    # The first step at the data's own lengths, shorter than its longest row; the second padded to it.
    assert len(steps) == 2 and steps[0] < longest and steps[1] == longest, (ran, longest)
    padded = next(n for n in run["notes"] if n.startswith("after the first forward, each training batch was padded"))
    assert f"({longest} tokens, LitGPT's model.max_seq_length)" in padded, padded
    own = re.search(r"where its data's own were up to (\d+)", padded)
    assert own and int(own.group(1)) < longest, padded
