"""Build a small random LLaMA and a byte-level BPE tokenizer on this machine, with no model hub.

The result is a Hugging Face model directory that vLLM (CPU or GPU) serves like any other: tests and
local mode use the default 2-layer model; the migration benchmark uses the `7b-like` preset (hidden
1024, 4 layers, 16 heads, 2 KV heads: ~45M parameters with a LLaMA-7B-like layer shape). The same
recipe and seed give the same weights and tokenizer, so a directory can be cached by recipe hash.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:  # transformers is imported only when a model is built
    from transformers import LlamaConfig, PreTrainedTokenizerFast

RECIPE_FILE = "llumnix_recipe.json"
# Bump when the build code changes what a recipe produces, so cached directories are rebuilt.
BUILD_FORMAT = 1
# CPU attention in vLLM supports these head sizes only (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, my name is vLLM and I run on a CPU.",
    "Live migration moves the KV cache of a request between engines.",
    "Llumnix schedules requests across instances of an LLM serving system.",
    "once upon a time there was a tiny model with random weights",
    "0123456789 +-*/=()[]{}<>.,;:!?'\" \n\t",
)
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@dataclasses.dataclass(frozen=True)
class TinyModelRecipe:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    # None: LLaMA's rule, 8/3 * hidden rounded up to a multiple of 256 (4096 -> 11008).
    intermediate: int | None = None
    max_position_embeddings: int = 2048
    vocab_size: int = 512
    dtype: str = "float32"
    seed: int = 0
    # Random weights scaled up so that greedy decoding does not collapse onto one token.
    init_scale: float = 4.0

    def __post_init__(self) -> None:
        problems = []
        if self.heads % self.kv_heads:
            problems.append(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim not in CPU_HEAD_DIMS:
            problems.append(
                f"head_dim {self.head_dim} is not one of vLLM's CPU attention sizes {CPU_HEAD_DIMS}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"dtype {self.dtype!r} is not float32, bfloat16 or float16")
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.max_position_embeddings) < 1:
            problems.append("layers, hidden, heads, kv_heads and max_position_embeddings must be positive")
        if self.vocab_size < 300:
            problems.append("vocab_size must be at least 300 (256 bytes + specials + merges)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def intermediate_size(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return -(-(8 * self.hidden // 3) // 256) * 256

    def digest(self) -> str:
        payload = json.dumps({"format": BUILD_FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


PRESETS: dict[str, TinyModelRecipe] = {
    "test": TinyModelRecipe(),
    "7b-like": TinyModelRecipe(layers=4, hidden=1024, heads=16, kv_heads=2, head_dim=64),
}


def build_tokenizer(out_dir: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer (at most `vocab_size` entries) in memory; save it to `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(_CORPUS) * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def llama_config(recipe: TinyModelRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The Hugging Face LLaMA configuration of `recipe` with `tokenizer`'s vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def build_tiny_model(out_dir: Path, recipe: TinyModelRecipe, progress: bool = False) -> dict[str, object]:
    """Write the model, tokenizer and `llumnix_recipe.json` into `out_dir`; returns the recipe record."""
    import torch
    from transformers import LlamaForCausalLM

    steps = tqdm(total=3, desc="tiny model", unit="step", disable=not progress)
    out_dir.mkdir(parents=True, exist_ok=True)

    steps.set_postfix_str("tokenizer")
    tokenizer = build_tokenizer(out_dir, recipe.vocab_size)
    steps.update()

    steps.set_postfix_str("weights")
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(llama_config(recipe, tokenizer))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(recipe.init_scale)
    model = model.to(getattr(torch, recipe.dtype))
    steps.update()

    steps.set_postfix_str("save")
    model.save_pretrained(out_dir, safe_serialization=True)
    record = {
        "digest": recipe.digest(),
        "format": BUILD_FORMAT,
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }
    (out_dir / RECIPE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    steps.update()
    steps.close()
    return record


def read_recipe_record(model_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((model_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None


def ensure_tiny_model(cache_root: Path, recipe: TinyModelRecipe) -> Path:
    """The model for `recipe` under `cache_root/<digest>`, built there first if missing or stale.

    Built in a sibling temporary directory and renamed into place, so a concurrent or interrupted
    build never leaves a half-written model where a reader would take it for a complete one.
    """
    target = cache_root / f"llama-{recipe.digest()}"
    record = read_recipe_record(target)
    if record is not None and record.get("digest") == recipe.digest():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_root))
    try:
        build_tiny_model(staging, recipe)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyModelRecipe()
    parser.add_argument("dir", type=Path, help="output directory (created; model files are overwritten)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="test",
                        help="starting shape; the options below override it (default: test)")
    parser.add_argument("--layers", type=int, help=f"decoder layers (test: {defaults.layers})")
    parser.add_argument("--hidden", type=int, help=f"hidden size (test: {defaults.hidden})")
    parser.add_argument("--heads", type=int, help=f"attention heads (test: {defaults.heads})")
    parser.add_argument("--kv-heads", type=int, help=f"key/value heads (test: {defaults.kv_heads})")
    parser.add_argument("--head-dim", type=int,
                        help=f"head size, one of {CPU_HEAD_DIMS} for CPU vLLM (test: {defaults.head_dim})")
    parser.add_argument("--intermediate", type=int, help="MLP size (default: LLaMA's 8/3 * hidden rule)")
    parser.add_argument("--max-position-embeddings", type=int,
                        help=f"longest sequence (test: {defaults.max_position_embeddings})")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (float32)")
    parser.add_argument("--seed", type=int, help="random seed (0)")


def recipe_from_args(args: argparse.Namespace) -> TinyModelRecipe:
    overrides = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(TinyModelRecipe)
        if getattr(args, field.name, None) is not None
    }
    return dataclasses.replace(PRESETS[args.preset], **overrides)


def run(args: argparse.Namespace) -> int:
    try:
        recipe = recipe_from_args(args)
    except ValueError as exc:
        print(f"llumnix make-tiny-model: {exc}", file=sys.stderr)
        return 2
    record = build_tiny_model(args.dir, recipe, progress=True)
    print(f"wrote {args.dir}: {record['parameters']:,} parameters, vocab {record['vocab_size']}, "
          f"recipe {record['digest']}")
    return 0
