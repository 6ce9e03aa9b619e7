"""Probe the learning of a short GRPO run on the embedded model and the arithmetic task.

Usage: python benchmarks/default_run_probe.py FEW_SHOT TEMPERATURE LEARNING_RATE STEPS [MAX_VALUE [ROWS]]
(ROWS: completions per step, 8 per prompt; default 8.)
Prints one JSON line: the wall time and, per step, (accuracy mean, format mean, total reward).
"""

import json
import sys
import time

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.data.tasks import load_task
from posttrain.rewards.answer import answer_accuracy_reward, answer_format_reward

few_shot, temp, lr, steps = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
max_value = int(sys.argv[5]) if len(sys.argv) > 5 else 50
rows = int(sys.argv[6]) if len(sys.argv) > 6 else 8
ds = load_task("arithmetic", n=1000, seed=0, few_shot=few_shot, max_value=max_value)
args = GRPOConfig(
    output_dir="/tmp/default_run_probe",
    max_steps=steps,
    per_device_train_batch_size=rows,
    num_generations=8,
    max_completion_length=64,
    learning_rate=lr,
    logging_steps=1,
    save_strategy="no",
    gradient_checkpointing=False,
    temperature=temp,
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
)
t0 = time.time()
tr = GRPOTrainer(
    model="smollm2-135m-instruct",
    reward_funcs=[answer_accuracy_reward, answer_format_reward],
    args=args,
    train_dataset=ds,
)
tr.train()
r = [
    (e["rewards/answer_accuracy_reward/mean"], e["rewards/answer_format_reward/mean"], e["reward"])
    for e in tr.state.log_history
    if "reward" in e
]
print("RESULT", json.dumps({"wall": time.time() - t0, "rewards": r}))
