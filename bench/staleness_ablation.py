"""Staleness ablation: how each off-policy correction copes with samples k versions old, and
``buffer.max_staleness: auto`` choosing k itself.

On the toy addition task, the tiny Qwen2 (SFT warm start, as in the demo) is trained by GRPO in
plain torch, one optimizer step per batch, with every batch *sampled by the weights of k steps
ago* (``max(0, v - k)`` at step v: a forced, constant staleness, unlike the live system where it
varies). The behaviour logprobs mu come from that stale sampler; the learner's pi_prox is its
current weights. For each k in ``--ks``, each method in ``--methods`` and each seed, it trains a
fixed number of steps and records held-out greedy exact match every ``--eval-every`` steps.

Every run starts from one warm start (SFT with ``--warm-seed``); the seeds (``--seeds``) vary what
RL draws: the prompts, the samples, the order. A seed whose on-policy run never learns makes its
every run noise (an SFT seed whose warm start stays near 0.08 at every k and every method halved
the evidence before), so the seeds are chosen by rule: the first ``--n-seeds`` (3) of the
candidates whose on-policy (k = 0) run gains at least ``--learns`` (0.10) held-out exact match.
At k = 0 mu is pi_theta and every method is the same objective, so k = 0 runs once per seed
(``on_policy``). Each run is kept under ``{out}/runs/`` with its settings and reused when they
match, so the grid can be filled in chunks (``--ks 0 4``, then ``--ks 0 16``, then all for the
summary), each short enough for one turn on a shared machine.

The methods are the learner's own ``compute_policy_loss`` with ``AlgorithmConfig``:

- ``none``: the learner's logprobs stand for mu (stale samples trained as on-policy);
- ``ppo_clip``: the PPO ratio taken against mu and clipped (``correction = behaviour_ppo``);
- ``tis``: truncated IS, weight min(pi_prox / mu, 2) per token;
- ``decoupled``: AReaL's objective, clip around pi_prox, weight pi_prox / mu truncated at 5;
- ``sapo``, ``gmpo``: SAPO's soft gate and GMPO's geometric-mean ratio (clip e^±0.4), their ratio
  taken against mu as their papers take it against the sampler (``behaviour_ppo``);
- ``decoupled_k3``: decoupled, less the sequences whose mean k3 of pi_prox / mu exceeds
  ``--reject-k3`` (``rejection = seq_mean_k3``);
- ``auto``: decoupled, and the sampler's delay chosen step by step by the learner's staleness
  controller (``asyncrl.learner.staleness_control``, the rule of ``buffer.max_staleness: auto``)
  from the same signals (the batch's ESS of pi_prox / mu and k3 KL of its stalest samples),
  within [``--auto-min``, k]: k is the forced delay, the most the pipeline would impose.

Writes ``{out}/staleness_ablation.json``: the commit measured, the seeds and the rule that chose
them (with every tried seed's on-policy gain), under ``"final"`` ``{"k": {"method": [final
accuracy per seed]}}``, under ``"summary"`` their mean, standard deviation, min and max, under
``"auto_vs_fixed"`` auto's mean at the largest k against the best fixed method at that k and
the best fixed (method, k > 0) of the grid, the step
curves under ``"curves"`` (steps in ``"eval_steps"``), each run's mean signals (``"signals"``: ESS
and KL), auto's delay per step (``"auto_delays"``), the settings and timings; and a PNG of the
curves (mean ± std over the seeds).

    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py --jobs 2 --ks 0 16   # ~8 min on 2 cores, then
    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py --jobs 2 --ks 0 4    # then the summary of all:
    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py --jobs 2
    OMP_NUM_THREADS=1 .venv/bin/python bench/staleness_ablation.py --steps 20 --ks 0 16 --methods decoupled auto
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

from asyncrl.benchmarks.provenance import measured_commit  # noqa: E402
from asyncrl.buffer.config import AutoStalenessConfig  # noqa: E402
from asyncrl.learner.advantages import grpo_advantages  # noqa: E402
from asyncrl.learner.batch import collate, token_logprobs  # noqa: E402
from asyncrl.learner.config import AlgorithmConfig  # noqa: E402
from asyncrl.learner.losses import compute_policy_loss  # noqa: E402
from asyncrl.learner.staleness_control import Signals, StalenessController  # noqa: E402
from asyncrl.models.hf_eval import decode_with_cache, evaluate_exact_match  # noqa: E402
from asyncrl.models.sft import SFTConfig, run_sft  # noqa: E402
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from asyncrl.tasks.answers import score_answer  # noqa: E402
from asyncrl.tasks.prompts import TaskConfig, load_prompts
from asyncrl.wire.schema import Group, Sample  # noqa: E402

REJECT_K3 = 0.02
"""seq_mean_k3 threshold of ``decoupled_k3`` (``--reject-k3``)."""


def methods(reject_k3: float = REJECT_K3) -> dict[str, AlgorithmConfig]:
    """Ablation method -> the learner's algorithm settings (GRPO, PPO clip 0.2, token-mean)."""
    return {
        "none": AlgorithmConfig(correction="none"),
        "ppo_clip": AlgorithmConfig(correction="behaviour_ppo"),
        "tis": AlgorithmConfig(correction="tis", is_cap=2.0),
        "decoupled": AlgorithmConfig(correction="decoupled", is_cap=5.0),
        "sapo": AlgorithmConfig(policy_loss="sapo", correction="behaviour_ppo"),
        "gmpo": AlgorithmConfig(policy_loss="gmpo", correction="behaviour_ppo", clip_low=0.4, clip_high=0.4),
        "decoupled_k3": AlgorithmConfig(
            correction="decoupled", is_cap=5.0, rejection="seq_mean_k3", rejection_threshold=reject_k3
        ),
        "auto": AlgorithmConfig(correction="decoupled", is_cap=5.0),
    }


