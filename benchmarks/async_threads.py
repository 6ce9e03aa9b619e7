"""How much a training step and a generation batch overlap in two threads of one CPU process.

Usage: python benchmarks/async_threads.py shared|split

A random 6-layer Llama (hidden 512, vocabulary 8000): two AdamW steps on 8 rows of 256 tokens,
and two ``generate`` calls of 48 new tokens for 8 prompts of 64 tokens, first one after the
other (each with the process's threads), then at the same time in two threads, as asynchronous
GRPO runs them. ``split`` gives each thread one intra-op thread (``torch.set_num_threads(1)``
in both); ``shared`` leaves PyTorch's default. Prints the four times.
"""

import sys
import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

mode = sys.argv[1] if len(sys.argv) > 1 else "shared"
torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
)
train_model = LlamaForCausalLM(cfg)
gen_model = LlamaForCausalLM(cfg).eval()
opt = torch.optim.AdamW(train_model.parameters(), lr=1e-5)
ids = torch.randint(0, 8000, (8, 256))
prompt = torch.randint(0, 8000, (8, 64))


def train(n: int, split: bool = False) -> None:
    if split:
        torch.set_num_threads(1)
    for _ in range(n):
        loss = train_model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def gen(n: int, split: bool = False) -> None:
    if split:
        torch.set_num_threads(1)
    with torch.no_grad():
        for _ in range(n):
            gen_model.generate(prompt, max_new_tokens=48, do_sample=True, pad_token_id=0)


start = time.time()
train(2)
t_train = time.time() - start
start = time.time()
gen(2)
t_gen = time.time() - start
start = time.time()
sampler = threading.Thread(target=gen, args=(2, mode == "split"))
sampler.start()
train(2, mode == "split")
sampler.join()
t_both = time.time() - start
print(
    f"{mode}: train {t_train:.1f} s, generate {t_gen:.1f} s, one after the other {t_train + t_gen:.1f} s, "
    f"in two threads {t_both:.1f} s"
)
