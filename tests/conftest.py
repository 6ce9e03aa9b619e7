"""Shared fixtures: a tiny causal LM and tokenizer built from configs, offline, in seconds."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # README's `pytest -n auto`: the workers share the cores, one torch thread each (a worker
    # with the default of one thread per core ran its steps several times slower), and the
    # subprocesses they start inherit it.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

#: Memory one pytest-xdist worker may need at its peak (the tests that load the embedded model).
WORKER_MEMORY = 3 << 30


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU this process may run on, as many as memory holds.

    xdist's own ``auto`` counts physical cores (1 on a 2-vCPU machine whose vCPUs are one core's
    two threads) and ignores the CPU affinity a container sets.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return cpus
    return max(1, min(cpus, memory // WORKER_MEMORY))


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "What is 2 + 3? <answer>5</answer>",
    "The sky is blue and the sun is bright.",
    "Write a short story about a cat who learns arithmetic.",
    "one two three four five six seven eight nine ten",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>",
] * 20


#: Sizes of the tiny decoders the tests build from configs (about 30k parameters with a 320 vocabulary).
TINY_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer, seed: int = 0):
    """A 2-layer Llama with hidden size 32 (about 30k parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder with a tiny model and tokenizer saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