METHODS = list(methods())


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


def auto_config(k: int, args) -> AutoStalenessConfig:
    """The controller's limits for forced delay k: ``buffer.auto_staleness``'s defaults, within
    [``--auto-min``, k] (starting at the default start, or k if lower)."""
    default = AutoStalenessConfig()
    return AutoStalenessConfig(
        min=min(args.auto_min, k),
        max=k,
        start=min(default.start, k),
        ess_min=args.ess_min,
        kl_max=args.kl_max,
        raise_after=args.raise_after,
    )


def batch_signals(lp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, staleness: int) -> Signals:
    """What the learner's step stats give the controller: the ESS of w = pi_prox / mu over the
    response tokens and the k3 KL(mu ‖ pi_prox) per token (one staleness per batch here)."""
    w = (lp.detach() - mu).clamp(-20, 20).exp() * mask  # (B, L-1)
    n = mask.sum().clamp(min=1)
    ess = float(w.sum() ** 2 / (n * w.square().sum()).clamp(min=1e-12))
    kl = float((((w - 1) - (lp.detach() - mu).clamp(-20, 20)) * mask).sum() / n)
    return Signals(ess=ess, kl=kl, staleness_max=staleness)


def train_one(warm_dir: Path, method: str, k: int, seed: int, args, train, test, tokenizer) -> dict:
    """Train ``args.steps`` steps on samples k versions old (under ``auto``: at most k, as the
    controller says); accuracy at each eval step, the mean signals, auto's delay per step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32)
    sampler = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    algo = methods(args.reject_k3)["decoupled" if method == "on_policy" else method]
    control = StalenessController(auto_config(k, args)) if method == "auto" else None
    history = collections.deque([{k_: v.clone() for k_, v in policy.state_dict().items()}], maxlen=k + 1)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    curve = [evaluate_exact_match(policy, tokenizer, test, max_new_tokens=4)]
    delays, signals = [], []
    for step in range(args.steps):
        delay = k if control is None else control.bound
        behaviour_version = max(0, step - delay)
        sampler.load_state_dict(history[-1 - (step - behaviour_version)])  # version behaviour_version
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
        seen = batch_signals(lp, batch.behaviour_logprobs, batch.response_mask, step - behaviour_version)
        signals.append((seen.ess, seen.kl))
        if control is not None:
            control.observe(seen)
            delays.append(delay)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(evaluate_exact_match(policy, tokenizer, test, max_new_tokens=4))
    late = np.array(signals[min(k, len(signals) - 1) :])  # once the delay is reached
    return {
        "curve": curve,
        "final": curve[-1],
        "ess": float(late[:, 0].mean()),
        "kl": float(late[:, 1].mean()),
        "delays": delays,
    }


def run_job(job: tuple) -> tuple:
    """One (seed, k, method) run in a worker process: its key and ``train_one``'s result."""
    seed, k, method, warm, args = job
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    task = TaskConfig()
    train, test = load_prompts(task, "train"), load_prompts(task, "test")[: args.eval_prompts]
    t0 = time.perf_counter()
    out = train_one(Path(warm), method, k, seed, args, train, test, AutoTokenizer.from_pretrained(warm))
    out["seconds"] = time.perf_counter() - t0
    print(
        f"seed {seed} k {k:2d} {method:12s} exact match {out['curve'][0]:.3f} -> {out['final']:.3f}  "
        f"ess {out['ess']:.3f} kl {out['kl']:.4f}  ({out['seconds']:.0f} s)",
        flush=True,
    )
    return (seed, k, method), out


