"""Greedy evaluation: padding-independent, deterministic, and scoring with the task's rule."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.hf_eval import evaluate_exact_match, generate_responses, greedy_generate, left_padded
from asyncrl.models.sft import SFTConfig, run_sft
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
from asyncrl.tasks.prompts import Prompt, TaskConfig, load_prompts


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    """The tiny model after overfitting 16 addition prompts (a few seconds on one core)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("eval")
    base = build_tiny_model(TinyModelConfig(), root / "base")
    prompts = load_prompts(TaskConfig(), "train")[:16]
    run_sft(base, prompts, SFTConfig(steps=80, batch_size=16, lr=3e-3, warmup_steps=5), root / "sft")
    return root / "sft", prompts


def test_left_padded():
    input_ids, attention_mask = left_padded([[5, 6, 7], [8]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_memorized_prompts_are_answered(memorized):
    model_dir, prompts = memorized
    assert evaluate_exact_match(model_dir, None, prompts) > 0.5


def test_deterministic_and_batch_size_independent(memorized):
    model_dir, prompts = memorized
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    held_out = load_prompts(TaskConfig(), "test")[:40]
    first = generate_responses(model, tokenizer, held_out, max_new_tokens=4, batch_size=40)
    assert generate_responses(model, tokenizer, held_out, max_new_tokens=4, batch_size=40) == first
    assert generate_responses(model, tokenizer, held_out, max_new_tokens=4, batch_size=7) == first
    assert evaluate_exact_match(model, tokenizer, held_out) == evaluate_exact_match(model, tokenizer, held_out)


def test_left_padding_gives_the_unpadded_answer(memorized):
    model_dir, _ = memorized
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    short, long = ids("07+45="), ids("Question: 07+45=")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    alone = [greedy_generate(model, [p], 4, eos, pad)[0] for p in (short, long)]
    assert greedy_generate(model, [short, long], 4, eos, pad) == alone


def test_scores_with_the_task_rule(memorized):
    model_dir, prompts = memorized
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accuracy = evaluate_exact_match(model, tokenizer, prompts)
    # "52.0" is the same number as "52" (gsm8k compares numbers) but not the same string (addition).
    decimal = lambda task: [Prompt(p.prompt_uid, p.text, p.answer + ".0", task) for p in prompts]  # noqa: E731
    assert evaluate_exact_match(model, tokenizer, decimal("gsm8k")) == accuracy
    assert evaluate_exact_match(model, tokenizer, decimal("addition")) == 0.0


def test_rejects_bad_arguments(memorized):
    model_dir, prompts = memorized
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"max_new_tokens \(0\)"):
        evaluate_exact_match(model_dir, None, prompts, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"tokenizer \(None\)"):
        evaluate_exact_match(model, None, prompts)


@pytest.mark.slow
def test_default_sft_leaves_partial_accuracy(tmp_path):
    """The demo's calibration: default SFT of the seed-0 model lands mid-way through its jump
    (0.51 measured), leaving RL room to gain (tests/integration/test_learns.py)."""
    torch.set_num_threads(1)
    base = build_tiny_model(TinyModelConfig(), tmp_path / "base")
    task = TaskConfig()
    run_sft(base, load_prompts(task, "train"), SFTConfig(), tmp_path / "sft")
    accuracy = evaluate_exact_match(tmp_path / "sft", None, load_prompts(task, "test"))
    assert 0.15 <= accuracy <= 0.7, accuracy
