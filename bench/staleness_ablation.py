"""Staleness ablation: how each off-policy correction copes with samples k versions old.

On the toy addition task, the tiny Qwen2 (SFT warm start, as in the demo) is trained by GRPO in
plain torch, one optimizer step per batch, with every batch *sampled by the weights of k steps
ago* (``max(0, v - k)`` at step v: a forced, constant staleness, unlike the live system where it
varies). The behaviour logprobs mu come from that stale sampler; the learner's pi_prox is its
current weights. For each k in ``--ks``, each method in ``--methods`` and each seed, it trains a
fixed number of steps and records held-out greedy exact match every ``--eval-every`` steps.

The methods are the learner's own ``compute_policy_loss`` with ``AlgorithmConfig``:

- ``none``: the learner's logprobs stand for mu (stale samples trained as on-policy);
- ``ppo_clip``: the PPO ratio taken against mu and clipped (``correction = behaviour_ppo``);
- ``tis``: truncated IS, weight min(pi_prox / mu, 2) per token;
- ``decoupled``: AReaL's objective, clip around pi_prox, weight pi_prox / mu truncated at 5.

Writes ``{out}/staleness_ablation.json``: ``{"k": {"method": [final accuracy per seed]}}`` under
``"final"``, the step curves under ``"curves"`` (``{"k": {"method": [[acc at each eval] per
seed]}}``, steps in ``"eval_steps"``), the settings and timings; and a PNG of the curves.

    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py            # ~10 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py --steps 20 --ks 0 16 --seeds 0
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.learner.advantages import grpo_advantages  # noqa: E402
from asyncrl.learner.batch import collate, token_logprobs  # noqa: E402
from asyncrl.learner.config import AlgorithmConfig  # noqa: E402
from asyncrl.learner.losses import compute_policy_loss  # noqa: E402
from asyncrl.models.hf_eval import decode_with_cache, evaluate_exact_match  # noqa: E402
from asyncrl.models.sft import SFTConfig, run_sft  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.tasks.answers import score_answer  # noqa: E402
from asyncrl.tasks.prompts import TaskConfig, load_prompts
from asyncrl.wire.schema import Group, Sample  # noqa: E402

METHODS = {
    "none": AlgorithmConfig(correction="none"),
    "ppo_clip": AlgorithmConfig(correction="behaviour_ppo"),
    "tis": AlgorithmConfig(correction="tis", is_cap=2.0),
    "decoupled": AlgorithmConfig(correction="decoupled", is_cap=5.0),
}
"""Ablation method -> the learner's algorithm settings (GRPO, PPO clip 0.2, token-mean)."""


@torch.no_grad()
def sample_groups(
    model, tokenizer, prompts, n: int, max_tokens: int, version: int, gen: torch.Generator
) -> list[Group]:
    """n answers per prompt sampled at temperature 1 with a KV cache; behaviour logprobs recorded."""
    model.eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    rows = [ids for ids in prompt_ids for _ in range(n)]
    logps = []

    def sample(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,), its logprob kept
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        next_ids = torch.multinomial(logprobs.exp(), 1, generator=gen).squeeze(1)
        logps.append(logprobs.gather(1, next_ids[:, None]).squeeze(1))
        return next_ids

    tokens_t, alive_t = decode_with_cache(model, rows, max_tokens, eos, pad, sample)  # (B, T)
    logps_t = torch.stack(logps, 1)  # (B, T)
    groups = []
    for g, prompt in enumerate(prompts):
        samples = []
        for i in range(n):
            b = g * n + i
            keep = alive_t[b]
            ids = tokens_t[b][keep].numpy().astype(np.int32)
            text = tokenizer.decode([t for t in ids.tolist() if t != eos], skip_special_tokens=True)
            samples.append(
                Sample(
                    f"{g}/{i}",
                    ids,
                    logps_t[b][keep].numpy().astype(np.float32),
                    text,
                    "stop" if eos in ids else "length",
                    score_answer(prompt.task, text, prompt.answer),
                )
            )
        groups.append(
            Group(
                f"{version}/{g}",
                prompt.prompt_uid,
                prompt.task,
                prompt.text,
                prompt.answer,
                np.asarray(prompt_ids[g], dtype=np.int32),
                version,
                "bench",
                samples,
            )
        )
    return groups


