"""SFT batches mask the prompt (and, for episodes, every token out of the loss mask), and a few SFT
steps lower the loss on the learned tokens only."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.sft import (
    IGNORE_INDEX,
    SFTConfig,
    TokenExample,
    iterate_batches,
    lr_at,
    run_sft,
    sft_batch,
    token_batch,
)
from asyncrl.models.tiny import TinyModelConfig, build_tiny_model
from asyncrl.tasks.prompts import Prompt, TaskConfig, load_prompts


def addition(text: str, answer: str) -> Prompt:
    return Prompt(prompt_uid=f"addition/{text}", text=text, answer=answer, task="addition")


def test_sft_batch_masks_prompt_and_padding(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path)
    input_ids, attention_mask, labels = sft_batch(tokenizer, [addition("07+45=", "52"), addition("99+99=", "198")])
    assert input_ids.shape == attention_mask.shape == labels.shape == (2, 10)
    assert tokenizer.decode(input_ids[0, :9]) == "07+45=52<eos>"
    assert input_ids[0, 9] == tokenizer.pad_token_id and attention_mask[0].tolist() == [1] * 9 + [0]
    assert labels[0].tolist()[:6] == [IGNORE_INDEX] * 6 and labels[0, 9] == IGNORE_INDEX
    assert tokenizer.decode(labels[1, 6:]) == "198<eos>"
    assert attention_mask[1].all()


def test_sft_batch_rejects_empty(tmp_path):
    with pytest.raises(ValueError, match="0 given"):
        sft_batch(build_char_tokenizer(tmp_path), [])


def test_lr_schedule_warms_up_then_decays():
    cfg = SFTConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_batches_cover_every_prompt_each_epoch():
    prompts = [addition(f"{i:02d}+00=", str(i)) for i in range(10)]
    batches = iterate_batches(prompts, 5, seed=0)
    first_epoch = next(batches) + next(batches)
    assert sorted(p.answer for p in first_epoch) == sorted(p.answer for p in prompts)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"steps \(0\) must be >= 1"):
        SFTConfig(steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps \(50\) must be <= steps \(10\)"):
        SFTConfig(steps=10, warmup_steps=50)
    with pytest.raises(ValueError, match=r"lr \(0.0\) must be > 0"):
        SFTConfig(lr=0.0)


def answer_loss(model_dir, prompts) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    input_ids, attention_mask, labels = sft_batch(AutoTokenizer.from_pretrained(model_dir), prompts)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()


def test_a_few_steps_lower_the_loss(tmp_path):
    torch.set_num_threads(1)
    base = build_tiny_model(TinyModelConfig(), tmp_path / "base")
    prompts = load_prompts(TaskConfig(), "train")[:16]
    cfg = SFTConfig(steps=20, batch_size=16, lr=3e-3, warmup_steps=2)
    result = run_sft(base, prompts, cfg, tmp_path / "sft")
    assert result["steps"] == 20 and result["seconds"] > 0
    assert (tmp_path / "sft" / "model.safetensors").is_file() and (tmp_path / "sft" / "tokenizer.json").is_file()
    before, after = answer_loss(base, prompts), answer_loss(tmp_path / "sft", prompts)
    assert after < 0.6 * before, (before, after)
    assert result["final_loss"] < before


def test_token_batch_labels_only_the_tokens_in_the_mask():
    examples = [TokenExample([5, 6, 7, 8], [0, 1, 0, 1]), TokenExample([9, 10], [1, 1])]
    input_ids, attention_mask, labels = token_batch(examples, pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert labels.tolist() == [[IGNORE_INDEX, 6, IGNORE_INDEX, 8], [9, 10, IGNORE_INDEX, IGNORE_INDEX]]


def test_token_example_and_batch_reject_bad_input():
    with pytest.raises(ValueError, match=r"mask \(1 tokens\) must be as long as ids \(2\)"):
        TokenExample([1, 2], [1])
    with pytest.raises(ValueError, match="0 given"):
        token_batch([], pad_token_id=0)


def test_sft_on_episodes_learns_the_model_turns_and_not_the_environments(tmp_path):
    torch.set_num_threads(1)
    base = build_tiny_model(TinyModelConfig(), tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    eos = tokenizer.eos_token_id

    def episode(prompt: Prompt) -> TokenExample:
        # the prompt, a model turn, the environment's answer, the model's last turn
        parts = [(prompt.text, 0, False), ("7", 1, True), ("lower\n", 0, False), (prompt.answer, 1, True)]
        ids, mask = [], []
        for text, learned, ends in parts:
            part = tokenizer.encode(text, add_special_tokens=False) + ([eos] if ends else [])
            ids, mask = ids + part, mask + [learned] * len(part)
        return TokenExample(ids, mask)

    prompts = [addition(f"{i:02d}+00=", str(i)) for i in range(16)]
    examples = [episode(p) for p in prompts]
    run_sft(
        base,
        prompts,
        SFTConfig(steps=30, batch_size=16, lr=3e-3, warmup_steps=2),
        tmp_path / "sft",
        lambda batch: [episode(p) for p in batch],
    )

    def losses(model_dir) -> tuple[float, float]:
        """Mean loss on the model's tokens, and on the environment's."""
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        learned = token_batch(examples, tokenizer.pad_token_id)
        answer = token_batch([TokenExample(e.ids, [1 - m for m in e.mask]) for e in examples], tokenizer.pad_token_id)
        with torch.no_grad():
            return tuple(model(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss.item() for b in (learned, answer))

    (model_before, env_before), (model_after, env_after) = losses(base), losses(tmp_path / "sft")
    assert model_after < 0.5 * model_before, (model_before, model_after)
    assert env_after > 0.8 * env_before, (env_before, env_after)  # never a label: not learned