TRAINING_KEYS = (
    "warm_seed",
    "steps",
    "groups",
    "n",
    "lr",
    "eval_every",
    "eval_prompts",
    "reject_k3",
    "auto_min",
    "ess_min",
    "kl_max",
    "raise_after",
)
"""The settings a run's result depends on: a cached run is reused only when all of them match."""


def run_cached(jobs: list[tuple], out: Path, args) -> dict:
    """Each job's result, from ``{out}/runs/`` when a run with the same settings is there, else run
    (``--jobs`` at a time) and stored, so the grid can be filled in chunks, each under its own lock."""
    key = {k: getattr(args, k) for k in TRAINING_KEYS}
    cache = out / "runs"
    cache.mkdir(exist_ok=True)
    path = {job[:3]: cache / f"seed{job[0]}_k{job[1]}_{job[2]}.json" for job in jobs}
    done = {}
    for job in jobs:
        p = path[job[:3]]
        if p.exists() and (stored := json.loads(p.read_text()))["settings"] == key:
            done[job[:3]] = stored["result"]
    todo = [job for job in jobs if job[:3] not in done]
    if args.jobs > 1 and len(todo) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(todo))) as pool:
            ran = list(pool.imap_unordered(run_job, todo))
    else:
        ran = list(map(run_job, todo))
    for name, result in ran:
        path[name].write_text(json.dumps({"settings": key, "result": result}))
        done[name] = result
    return done


def learning_seeds(warm: Path, out: Path, args) -> tuple[list[int], dict]:
    """The first ``--n-seeds`` of ``--seeds`` whose on-policy (k = 0) run gains at least
    ``--learns`` exact match over the warm start (tried ``--jobs`` at a time, in order), and every
    tried seed's on-policy result."""
    tried: dict = {}
    chosen: list[int] = []
    for i in range(0, len(args.seeds), max(1, args.jobs)):
        batch = args.seeds[i : i + max(1, args.jobs)]
        tried.update(run_cached([(s, 0, "on_policy", str(warm), args) for s in batch], out, args))
        chosen = [
            s for s in args.seeds if (s, 0, "on_policy") in tried and gain(tried[(s, 0, "on_policy")]) >= args.learns
        ]
        if len(chosen) >= args.n_seeds:
            return chosen[: args.n_seeds], tried
    raise SystemExit(
        f"only {len(chosen)} of --seeds {args.seeds} learn on-policy (gain >= --learns {args.learns}); "
        f"--n-seeds {args.n_seeds} needs more candidates"
    )


def gain(run: dict) -> float:
    """Held-out exact match gained over the run."""
    return run["final"] - run["curve"][0]