def train_one(
    warm_dir: Path, method: str, k: int, seed: int, args, train, test, tokenizer
) -> tuple[list[float], float]:
    """Train ``args.steps`` steps on samples k versions old; accuracy at each eval step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32)
    sampler = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    algo = METHODS[method]
    history = collections.deque([{k_: v.clone() for k_, v in policy.state_dict().items()}], maxlen=k + 1)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    curve = [evaluate_exact_match(policy, tokenizer, test, max_new_tokens=4)]
    for step in range(args.steps):
        behaviour_version = max(0, step - k)
        sampler.load_state_dict(history[0])  # the oldest kept: version step - k (or 0)
        prompts = [train[i] for i in rng.choice(len(train), size=args.groups, replace=False)]
        groups = sample_groups(sampler, tokenizer, prompts, args.n, 4, behaviour_version, gen)
        rewards = np.array([[s.reward for s in g.samples] for g in groups], dtype=np.float32)
        batch = collate(groups, grpo_advantages(rewards), tokenizer.pad_token_id)
        policy.train()
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = token_logprobs(logits, batch.input_ids)  # (B, L-1)
        loss, _ = compute_policy_loss(
            lp, lp.detach(), batch.behaviour_logprobs, batch.advantages, batch.response_mask, algo
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        history.append({k_: v.detach().clone() for k_, v in policy.state_dict().items()})
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(evaluate_exact_match(policy, tokenizer, test, max_new_tokens=4))
    return curve, curve[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 4, 16])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (the fixed budget)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=300)
    parser.add_argument("--out", default="runs/staleness_ablation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = TaskConfig()
    train, test = load_prompts(task, "train"), load_prompts(task, "test")[: args.eval_prompts]
    started = time.perf_counter()
    final: dict = {str(k): {m: [] for m in args.methods} for k in args.ks}
    curves: dict = {str(k): {m: [] for m in args.methods} for k in args.ks}
    eval_steps = [0] + [s for s in range(1, args.steps + 1) if s % args.eval_every == 0 or s == args.steps]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            base = build_tiny_model(TinyModelConfig(seed=seed), Path(tmp) / f"base{seed}")
            warm = Path(tmp) / f"warm{seed}"
            run_sft(base, load_prompts(task, "train"), SFTConfig(seed=seed), warm)
            tokenizer = AutoTokenizer.from_pretrained(warm)
            for k in args.ks:
                for method in args.methods:
                    t0 = time.perf_counter()
                    curve, acc = train_one(warm, method, k, seed, args, train, test, tokenizer)
                    final[str(k)][method].append(acc)
                    curves[str(k)][method].append(curve)
                    print(
                        f"seed {seed} k {k:2d} {method:10s} exact match {curve[0]:.3f} -> {acc:.3f}  "
                        f"({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    result = {
        **final,
        "final": final,
        "curves": curves,
        "eval_steps": eval_steps,
        "settings": vars(args),
        "seconds": time.perf_counter() - started,
    }
    (out / "staleness_ablation.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "staleness_ablation.png")
    for k in args.ks:
        print(f"k={k:2d}  " + "  ".join(f"{m} {np.mean(final[str(k)][m]):.3f}" for m in args.methods))
    print(f"wrote {out / 'staleness_ablation.json'} and .png in {result['seconds']:.0f} s")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(result["curves"])
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        for method, runs in result["curves"][k].items():
            ax.plot(result["eval_steps"], np.mean(runs, axis=0), label=method, marker="o", ms=3)
        ax.set_title(f"samples {k} versions old")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out exact match (mean over seeds)")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