def summarise(values: list[float]) -> dict:
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 4, 16])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=list(range(8)), help="candidate RL seeds, taken in order"
    )
    parser.add_argument("--n-seeds", type=int, default=3, help="seeds kept: the first that learn on-policy")
    parser.add_argument(
        "--learns", type=float, default=0.10, help="a seed learns when its k = 0 run gains this much exact match"
    )
    parser.add_argument("--warm-seed", type=int, default=0, help="seed of the tiny model and its SFT warm start")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the fixed budget)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=300)
    parser.add_argument("--reject-k3", type=float, default=REJECT_K3, help="decoupled_k3's seq_mean_k3 threshold")
    parser.add_argument("--auto-min", type=int, default=1, help="auto: the lowest delay")
    auto = AutoStalenessConfig()
    parser.add_argument("--ess-min", type=float, default=auto.ess_min, help="auto: buffer.auto_staleness.ess_min")
    parser.add_argument("--kl-max", type=float, default=auto.kl_max, help="auto: buffer.auto_staleness.kl_max")
    parser.add_argument(
        "--raise-after", type=int, default=auto.raise_after, help="auto: buffer.auto_staleness.raise_after"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (one core each)")
    parser.add_argument("--out", default="runs/staleness_ablation")
    args = parser.parse_args()
    torch.set_num_threads(1)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = TaskConfig()
    started = time.perf_counter()
    eval_steps = [0] + [s for s in range(1, args.steps + 1) if s % args.eval_every == 0 or s == args.steps]
    warm = out / f"warm{args.warm_seed}"
    if not (warm / "config.json").exists():
        with tempfile.TemporaryDirectory() as tmp:
            base = build_tiny_model(TinyModelConfig(seed=args.warm_seed), Path(tmp) / "base")
            run_sft(base, load_prompts(task, "train"), SFTConfig(seed=args.warm_seed), warm)
    # k = 0: mu is pi_theta, every method is one objective; run once per seed, and it picks the seeds
    seeds, tried = learning_seeds(warm, out, args)
    jobs = [(seed, 0, "on_policy", str(warm), args) for seed in seeds if 0 in args.ks]
    jobs += [(seed, k, m, str(warm), args) for k in args.ks if k > 0 for m in args.methods for seed in seeds]
    done = run_cached(jobs, out, args)
    final: dict = {}
    curves: dict = {}
    signals: dict = {}
    delays: dict = {}
    for seed, k, method, *_ in jobs:
        r = done[(seed, k, method)]
        final.setdefault(str(k), {}).setdefault(method, []).append(r["final"])
        curves.setdefault(str(k), {}).setdefault(method, []).append(r["curve"])
        signals.setdefault(str(k), {}).setdefault(method, []).append({"ess": r["ess"], "kl": r["kl"]})
        if method == "auto":
            delays.setdefault(str(k), []).append(r["delays"])
    summary = {k: {m: summarise(v) for m, v in by_method.items()} for k, by_method in final.items()}
    fixed = [(summary[str(k)][m]["mean"], k, m) for k in args.ks if k > 0 for m in args.methods if m != "auto"]
    verdict = {}
    if fixed and "auto" in args.methods:
        best, best_k, best_m = max(fixed)
        k_max = str(max(args.ks))
        auto_mean = summary[k_max]["auto"]["mean"]
        at_k, at_k_m = max((summary[k_max][m]["mean"], m) for m in args.methods if m != "auto")
        verdict = {
            "auto_at_k": int(k_max),
            "auto_mean": auto_mean,
            "auto_mean_delay": float(np.mean(delays[k_max])),
            # the same forced delay: the fixed methods train on samples k old, auto on at most k old
            "best_fixed_at_k": {"method": at_k_m, "mean": at_k},
            "auto_minus_best_fixed_at_k_by_seed": [a - f for a, f in zip(final[k_max]["auto"], final[k_max][at_k_m])],
            "auto_reaches_best_fixed_at_k": auto_mean >= at_k,
            # any fixed delay k > 0 of the grid
            "best_fixed": {"k": best_k, "method": best_m, "mean": best},
            "auto_reaches_best_fixed": auto_mean >= best,
        }
    result = {
        "commit": measured_commit(),
        "seeds": seeds,
        "seed_rule": f"the first {args.n_seeds} of the candidate RL seeds {args.seeds} whose on-policy (k = 0) run "
        f"gains >= {args.learns} held-out exact match over the warm start",
        "on_policy_gain_by_seed": {str(s): gain(r) for (s, _, _), r in sorted(tried.items())},
        "final": final,
        "summary": summary,
        "auto_vs_fixed": verdict,
        "curves": curves,
        "eval_steps": eval_steps,
        "signals": signals,
        "auto_delays": delays,
        "settings": {**vars(args), "auto": auto_config(max(args.ks), args).model_dump()},
        "seconds": time.perf_counter() - started,
        "run_seconds": sum(r["seconds"] for r in {**tried, **done}.values()),  # each run once
        "note": "one warm start (SFT seed warm_seed); the seeds are RL seeds. k = 0: every method is the same "
        "objective (mu = pi_theta), run once per seed as on_policy. auto: delay chosen per step within "
        "[auto_min, k]. Machine shared with other jobs; runs may come from earlier chunks (runs/ cache).",
    }
    (out / "staleness_ablation.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "staleness_ablation.png")
    for k, by_method in summary.items():
        print(f"k={k:>2}  " + "  ".join(f"{m} {s['mean']:.3f}±{s['std']:.3f}" for m, s in by_method.items()))
    if verdict:
        print(json.dumps({"seeds": seeds, **verdict}))
    print(f"wrote {out / 'staleness_ablation.json'} and .png in {result['seconds']:.0f} s")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(result["curves"])
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.6), sharey=True, squeeze=False)
    on_policy = result["curves"].get("0", {}).get("on_policy")
    for ax, k in zip(axes[0], ks):
        if on_policy and k != "0":  # the on-policy run of the same seeds, for reference
            ax.plot(result["eval_steps"], np.mean(on_policy, axis=0), "k--", lw=1, label="on-policy (k = 0)")
        for method, runs in result["curves"][k].items():
            mean, std = np.mean(runs, axis=0), np.std(runs, axis=0)
            (line,) = ax.plot(result["eval_steps"], mean, label=method, marker="o", ms=3)
            ax.fill_between(result["eval_steps"], mean - std, mean + std, color=line.get_color(), alpha=0.12)
        ax.set_title(f"samples {k} versions old" + (" (auto: at most)" if k != "0" else ""))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out exact match (mean ± std over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
